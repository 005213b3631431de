"""LLM runtime: prefill and decode steps over a KV cache whose layers may hold different token sets.

In-LLM pruning (FastV, MustDrop, Dynamic-LLaVA, ...) drops tokens at some decoder layer K, so layers
>= K cache fewer slots than layers < K. mmfast models this with *layer groups*: consecutive layers
that share one slot layout. Group 0 is what transformers itself sees (the 2-D mask and position ids
passed to the language model); every later group has its own slot-validity mask, RoPE positions and
provenance, and forward pre-hooks on its layers swap in the group's hidden states (at prefill, when
the group is created), 4-D mask, position ids and RoPE tables. Without pruning there is one group
and no hooks: the language model runs untouched.

Positions follow each method's paper: ``original`` keeps each kept token's position id (FastV's
in-place variant, Dynamic-LLaVA); ``compact`` renumbers the survivors 0..L'-1 (MustDrop, PDrop).

Multimodal RoPE (Qwen-VL): positions are [B, T, 3] (temporal, height, width) everywhere a 1-D family
has [B, T]; every slot edit (gather, crop, reorder, rollback) carries the 3 axes. A new token goes at
(max over the group's valid positions and axes) + 1 (+ its tree depth), replicated on the 3 axes, as
HF's ``rope_deltas`` places it. ``compact`` under M-RoPE (:func:`mmfast.models.mrope.compact_positions`)
closes the gaps between spans: text tokens are renumbered consecutively, and each image's kept tokens
keep their (t, h, w) offsets from the image's kept minimum per axis, starting at the running position;
the next span starts after the image's maximum.

Static KV cache (``model.compile``; :meth:`LMRunner.static_cache`): the cache layers are preallocated
buffers (``compat.StaticSlotLayer``) sized at prefill per layer, the groups keep describing the held
slots, and a decode step attends over each group's whole buffer with a mask padded to it, so its shapes
are fixed; such a step may run as one captured graph (:class:`StepGraph`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from . import compat
from .hooks.attention import Carried, capture_blocker
from .hooks.session import is_prefill_only
from .models.base import LMInputs, VLMAdapter
from .models.captured_tower import CapturedCalls, eager_call

if TYPE_CHECKING:
    from .hooks.session import HookSession

logger = logging.getLogger(__name__)


@dataclass
class LayerGroup:
    """Slot layout shared by decoder layers ``start`` .. (next group's start - 1)."""

    start: int
    key_mask: torch.Tensor  # [B, T] bool: slot holds a real token
    positions: torch.Tensor  # [B, T] long: RoPE position of each slot
    source: torch.Tensor  # [B, T] long: index of the slot's token in the prefill sequence (-1: generated/pad)
    compact: bool = False
    ref_start: float | None = None  # start layer in the method's reference (paper) depth, for accounting
    # set for the duration of one forward by the runner / hooks
    fwd_mask: torch.Tensor | None = None
    fwd_pos_ids: torch.Tensor | None = None
    fwd_pos_emb: tuple[torch.Tensor, torch.Tensor] | None = None
    #: (key_mask, positions, [B, 1] top position) known without a reduction: set by a decode step's
    #: append, valid while the group still holds those two tensors (any edit replaces them)
    _top: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = field(default=None, repr=False, compare=False)

    @property
    def length(self) -> int:
        return int(self.key_mask.shape[1])

    def top_position(self) -> torch.Tensor:
        """[B, 1] largest position id of a valid slot (M-RoPE: max over the 3 axes too; -1: none)."""
        if self._top is not None and self._top[0] is self.key_mask and self._top[1] is self.positions:
            return self._top[2]
        pos = self.positions if self.positions.dim() == 2 else self.positions.amax(-1)
        return pos.masked_fill(~self.key_mask, -1).amax(1, keepdim=True)

    def next_positions(self) -> torch.Tensor:
        """[B] position id of the next appended token (M-RoPE: max over the 3 axes too)."""
        return self.top_position()[:, 0] + 1

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.key_mask, self.positions, self.source = fn(self.key_mask), fn(self.positions), fn(self.source)


@dataclass
class StepOutput:
    logits: torch.Tensor  # [B, Q, V] fp32 (Q = 1 for prefill: last position only)
    hidden: torch.Tensor  # [B, Q, d] final-norm hidden states at the same positions


@dataclass
class TokenAccounting:
    """Per-layer token counts of one state, for FLOPs and equivalent-token accounting."""

    prefill_tokens: torch.Tensor | None = None  # [B, n_layers] text + vision tokens prefill computed
    prefill_vision: torch.Tensor | None = None  # [B, n_layers] vision tokens prefill computed
    #: [B, n_layers] a KV policy's layer-wise *equivalent* vision count (ZipVL keeps every token but
    #: treats some as unimportant); replaces the slot count when set
    vision_override: torch.Tensor | None = None
    #: [B] float64 on the host: the logical KV bytes of a cache a KV policy did not build because nothing reads it
    #: (a call whose prefill gives its only token: ZipVL's quantised cache, MustDrop's trimmed one); replaces the
    #: layers' count when set
    kv_bytes_unbuilt: torch.Tensor | None = None

    def select(self, index: torch.Tensor) -> TokenAccounting:
        pick = lambda t: None if t is None else t[index.to(t.device)]  # noqa: E731
        return TokenAccounting(
            pick(self.prefill_tokens),
            pick(self.prefill_vision),
            pick(self.vision_override),
            pick(self.kv_bytes_unbuilt),
        )


@dataclass
class LMState:
    """One branch's decoding state: inputs, cache and layer groups.

    What methods learn about this state's tokens lives here too, never on the method: ``extras``
    (method-private per-state data, keyed by method name) and ``stats`` (method name -> statistics,
    ``per_sample_*`` lists indexed by row), so branches batched together or decoded apart never mix.
    """

    inputs: LMInputs
    cache: Any
    groups: list[LayerGroup]
    n_layers: int
    extras: dict[str, Any] = field(default_factory=dict)
    text_config: Any = None
    stats: dict[str, dict[str, Any]] = field(default_factory=dict)
    accounting: TokenAccounting = field(default_factory=TokenAccounting)

    def stats_rows(self, n: int, start: int = 0) -> dict[str, dict[str, Any]]:
        """``stats`` restricted to rows ``start .. start + n - 1`` (``per_sample_*`` lists sliced; a method that
        counts on the device during decoding keeps a ``per_sample_*`` tensor, read here as a list)."""

        def cut(d: dict[str, Any]) -> dict[str, Any]:
            out = {}
            for k, v in d.items():
                if isinstance(v, dict):
                    out[k] = cut(v)
                elif k.startswith("per_sample_") and isinstance(v, list | torch.Tensor):
                    out[k] = v[start : start + n] if isinstance(v, list) else v[start : start + n].tolist()
                else:
                    out[k] = v
            return out

        return {name: cut(d) for name, d in self.stats.items()}

    @property
    def batch_size(self) -> int:
        return int(self.groups[0].key_mask.shape[0])

    def group_of(self, layer_idx: int) -> int:
        g = 0
        for i, grp in enumerate(self.groups):
            if grp.start <= layer_idx:
                g = i
        return g

    def layers_of(self, g: int) -> range:
        end = self.groups[g + 1].start if g + 1 < len(self.groups) else self.n_layers
        return range(self.groups[g].start, end)

    def vision_slots(self, g: int) -> torch.Tensor:
        """[B, T_g] bool: slots of group g that hold vision tokens."""
        grp = self.groups[g]
        src = grp.source.clamp(min=0)
        return self.inputs.image_mask.gather(1, src) & (grp.source >= 0) & grp.key_mask

    # -- cache edits ------------------------------------------------------------------------------
    def crop_last(self, n: int) -> None:
        """Drop the last n slots of every layer (speculative rollback)."""
        if n <= 0:
            return
        compat.crop_last(self.cache, n)
        for grp in self.groups:
            grp._map(lambda t: t[:, :-n])

    def select_slots(self, g: int, index: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Keep slots ``index`` ([B, T']) of group g in all its layers (KV-cache policies)."""
        grp = self.groups[g]
        for layer in self.layers_of(g):
            lay = self.cache.layers[layer]
            idx = index[:, None, :, None].expand(-1, lay.keys.shape[1], -1, lay.keys.shape[-1])
            compat.set_layer_kv(self.cache, layer, lay.keys.gather(2, idx), lay.values.gather(2, idx))
        grp._map(lambda t: gather_slots(t, index))
        if valid is not None:
            grp.key_mask = grp.key_mask & valid

    def keep_new(self, n_new: int, keep: torch.Tensor, *, prefix: bool = False) -> None:
        """Of the last ``n_new`` slots of every layer, keep those at ``keep`` ([k], ascending), in order.

        Speculative rollback: the accepted root-to-leaf path of a verified draft tree is copied to the
        front of the new block and the rest cropped (no copy of the prefix). ``prefix``: the caller
        knows ``keep`` is 0..k-1 (a chain accepted from its start), so the rest is only cropped.
        """
        k = int(keep.numel())
        if prefix:
            self.crop_last(n_new - k)
            return
        for layer in self.cache.layers:
            if isinstance(layer, compat.StaticSlotLayer):  # in the buffer, no views of the held slots
                layer.keep_new(n_new, keep)
                continue
            total = layer.keys.shape[2]
            start = total - n_new
            src = start + keep.to(layer.keys.device)
            layer.keys[:, :, start : start + k] = layer.keys[:, :, src]
            layer.values[:, :, start : start + k] = layer.values[:, :, src]
            layer.keys = layer.keys[:, :, : start + k]
            layer.values = layer.values[:, :, : start + k]
        self.keep_layout(n_new, keep)

    def keep_layout(self, n_new: int, keep: torch.Tensor) -> None:
        """:meth:`keep_new`'s layer-group layout (key mask, positions, sources) without the cache."""
        for grp in self.groups:
            start = grp.length - n_new
            idx = torch.cat([torch.arange(start, device=keep.device), start + keep])
            grp._map(lambda t: t[:, idx])

    def checkpoint(self) -> tuple[list[int], list[tuple[torch.Tensor, ...]]]:
        """Per-layer cache lengths and group layouts, to undo temporary appends (self-drafting)."""
        lengths = [compat.layer_length(self.cache, i) for i in range(len(self.cache.layers))]
        return lengths, [(g.key_mask, g.positions, g.source) for g in self.groups]

    def rollback(self, cp: tuple[list[int], list[tuple[torch.Tensor, ...]]]) -> None:
        lengths, layouts = cp
        for i, n in enumerate(lengths):
            extra = compat.layer_length(self.cache, i) - n
            if extra > 0:
                self.cache.layers[i].crop(-extra)
        for grp, (km, pos, src) in zip(self.groups, layouts):
            grp.key_mask, grp.positions, grp.source = km, pos, src

    def reorder(self, index: torch.Tensor) -> None:
        """Reorder/select batch rows (beam search)."""
        self.cache.reorder_cache(index)
        self.reorder_layout(index)

    def reorder_layout(self, index: torch.Tensor) -> None:
        """:meth:`reorder`'s layouts, inputs and accounting without the cache."""
        for grp in self.groups:
            grp._map(lambda t: t[index])
        self.inputs = self.inputs.select(index)
        self.accounting = self.accounting.select(index)

    def keep_rows(self, n: int) -> None:
        """Keep the first ``n`` batch rows (a static cache keeps them in place: ``compat.keep_first_rows``)."""
        index = torch.arange(n, device=self.groups[0].key_mask.device)
        compat.keep_first_rows(self.cache, n)
        for grp in self.groups:
            grp._map(lambda t: t[:n])
        self.inputs = self.inputs.select(index)
        self.accounting = self.accounting.select(index)

    def repeat_interleave(self, n: int) -> None:
        """Repeat every batch row n times (beam search expansion after a single prefill)."""
        if n == 1:
            return
        index = torch.arange(self.batch_size, device=self.groups[0].key_mask.device).repeat_interleave(n)
        self.cache.batch_repeat_interleave(n)
        for grp in self.groups:
            grp._map(lambda t: t.repeat_interleave(n, 0))
        self.inputs = self.inputs.select(index)
        self.accounting = self.accounting.select(index)

    def clone(self) -> LMState:
        return self.clone_layout(compat.clone_cache(self.cache))

    def rows(self, index: torch.Tensor, into: LMState | None = None, pool: Any = None) -> LMState:
        """A new state of rows ``index`` ([R] long): on a static cache in buffers of its own
        (:func:`compat.static_rows`, no copy of the other rows; ``pool``: a pool set's kept buffers where they fit),
        or in ``into``'s (a state this method made before) where they take them, so the graphs captured on them
        serve it (OPERA's beams of the next sample: :func:`compat.copy_static_rows`); else a clone with those rows
        selected. :meth:`LMRunner.rows` gives it the pool's next set under captured steps."""
        if not compat.is_static(self.cache):
            out = self.clone()
            out.reorder(index)
            return out
        if into is not None and compat.copy_static_rows(into.cache, self.cache, index):
            cache = into.cache
        else:
            cache = compat.static_rows(self.cache, index, pool)
        out = self.clone_layout(cache)
        out.reorder_layout(index)
        return out

    def clone_layout(self, cache: Any) -> LMState:
        """This state's layouts, inputs, extras and statistics copied, over ``cache``."""
        return LMState(
            self.inputs,
            cache,
            [copy.copy(g) for g in self.groups],
            self.n_layers,
            dict(self.extras),
            self.text_config,
            {k: dict(v) for k, v in self.stats.items()},
            dataclasses.replace(self.accounting),
        )

    def kv_bytes(self) -> int:
        """Bytes the cache tensors hold, padding included."""
        return compat.cache_bytes(self.cache)

    def kv_bytes_per_sample(self) -> list[int]:
        """Logical KV bytes per sample: valid slots x bytes per slot, summed over layers.

        Cache layers that store tokens at different precisions expose ``bytes_per_sample(valid)``, and their class
        may sum a layer group's layers at once (``bytes_of_layers(layers, valid)``, a static method). A KV policy
        that left its cache unbuilt publishes its bytes in ``accounting.kv_bytes_unbuilt``, returned instead.
        """
        if self.accounting.kv_bytes_unbuilt is not None:
            return [int(x) for x in self.accounting.kv_bytes_unbuilt.tolist()]
        total = torch.zeros(self.batch_size, dtype=torch.float64)
        per_slot = [0] * len(self.groups)  # bytes of one slot summed over each group's plain layers
        together: dict[tuple, list] = {}  # (group, the class's summing function): its layers
        for layer_idx, lay in enumerate(self.cache.layers):
            g = self.group_of(layer_idx)
            summed = getattr(type(lay), "bytes_of_layers", None)
            custom = getattr(lay, "bytes_per_sample", None)
            if callable(summed):
                together.setdefault((g, summed), []).append(lay)
            elif callable(custom):
                total += torch.as_tensor(custom(self.groups[g].key_mask), dtype=torch.float64).cpu()
            else:
                per_slot[g] += compat.slot_bytes(lay)
        for (g, summed), lays in together.items():
            total += summed(lays, self.groups[g].key_mask)
        # [G, B] valid slots of each layer group, read to the host once (a read per layer was a device sync each:
        # 64 per call on a 32-layer LLM, inside every TTFT)
        held = torch.stack([g.key_mask.sum(1) for g in self.groups]).double().cpu()
        total += (held * torch.tensor(per_slot, dtype=torch.float64)[:, None]).sum(0)
        return [int(x) for x in total.tolist()]

    def vision_tokens_per_layer(self) -> torch.Tensor:
        """[B, n_layers] number of cached vision tokens each layer holds.

        A KV policy that keeps every token but treats some as unimportant (ZipVL) publishes its
        layer-wise *equivalent* count in ``accounting.vision_override``, which is returned instead.
        """
        override = self.accounting.vision_override
        if override is not None:
            return override
        counts = [self.vision_slots(g).sum(1) for g in range(len(self.groups))]
        return torch.stack([counts[self.group_of(layer)] for layer in range(self.n_layers)], dim=1)

    def tokens_per_layer(self) -> torch.Tensor:
        """[B, n_layers] number of valid cached tokens (text + vision) each layer holds."""
        counts = [g.key_mask.sum(1) for g in self.groups]
        return torch.stack([counts[self.group_of(layer)] for layer in range(self.n_layers)], dim=1)


@dataclass
class PrefillView:
    """What an in-LLM pruner sees when its layer is reached during prefill."""

    layer: int
    hidden: torch.Tensor  # [B, T, d] hidden states entering ``layer``
    state: LMState
    group: LayerGroup  # the layout of those T slots
    vision: torch.Tensor  # [B, T] bool vision slots
    text_after: torch.Tensor  # [B, T] bool instruction/assistant-prompt slots after the image

    @functools.cached_property
    def images(self) -> torch.Tensor:
        """[B, T] long: the image (of its sample) each vision slot comes from, -1 elsewhere."""
        src = self.group.source
        image = self.state.inputs.image_index.gather(1, src.clamp(min=0)).masked_fill(src < 0, -1)
        return image.masked_fill(~self.vision, -1)


@dataclass
class SlotEdit:
    """A select function's answer when it does more than drop slots (SparseVLM's token recycling).

    ``keep`` is the keep mask as usual; the kept slots in ``replace`` continue with ``hidden`` instead of
    their own hidden state, and ``order`` (a sort key per slot, stable) lays the kept slots out in the
    new group (default: slot order), e.g. to put merged tokens right after the kept image tokens.
    """

    keep: torch.Tensor  # [B, T] bool
    replace: torch.Tensor | None = None  # [B, T] bool kept slots whose hidden state is replaced
    hidden: torch.Tensor | None = None  # [B, T, d] the replacements (read where ``replace``)
    order: torch.Tensor | None = None  # [B, T] float64 layout key of the kept slots


# A pruner hook: PrefillView -> keep mask [B, T] bool over ALL slots (None = keep all), or a SlotEdit.
# Slots a pruner does not decide about must be True; several pruners on one layer are ANDed (their
# reorderings add up as displacements from the slot order).
SelectFn = Callable[[PrefillView], "torch.Tensor | SlotEdit | None"]
# A decode hook at a layer: (layer, hidden [B, Q, d], state) -> None (may set state.extras)
DecodeFn = Callable[[int, torch.Tensor, LMState], None]


class LMRunner:
    """Runs prefill and decode steps of one VLM's language model, honouring layer groups."""

    def __init__(self, adapter: VLMAdapter, session: HookSession | None = None) -> None:
        self.adapter = adapter
        self.session = session
        self.lm = adapter.language_model
        self.n_layers = len(adapter.layers)
        self._select: dict[int, list[tuple[SelectFn, bool, float | None]]] = {}
        self._decode: dict[int, list[DecodeFn]] = {}
        self._hooked_from: int | None = None
        self._active: LMState | None = None
        self._phase = "idle"
        self.use_cache = True  # False: every decode step recomputes the whole sequence
        #: static KV cache (``model.compile``): free slots per layer after the prefill, or None for a
        #: dynamic cache. Set for one decode call by :meth:`static_cache`.
        self.static_reserve: int | None = None
        #: captured static steps: a graph factory (:class:`CudaGraph` on CUDA), or None for eager
        #: static steps; their capture time adds up here
        self.capture: Callable[[], StepGraph] | None = None
        self.capture_s = 0.0
        #: the captured steps and the static buffers they read, kept from one decode call to the next
        #: (the next call replays them when its cache takes the same buffers); :meth:`release` frees them
        self.pool = compat.StaticBufferPool()
        self.pad_token_id = 0  # what left padding holds (the session sets the tokenizer's)
        self._prefill_refused = False  # a prefill capture failed once: prefills run eagerly from then on
        self._by_hand = False  # the runner runs the prefill's layers itself (its layer hooks step aside)
        self._block_caches: list = []  # this block's static caches that the pool serves, in prefill order
        self._consts: dict[tuple, torch.Tensor] = {}  # decode-step constants (:meth:`_const`)
        self._capture_refusals: set[str] = set()  # reasons already logged
        self._block_blocker: str | None | object = _UNCHECKED  # this static block's capture blocker
        self._block_staging: list[Carried] | None = None  # its decode hooks' ``before_step`` (found once a block)
        self._block_prefill_blocker: str | None | object = _UNCHECKED  # and its prefill's
        self._block_segments: dict[range, tuple[str | None, list]] = {}  # and each prefill segment's (_segment_blocker)
        self.skip_noop_groups = True  # a keep-everything decision creates no new layer group
        #: ``calls(key, fn, *tensors)``: the new layer group's layout (:func:`group_layout`) as a captured call where
        #: the session captures (:class:`~mmfast.models.captured_tower.CapturedCalls`, set by it), else eagerly
        self.calls: Callable[..., Any] = eager_call
        self.scoring_s = 0.0  # time spent in pruners' select functions (reset per batch by the session)
        self.prefill_hooks: list[Callable[[LMState], None]] = []  # KV policies after prefill
        self.step_hooks: list[Callable[[LMState], None]] = []  # KV policies after each decode step
        #: what the methods' graph-safe Python branches on in a forward of a state (layer skip's draft mode, VHR's
        #: phase, OPERA's look-ahead): part of a captured step's or prefill segment's key, so a graph recorded on one
        #: branch never replays for another
        self.graph_variants: list[Callable[[LMState], Hashable]] = []
        # Qwen3-VL deepstack: after LLM layers 0..n-1 of prefill, add each vision slot's level-i feature
        # (the LMInputs tag carried with the tokens, so pruned layouts get the right rows)
        self.deepstack_levels = int(getattr(adapter, "deepstack_levels", 0))
        if self.deepstack_levels and session is not None:
            for i in range(self.deepstack_levels):
                session.forward_hook(adapter.layers[i], self._make_deepstack_hook(i), prefill_only=True)

    # -- registration (by pruners, through the session) -------------------------------------------
    def prune_at(self, layer: int, fn: SelectFn, *, compact: bool = False, ref_layer: float | None = None) -> None:
        """Call ``fn`` when prefill reaches ``layer``; its keep mask starts a new layer group there.

        ``compact`` renumbers the survivors' positions; ``ref_layer`` is the layer in the method's
        reference depth (e.g. 32 for LLaVA-1.5-7B), used to project FLOPs onto that shape.
        """
        if not 0 < layer < self.n_layers:
            raise ValueError(f"prune layer {layer} must be in 1..{self.n_layers - 1}")
        self._select.setdefault(layer, []).append((fn, compact, ref_layer))
        self._ensure_hooks(layer)

    def on_decode(self, layer: int, fn: DecodeFn) -> None:
        """Call ``fn(layer, hidden, state)`` when a decode step reaches ``layer``. A ``fn`` marked
        :func:`~mmfast.hooks.attention.replayable` (its work depends on shapes only, its result carried) runs
        inside a captured step; any other keeps the step eager (:meth:`capture_blocker`)."""
        self._decode.setdefault(layer, []).append(fn)
        self._ensure_hooks(layer)

    def _ensure_hooks(self, layer: int) -> None:
        if self.session is None:
            raise RuntimeError("layer hooks need a HookSession")
        start = layer if self._hooked_from is None else min(layer, self._hooked_from)
        stop = self.n_layers if self._hooked_from is None else self._hooked_from
        for i in range(start, stop):
            self.session.pre_hook(self.adapter.layers[i], self._make_layer_hook(i), with_kwargs=True)
        self._hooked_from = start

    @property
    def active(self) -> LMState | None:
        """The state whose forward is running (None between forwards): for callbacks such as probe
        row selectors that need the current batch's data."""
        return self._active

    @contextlib.contextmanager
    def static_cache(
        self, reserve: int | None, capture: Callable[[], StepGraph] | None = None, *, decodes: bool = True
    ) -> Iterator[None]:
        """States prefilled inside the block get a static KV cache with ``reserve`` free slots per
        layer (None: the dynamic cache), and their decode steps run with fixed shapes; with
        ``capture`` (a graph factory) each step shape is captured once and replayed. ``decodes``: False
        for a call whose prefill gives its only token (kept buffers of any larger capacity serve it)."""
        before = self.static_reserve, self.capture
        self.static_reserve, self.capture = reserve, capture if reserve is not None else None
        self._block_blocker = self._block_prefill_blocker = _UNCHECKED
        self._block_staging = None
        self._block_segments = {}
        self.pool.loose = not decodes
        try:
            yield
        finally:
            self.static_reserve, self.capture = before
            self.pool.loose = False
            self._block_blocker = self._block_prefill_blocker = _UNCHECKED
            self._block_staging = None
            self._block_segments = {}
            if self._block_caches:  # their buffers, and the graphs on them, serve the next call
                self.pool.keep(self._block_caches)
                self._block_caches = []

    def cache_unread(self, state: LMState) -> bool:
        """Whether nothing reads ``state``'s cache after its prefill (a one-token call on the static cache): a KV
        policy may leave its cache unbuilt and publish the bytes it would hold (``TokenAccounting.kv_bytes_unbuilt``)."""
        return compat.is_static(state.cache) and not self.decodes

    @property
    def decodes(self) -> bool:
        """This block's calls decode after the prefill (False: one-token calls, :meth:`static_cache`'s ``decodes``)."""
        return not self.pool.loose

    @property
    def captures(self) -> bool:
        """This block's static steps run as captured graphs (one per step shape): a caller whose step
        width varies (a verify tree) pads it to one width to use one graph."""
        if self.capture is None or self.static_reserve is None:
            return False
        if self._block_blocker is _UNCHECKED:
            self._block_blocker = self.capture_blocker()
        return self._block_blocker is None

    def rows(self, state: LMState, index: torch.Tensor, into: LMState | None = None) -> LMState:
        """:meth:`LMState.rows`; under captured steps a new static state takes the pool's next set of buffers and
        joins this block's caches, so the next call's takes the same buffers and replays the graphs captured on
        them (OPERA's beams: their step, look-ahead and reorder graphs)."""
        n = len(self._block_caches)
        if into is not None or self.capture is None or not compat.is_static(state.cache) or n >= self.pool.max_sets:
            return state.rows(index, into)
        out = state.rows(index, pool=self.pool.set(n))
        self._block_caches.append(out.cache)
        return out

    def finish(self, state: LMState) -> None:
        """``state`` is done with (sequential per-sample decoding): the block's static buffers, its among them, and
        the graphs captured on them, serve the next prefills of this block."""
        if any(state.cache is cache for cache in self._block_caches):
            self.pool.keep(self._block_caches)
            self._block_caches = []

    def release(self) -> None:
        """Free the kept static buffers, captured steps and layout graphs (the session closes)."""
        self.pool.clear()
        if isinstance(self.calls, CapturedCalls):
            self.calls.graphs.clear()

    # -- forward passes ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def _activate(self, state: LMState, phase: str) -> Iterator[None]:
        self._active, self._phase = state, phase
        decoding = self.session is not None and self.session.decoding
        if self.session is not None:  # prefill-only hooks and attention recorders step aside
            self.session.decoding = phase == "decode"
        try:
            yield
        finally:
            self._active, self._phase = None, "idle"
            if self.session is not None:
                self.session.decoding = decoding
            for grp in state.groups:
                grp.fwd_mask = grp.fwd_pos_ids = grp.fwd_pos_emb = None

    @torch.inference_mode()
    def prefill(self, inputs: LMInputs, *, all_hidden: bool = False) -> tuple[LMState, StepOutput]:
        """Run the prompt; returns the state and the logits of the last position.

        ``hidden`` is the final-norm hidden state of the last position, or of every slot of the last
        layer group with ``all_hidden`` (what EAGLE-style drafts consume).
        """
        cfg = self.adapter.text_config
        pool = None  # captured steps: the buffers come from (and go back to) the pool; eager ones need no pool
        n = len(self._block_caches)  # the call's n-th prefill takes the pool's n-th set (a branch's other prompt)
        if self.static_reserve is not None and self.capture is not None and n < self.pool.max_sets:
            pool = self.pool.set(n)
        # a static cache's prefill has fixed shapes: left-padded to a multiple of PREFILL_BUCKET and run layer by
        # layer by the runner, in segments between in-LLM pruning layers; the same kernels eagerly (compile:
        # static) or each segment as one captured graph per shape where no Python of a method runs inside it
        if self.static_reserve is not None and self._block_prefill_blocker is _UNCHECKED:  # hooks are set: once a block
            self._block_prefill_blocker = self.prefill_blocker()
        # every slot's hidden state (EAGLE-style drafts) comes back without the bucket's padding where the last
        # layer group keeps every slot (no in-LLM pruning); with in-LLM pruning it takes the model's own forward
        padded = (
            self.static_reserve is not None
            and not (all_hidden and self._select)
            and self._block_prefill_blocker is None
        )
        graph = padded and pool is not None and not self._prefill_refused
        pad = -inputs.length % PREFILL_BUCKET if padded else 0
        if padded:
            inputs = inputs.pad_left(pad, self.pad_token_id, inputs.embeds.new_zeros(inputs.embeds.shape[-1]))
        bsz, length = inputs.input_ids.shape
        src = torch.arange(length, device=inputs.input_ids.device).expand(bsz, -1)
        mask = inputs.attention_mask.bool()
        grp0 = LayerGroup(0, mask, inputs.position_ids, src.masked_fill(~mask, -1))
        if self.static_reserve is None:
            cache = compat.new_cache(cfg)
        else:
            cache = compat.new_static_cache(cfg, self.static_reserve, pool)
            if pool is not None:
                self._block_caches.append(cache)
        state = LMState(inputs, cache, [grp0], self.n_layers, text_config=cfg)
        with self._activate(state, "prefill"):
            if padded:
                full = self._prefill_segments(state, graph)[:, pad:]  # [B, T, d] after the final norm, unpadded
            else:
                out = self.lm(
                    inputs_embeds=inputs.embeds,
                    attention_mask=inputs.attention_mask,
                    position_ids=self.adapter.lm_position_ids(inputs.position_ids),
                    **compat.cache_kwargs(state.cache),
                    use_cache=True,
                )
                full = out.last_hidden_state  # [B, T', d]; the last slot always survives pruning
        # what prefill computed, before KV policies trim the cache (FLOPs and equivalent tokens)
        state.accounting.prefill_tokens = state.tokens_per_layer()
        state.accounting.prefill_vision = state.vision_tokens_per_layer()
        for hook in self.prefill_hooks:
            hook(state)
        last = full[:, -1:]  # [B, 1, d]
        return state, StepOutput(self.adapter.lm_head(last).float(), full if all_hidden else last)

    def prefill_blocker(self) -> str | None:
        """Why the prefill does not run in fixed shapes, layer by layer (:meth:`_prefill_segments`): Qwen3-VL's
        deepstack additions, hooks on the language model's own module (its layers run without it); and
        without in-LLM pruning, anything that keeps it from being one captured graph (a hook on any of its
        modules, prefill-only ones included, attention probes or recorders). None: it does."""
        if self.deepstack_levels:
            return "deepstack features"
        if self.lm._forward_pre_hooks or any(
            not compat.is_inert_output_hook(h) for h in self.lm._forward_hooks.values()
        ):
            return "hooks on the language model"
        if self._select:
            return None
        return self._segment_blocker(range(self.n_layers))[0]

    def prefill_graph_blocker(self) -> str | None:
        """Why a static prefill of this session would not run as captured segments (None: every segment would)."""
        blocker = self.prefill_blocker()
        edges = [0, *sorted(self._select), self.n_layers]
        for a, b in zip(edges, edges[1:]):
            blocker = blocker or self._segment_blocker(range(a, b))[0]
        return blocker

    def _segment_blocker(self, layers: range) -> tuple[str | None, list[Carried]]:
        """Why the prefill's ``layers`` (the final norm with the last) cannot be one captured graph (None: they
        can), and the results their recorders carry across a replay; once per static block (hooks are set by
        then). The runner's own layer hooks step aside in a segment, and a prefill recorder whose work depends
        on shapes only (a :class:`~mmfast.hooks.attention.Carried`: a probe of ``last_row`` or ``cls_row``,
        DART's key norms), or on rows known before the segment runs (SparseVLM's raters, MustDrop's text rows:
        staged as the graph's input), is replayed with its result (:func:`~mmfast.hooks.attention.capture_blocker`)."""
        found = self._block_segments.get(layers)
        if found is None:
            mods = [self.lm.rotary_emb, *(self.adapter.layers[i] for i in layers)]
            if layers.stop == self.n_layers:
                mods.append(self.lm.norm)
            carried: list[Carried] = []
            blocker = capture_blocker(mods, "the language model's layers", own=_is_runner_hook, carried=carried)
            found = self._block_segments[layers] = (blocker, carried)
        return found

    def _prefill_segments(self, state: LMState, graph: bool) -> torch.Tensor:
        """The prefill of ``state`` (inputs left-padded to a bucket) on its static cache, run by the runner: the
        layers from one in-LLM pruning layer to the next are a segment; between segments the pruners select
        eagerly (:meth:`_prune`, their kept length rounded up to PREFILL_BUCKET slots so that segment shapes
        repeat). With ``graph`` (the cache from the pool) a segment is one captured graph where
        :meth:`_segment_blocker` finds nothing against it (:meth:`_segment`). Returns [B, T, d] after the final
        norm (T: the last layer group's slots)."""
        edges = [0, *sorted(self._select), self.n_layers]
        hidden = state.inputs.embeds  # [B, T, d]
        self._by_hand = True
        try:
            for a, b in zip(edges, edges[1:]):
                if a:
                    hidden = self._prune(a, hidden, state, bucket=PREFILL_BUCKET)  # [B, T', d]
                hidden = self._segment(state, range(a, b), hidden, graph)
        finally:
            self._by_hand = False
        return hidden

    def _segment(self, state: LMState, layers: range, hidden: torch.Tensor, graph: bool) -> torch.Tensor:
        """``layers`` of the prefill over ``hidden`` ([B, T, d], the layout of their layer group): eagerly, or
        as a graph captured once per segment, shape and cache buffers. Its inputs are the hidden states, the
        group's slot validity and positions; the mask is built inside it and the K/V written into the pool's
        buffers, so a later call whose cache takes the same buffers replays it. An attention probe inside
        it writes its record into the graph's memory: put back after each replay (the warm-up's stands for
        the call that captures). Returns [B, T, d] (after the final norm for the last segment)."""
        cache, grp = state.cache, state.groups[state.group_of(layers.start)]
        length = hidden.shape[1]
        compat.bind_static(cache, self.adapter.text_config, hidden, length, layers)
        live = _SegmentInputs(hidden, grp.key_mask, grp.positions)
        if not graph or self._prefill_refused:
            return self._segment_forward(layers, live)
        blocker, carried = self._segment_blocker(layers)
        if blocker is not None:
            return self._segment_forward(layers, live)
        stages = [c.stage for c in carried if c.stage is not None]
        staged = tuple(stage(length) for stage in stages)  # probe rows picked from this batch, in the graph's memory
        try:
            key = (
                compat.static_buffers(cache, layers),
                "prefill",
                layers.start,
                live.shapes(),
                staged,
                self._variant(state),
            )
            return self._segment_graph(cache, layers, live, carried, key)
        finally:
            for stage in stages:
                stage(None)

    def _segment_graph(self, cache, layers: range, live: _SegmentInputs, carried: list[Carried], key: tuple):
        """:meth:`_segment`'s captured graph under ``key``: replayed, or captured (and run) by this call."""
        length = live.hidden.shape[1]
        captured = self.pool.graphs.get(key)
        if captured is not None:
            captured.static.load(live)
            out = captured.graph.replay().clone()
            compat.set_static_lengths(cache, length, layers=layers)  # the graph moved the device write indices
            _put_back(captured.static.records)
            return out
        static = _SegmentInputs(*(t.clone() for t in live.tensors()))

        def run() -> torch.Tensor:
            return self._segment_forward(layers, static)

        step_graph = self.capture()
        out = step_graph.warmup(run).clone()  # this segment, and the capture's warm-up
        warm = [(c, c.get()) for c in carried]
        compat.set_static_lengths(cache, 0, device=True, layers=layers)  # the capture writes them again from slot 0
        try:
            step_graph.capture(run)
        except Exception as exc:  # noqa: BLE001  a segment that cannot be captured ran eagerly above
            logger.info(
                "model.compile: auto: the prefill runs without a captured graph (%s: %s)", type(exc).__name__, exc
            )
            self._prefill_refused = True
        compat.set_static_lengths(cache, length, device=True, layers=layers)
        if not self._prefill_refused:
            static.records = [(c, c.get()) for c in carried]
            self.pool.graphs[key] = _Captured(step_graph, static)
        _put_back(warm)  # this call's results are the warm-up's (the capture's are the graph's)
        self.capture_s += step_graph.capture_s
        return out

    def _segment_forward(self, layers: range, inputs: _SegmentInputs) -> torch.Tensor:
        """``layers`` over ``inputs`` on the running state's cache, called as the text model calls them: the
        mask built from the slot validity on the device (causal among valid slots, each slot sees itself), the
        rotary embeddings of the positions; the final norm after the last layer."""
        hidden, valid, pos = inputs.hidden, inputs.key_mask, inputs.positions
        bsz, length = valid.shape
        causal = torch.ones(length, length, dtype=torch.bool, device=valid.device).tril()  # [T, T]
        impl = self.adapter.text_config._attn_implementation
        dtype = self.adapter.lm_head.weight.dtype
        mask = compat.format_mask(_block_causal_mask(valid, causal.expand(bsz, -1, -1)), impl, dtype)  # [B, 1, T, T]
        pos_ids = self.adapter.lm_position_ids(pos)
        emb = self.lm.rotary_emb(hidden, position_ids=pos_ids)
        text_pos = pos if pos.dim() == 2 else None  # what the LM hands its layers: None under M-RoPE
        cache = self._active.cache
        for i in layers:
            hidden = compat.decoder_layer(self.adapter.layers[i], hidden, mask, emb, text_pos, cache)
        if layers.stop == self.n_layers:
            return self.lm.norm(hidden)
        return hidden

    @torch.inference_mode()
    def step(
        self,
        state: LMState,
        tokens: torch.Tensor,
        *,
        depth: torch.Tensor | None = None,
        block_mask: torch.Tensor | None = None,
        embeds: torch.Tensor | None = None,
        all_logits: bool = True,
        graph: bool = True,
    ) -> StepOutput:
        """Append ``tokens`` ([B, Q]) and return logits for them ([B, Q, V]).

        ``depth`` ([Q] or [B, Q]) offsets the new positions (tree drafts: position = next + depth);
        ``block_mask`` ([Q, Q] or [B, Q, Q] bool) says which new tokens see which (default causal).

        On a static cache every group's mask covers its layers' whole buffer ([B, 1, Q, C_g], free
        slots masked) and the layers attend over all C_g slots: the step's shapes depend on Q and the
        capacities only, not on how many tokens are held. Those masks come from each group's slot
        validity and its layers' device write index (:func:`static_step_mask`), inside the graph when
        the step is captured; the host keeps the groups' layouts (``key_mask`` etc.) as on a dynamic cache.
        ``graph`` False: a static step of a width that recurs seldom (OPERA's rollback re-forwards its kept
        prefix) runs eagerly rather than being captured as a graph of its own.
        """
        bsz, q = tokens.shape
        dev = tokens.device
        custom = block_mask is not None
        if custom:
            block_mask = block_mask.expand(bsz, q, q) if block_mask.dim() == 2 else block_mask
        # new position = top + 1 + depth; [Q] a cached arange without ``depth``
        offsets = self._const("offsets", q, dev) if depth is None else depth + 1
        impl = self.adapter.text_config._attn_implementation
        dtype = self.adapter.lm_head.weight.dtype
        static = compat.is_static(state.cache)
        new_pos: list[torch.Tensor] = []
        held = [grp.key_mask for grp in state.groups]  # [B, T_g] before the append
        first: torch.Tensor | None = None  # [B, Q] group 0's new positions
        for g, grp in enumerate(state.groups):
            if g and not grp.compact:
                # a group that keeps its slots' ids gives the new tokens group 0's too: its own top can be lower
                # when it dropped the sample's top token (a Qwen2.5-VL video's last frame group, whose temporal ids
                # pass the text after it; Dynamic-LLaVA's dropped generated tokens)
                pos = first
            else:
                pos = grp.top_position() + offsets  # [B, Q]
            if g == 0:
                first = pos
            top = pos[:, -1:] if depth is None else None  # the largest new position, in a causal step
            if grp.positions.dim() == 3:  # M-RoPE: the same position on every axis
                pos = pos[:, :, None].expand(-1, -1, grp.positions.shape[-1])  # [B, Q, 3]
            grp.key_mask = torch.cat([grp.key_mask, self._const("ones", (bsz, q), dev)], 1)
            grp.positions = torch.cat([grp.positions, pos], 1)
            grp.source = torch.cat([grp.source, self._const("minus_one", (bsz, q), dev)], 1)
            grp._top = None if top is None else (grp.key_mask, grp.positions, top)
            new_pos.append(pos)
            if static:
                compat.align_static(state.cache, state.layers_of(g), q)
            elif g > 0 or custom:
                block = block_mask if custom else self._const("causal", q, dev).expand(bsz, q, q)
                grp.fwd_mask = compat.format_mask(_block_causal_mask(grp.key_mask, block), impl, dtype)
                grp.fwd_pos_ids = pos
        grp0 = state.groups[0]
        if static:  # a captured step looks the embeddings up inside the graph
            last = self._static_forward(
                state, _StepInputs(tokens if embeds is None else None, embeds, new_pos, block_mask, held), graph
            )
        else:
            if embeds is None:
                embeds = self.adapter.embed_tokens(tokens)
            with self._activate(state, "decode"):
                last = self.lm(
                    inputs_embeds=embeds,
                    attention_mask=grp0.fwd_mask if custom else grp0.key_mask.long(),
                    position_ids=self.adapter.lm_position_ids(grp0.positions[:, -q:]),
                    **compat.cache_kwargs(state.cache),
                    use_cache=True,
                ).last_hidden_state
        for hook in self.step_hooks:
            hook(state)
        hidden = last if all_logits else last[:, -1:]
        return StepOutput(self.adapter.lm_head(hidden).float(), hidden)

    # -- the static step: eager, or one captured graph -----------------------------------------------
    def _const(self, name: str, shape: int | tuple[int, int], device: torch.device) -> torch.Tensor:
        """A constant of the decode step, made once per shape and device (never written to)."""
        key = (name, shape, device)
        t = self._consts.get(key)
        if t is None:
            if name == "offsets":  # [Q] 1..Q: a causal step's positions after the top one
                t = torch.arange(1, shape + 1, device=device)
            elif name == "slots":  # [Q] 0..Q-1: a static step's slots after the write index
                t = torch.arange(shape, device=device)
            elif name == "causal":  # [Q, Q] bool lower triangle
                t = torch.ones(shape, shape, dtype=torch.bool, device=device).tril()
            elif name == "ones":  # [B, Q] bool: new slots are valid
                t = torch.ones(shape, dtype=torch.bool, device=device)
            else:  # "minus_one": [B, Q] long, the source of a generated slot
                t = torch.full(shape, -1, dtype=torch.long, device=device)
            self._consts[key] = t
        return t

    def _static_forward(self, state: LMState, step: _StepInputs, graph: bool = True) -> torch.Tensor:
        """The LM forward of a static step ([B, Q, d] final hidden states): fixed shapes; every group's
        mask is built from its slot validity and its layers' device write index (:meth:`_static_masks`).
        Captured and replayed when :meth:`capture_blocker` finds nothing against it; the host's slot
        counts advance after the forward either way."""
        if self.capture is None:
            blocker = "not asked for"
        elif self._block_blocker is _UNCHECKED:  # hooks are set up before decoding: checked once per block
            blocker = self._block_blocker = self.capture_blocker()
        else:
            blocker = self._block_blocker
        if self.capture is not None and blocker is not None and blocker not in self._capture_refusals:
            self._capture_refusals.add(blocker)
            logger.info("model.compile: auto: static decode steps run without a captured graph (%s)", blocker)
        if self._block_staging is None:  # hooks are set up before decoding: found once per block
            self._block_staging = [c for c in self._step_carried() if c.before_step is not None]
        # the fixed memory a decode hook reads, from this state; what the graph's key needs of it
        staged = tuple(carried.before_step(state) for carried in self._block_staging)
        compat.set_padded(state.cache, True)
        try:
            if blocker is None and graph:
                last = self._replay(state, step, staged)
            else:
                with self._activate(state, "decode"):
                    valid = [  # [B, C_g]: free slots invalid
                        torch.nn.functional.pad(g.key_mask, (0, self._capacity(state, i) - g.length), value=False)
                        for i, g in enumerate(state.groups)
                    ]
                    self._static_masks(state, valid, step.positions, step.block_mask)
                    self._write_slots(state, step.q)
                    grp0 = state.groups[0]
                    last = self._lm_forward(state, step.lm_embeds(self.adapter), grp0.fwd_mask, grp0.fwd_pos_ids)
                    compat.move_write_indices(state.cache, step.q)
        finally:
            compat.set_padded(state.cache, False)
        compat.advance_static(state.cache, step.q)
        return last

    def _write_slots(self, state: LMState, q: int) -> list[torch.Tensor]:
        """Each group's slots ([Q] long on the device: from its layers' write index) that a static step writes,
        given to the group's layers (:func:`compat.set_write_slots`): computed once a group, not once a layer."""
        slots = []
        for g, grp in enumerate(state.groups):
            idx = compat.write_index(state.cache, grp.start)
            new = idx + self._const("slots", q, idx.device)  # [Q]
            compat.set_write_slots(state.cache, state.layers_of(g), new)
            slots.append(new)
        return slots

    @staticmethod
    def _capacity(state: LMState, g: int) -> int:
        return compat.static_capacity(state.cache, state.groups[g].start)

    def _static_masks(
        self, state: LMState, valid: list[torch.Tensor], positions: list[torch.Tensor], block: torch.Tensor | None
    ) -> None:
        """Set every group's ``fwd_mask`` ([B, 1, Q, C_g]) and ``fwd_pos_ids`` for a static step, on the
        device only (:func:`static_step_mask` at the group's layers' write index, read before the
        forward moves it): inside a captured graph, replayed as the write index advances."""
        impl = self.adapter.text_config._attn_implementation
        dtype = self.adapter.lm_head.weight.dtype
        for grp, ok, pos in zip(state.groups, valid, positions):
            mask = static_step_mask(ok, compat.write_index(state.cache, grp.start), pos.shape[1], block)
            grp.fwd_mask = compat.format_mask(mask, impl, dtype)  # [B, 1, Q, C_g]
            grp.fwd_pos_ids, grp.fwd_pos_emb = pos, None

    def _lm_forward(self, state: LMState, embeds: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self.lm(
            inputs_embeds=embeds,
            attention_mask=mask,
            position_ids=self.adapter.lm_position_ids(pos),
            **compat.cache_kwargs(state.cache),
            use_cache=True,
        ).last_hidden_state

    def capture_blocker(self) -> str | None:
        """Why this static step cannot be one captured graph (None: it can). Python that must run at
        every step cannot live in a graph: decode hooks, hooks on LM modules other than the runner's
        layer pre-hooks, attention probes or overrides on LM layers. Hooks and attention recorders
        installed ``prefill_only`` (``HookSession``) do not run in decode steps and do not count."""
        if any(not _replays(fn) for fns in self._decode.values() for fn in fns):
            return "decode hooks (on_decode)"
        own = 0 if self._hooked_from is None else self.n_layers - self._hooked_from
        hooks = sum(
            sum(
                not (compat.is_inert_output_hook(h) or is_prefill_only(h) or _replays(h))
                for h in m._forward_hooks.values()
            )
            + sum(not (is_prefill_only(h) or _replays(h)) for h in m._forward_pre_hooks.values())
            for m in self.lm.modules()
        )
        if hooks != own:
            return "hooks on the language model's modules"
        for m in self.lm.modules():  # an instance forward set by a method (``HookSession.set_attr``)
            forward = m.__dict__.get("forward")
            if forward is not None and not (getattr(forward, "mmfast_graph_safe", False) or _replays(forward)):
                return "a replaced forward on the language model's modules"
        for layer in self.adapter.layers:
            attn = getattr(layer.self_attn, "_mmfast_attn", None)
            if attn is not None and attn.acts_at_decode():
                return "attention probes or overrides on the language model"
        return None

    def _step_carried(self) -> list[Carried]:
        """What the replayable hooks of a decode step carry out of it (:meth:`capture_blocker` let them in): the
        decode functions' results, and those of hooks on the language model's modules."""
        found = [fn.mmfast_replayable for fns in self._decode.values() for fn in fns]
        for m in self.lm.modules():
            forward = m.__dict__.get("forward")  # a replayable instance forward (HookSession.set_attr)
            extra = (forward,) if forward is not None else ()
            for h in (*m._forward_pre_hooks.values(), *m._forward_hooks.values(), *extra):
                if _replays(h) and not any(c is h.mmfast_replayable for c in found):
                    found.append(h.mmfast_replayable)
            attn = getattr(m, "_mmfast_attn", None)
            for fn in [] if attn is None else attn.every_forward():  # overrides and recorders (ZipVL's query)
                carried = attn.decode_carried(fn)
                if carried is not None and not any(c is carried for c in found):
                    found.append(carried)
        return found

    def _variant(self, state: LMState) -> tuple:
        """What a graph captured now on ``state`` records of the methods' Python branches (:attr:`graph_variants`)."""
        return tuple(fn(state) for fn in self.graph_variants)

    def _replay(self, state: LMState, step: _StepInputs, staged: tuple = ()) -> torch.Tensor:
        """Run the step as a captured graph. Its inputs are the new tokens (or embeddings), positions
        and block mask and each group's slot validity, copied into the graph's static tensors; the
        embedding lookup and the masks are computed inside the graph from them and the device write
        indices (:meth:`_static_masks`), and the graph marks the new slots valid for the next step.
        A graph serves the buffers it was captured on (no growth, no new batch), one layer-group layout, one Q,
        what its decode hooks' staging said of the state (``staged``: ``Carried.before_step``) and the methods'
        :attr:`graph_variants`; the buffers and graphs outlive the call (:class:`compat.StaticBufferPool`), so a
        later call whose cache takes the same buffers replays it."""
        groups = state.groups
        caps = tuple(self._capacity(state, i) for i in range(len(groups)))
        starts = tuple(g.start for g in groups)
        shapes = tuple((t.shape, t.dtype) for t in step.tensors())
        key = (
            compat.static_buffers(state.cache),
            caps,
            starts,
            step.tokens is None,
            shapes,
            staged,
            self._variant(state),
        )
        captured = self.pool.graphs.get(key)
        if captured is None:
            static = _StepInputs(
                *(None if t is None else t.clone() for t in (step.tokens, step.embeds)),
                [p.clone() for p in step.positions],
                None if step.block_mask is None else step.block_mask.clone(),
                valid=[
                    torch.zeros(g.key_mask.shape[0], c, dtype=torch.bool, device=g.key_mask.device)
                    for g, c in zip(groups, caps)
                ],
            )
            static.load(step, groups)
            carried = self._step_carried()

            def run() -> torch.Tensor:  # on the running state: a stand-in that re-runs it serves any call
                live = self._active
                self._static_masks(live, static.valid, static.positions, static.block_mask)
                for ok, new in zip(static.valid, self._write_slots(live, static.q)):
                    ok.index_fill_(1, new, True)  # what the next step's held slots are
                grp0 = live.groups[0]
                last = self._lm_forward(live, static.lm_embeds(self.adapter), grp0.fwd_mask, grp0.fwd_pos_ids)
                compat.move_write_indices(live.cache, static.q)
                return last

            graph = self.capture()
            before = compat.write_indices(state.cache)
            with self._activate(state, "decode"):
                last = graph.warmup(run).clone()  # this step's own forward, and the capture's warm-up
                warm = [(c, c.get()) for c in carried]  # this step's decode-hook results (the capture's: the graph's)
                after = compat.write_indices(state.cache)
                # records the same kernels; a graph that runs them while capturing rewrites this step's
                # slots with the same values from the same write index
                compat.restore_write_indices(state.cache, before)
                try:
                    graph.capture(run)
                except Exception as exc:  # noqa: BLE001  a step that cannot be captured runs eagerly
                    compat.restore_write_indices(state.cache, after)
                    self._capture_failed(exc)
                    _put_back(warm)
                    return last
                compat.restore_write_indices(state.cache, after)
                static.records = [(c, c.get()) for c in carried]
                _put_back(warm)
            self.pool.graphs[key] = _Captured(graph, static)
            self.capture_s += graph.capture_s
            return last
        captured.static.load(step, groups)
        with self._activate(state, "decode"):
            out = captured.graph.replay().clone()
            _put_back(captured.static.records)  # the replay's decode-hook results, where their readers look
            return out

    def keep_new(self, state: LMState, n_new: int, keep: list[int], *, prefix: bool = False) -> None:
        """:meth:`LMState.keep_new` of host indices ``keep``; under captured steps (a static cache), a path
        that is not a prefix is kept by one captured graph (:meth:`keep_new_on_device`) instead of ~8 eager ops
        per layer."""
        dev = state.inputs.input_ids.device
        if prefix or not self.captures:
            state.keep_new(n_new, torch.tensor(keep, device=dev), prefix=prefix)
            return
        k = len(keep)
        packed = torch.tensor(
            [*keep, *range(k, n_new), k], device=dev
        )  # one copy: the graph's input and the kept slots
        self.keep_new_on_device(state, n_new, packed)
        self.kept_on_device(state, n_new, packed[:k])

    def keep_new_on_device(self, state: LMState, n_new: int, packed: torch.Tensor) -> None:
        """Of the last ``n_new`` slots of every layer's static buffer, keep those ``packed`` ([n_new + 1] long on
        the device: source offsets in the block, the pad slots' own offsets, then the kept count k) says, by one
        captured graph (every layer's K / V copies and write index; nothing read back). Under captured steps
        only; the host's counts and layouts follow in :meth:`kept_on_device`.

        Layers holding the same count (all of them, or in-LLM pruning's layer groups) share the slots' indices,
        and every write index moves by k - n_new in one op: four copies a layer and a few ops a share."""
        cache = state.cache
        shares: dict[int, list[int]] = {}  # held count (after the verify step): the layers holding it
        for i, lay in enumerate(cache.layers):
            shares.setdefault(lay._len, []).append(i)
        groups = tuple(tuple(share) for share in shares.values())

        def make() -> tuple[_IndexInputs, Callable[[], torch.Tensor]]:
            inputs = _IndexInputs(packed.clone())
            layers = [[cache.layers[i] for i in share] for share in groups]
            positions = [lay._pos for lay in cache.layers]

            def run() -> torch.Tensor:
                rel, kept = inputs.packed[:n_new], inputs.packed[n_new:]  # [W], [1]
                ar = self._const("slots", n_new, rel.device)  # [W] 0 .. W-1
                for share in layers:
                    start = share[0]._pos - n_new  # [] the verified block's first slot in these layers
                    dst, src = start + ar, start + rel  # [W], [W]
                    for lay in share:
                        lay._k.index_copy_(2, dst, lay._k.index_select(2, src))
                        lay._v.index_copy_(2, dst, lay._v.index_select(2, src))
                delta = kept - n_new  # [1]
                torch._foreach_add_(positions, [delta[0]] * len(positions))  # every write index: the kept slots follow
                return delta

            return inputs, run

        key = (compat.static_buffers(cache), "keep", n_new, groups)
        self.run_captured(key, make, lambda inputs: inputs.packed.copy_(packed))

    def kept_on_device(self, state: LMState, n_new: int, keep: torch.Tensor) -> None:
        """The host's side of :meth:`keep_new_on_device` once the kept slots ``keep`` ([k] on the device) are known:
        the static counts and the layer groups' layouts."""
        compat.advance_static(state.cache, int(keep.numel()) - n_new)
        state.keep_layout(n_new, keep)

    def reorder(self, state: LMState, index: torch.Tensor) -> None:
        """:meth:`LMState.reorder` (beam search); under captured steps a reorder that keeps the batch size is one
        captured graph (every layer's K / V rows gathered in place) instead of four eager ops per layer."""
        cache = state.cache
        same = compat.is_static(cache) and all(
            type(lay) is compat.StaticSlotLayer and lay._k is not None and lay._k.shape[0] == index.numel()
            for lay in cache.layers
        )
        if not (self.captures and same):
            state.reorder(index)
            return

        def make() -> tuple[_IndexInputs, Callable[[], torch.Tensor]]:
            inputs = _IndexInputs(index.clone())

            def run() -> torch.Tensor:
                rows = inputs.packed  # [B]
                for lay in cache.layers:
                    lay._k.copy_(lay._k.index_select(0, rows))
                    gathered = lay._v.index_select(0, rows)  # [B, Hkv, C, D]
                    lay._v.copy_(gathered)
                return gathered

            return inputs, run

        key = (compat.static_buffers(cache), "reorder", index.numel())
        self.run_captured(key, make, lambda inputs: inputs.packed.copy_(index))
        state.reorder_layout(index)

    def run_captured(self, key: tuple, make: Callable, load: Callable) -> torch.Tensor:
        """:meth:`replay_or_capture` in the pool's store with this block's graph factory (a capture that raises
        leaves the block's steps eager: then, as in the rest of a cycle begun captured, the function runs eagerly)."""
        if self.capture is None:
            return make()[1]()
        return self.replay_or_capture(self.pool.graphs, key, self.capture, make, load, self._capture_failed)

    def replay_or_capture(
        self,
        store: dict[tuple, _Captured],
        key: tuple,
        factory: Callable,
        make: Callable,
        load: Callable,
        failed: Callable,
    ) -> torch.Tensor:
        """Replay ``store[key]`` after ``load(its inputs)``; the first time, ``make()`` gives the fixed inputs
        and the function, which runs for real (the capture's warm-up) and is then captured by a ``factory``
        graph. A capture that raises is passed to ``failed`` (the warm-up's work stands). For steps that
        move no write index between warm-up and capture (the decode step and prefill handle theirs)."""
        captured = store.get(key)
        if captured is not None:
            load(captured.static)
            return captured.graph.replay()
        static, run = make()
        graph = factory()
        out = graph.warmup(run)
        try:
            graph.capture(run)
        except Exception as exc:  # noqa: BLE001  the caller says what runs instead
            failed(exc)
            return out
        store[key] = _Captured(graph, static)
        self.capture_s += graph.capture_s
        return out

    def _capture_failed(self, exc: Exception) -> None:
        """A capture that raised: this block's static steps run eagerly from here on, said once."""
        reason = f"capturing the step failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        logger.warning("model.compile: auto: static decode steps run without a captured graph (%s)", reason)
        self._capture_refusals.add(reason)
        self.capture = None  # restored when the static_cache block ends

    # -- layer hooks -------------------------------------------------------------------------------
    def _make_layer_hook(self, layer: int) -> Callable:
        def hook(module, args, kwargs):
            state = self._active
            if state is None or self._by_hand:
                return None
            hidden = args[0] if args else kwargs["hidden_states"]
            if self._phase == "prefill" and layer in self._select:
                hidden = self._prune(layer, hidden, state)
            if self._phase == "decode":
                for fn in self._decode.get(layer, []):
                    fn(layer, hidden, state)
            g = state.group_of(layer)
            if g == 0:
                return (args, kwargs) if not args else ((hidden, *args[1:]), kwargs)
            grp = state.groups[g]
            if grp.fwd_pos_emb is None:
                grp.fwd_pos_emb = self.lm.rotary_emb(hidden, position_ids=self.adapter.lm_position_ids(grp.fwd_pos_ids))
            kwargs = dict(kwargs)
            kwargs["attention_mask"] = grp.fwd_mask
            # what the LM itself hands its layers: the 1-D ids, or None under M-RoPE (as HF does)
            kwargs["position_ids"] = grp.fwd_pos_ids if grp.fwd_pos_ids.dim() == 2 else None
            kwargs["position_embeddings"] = grp.fwd_pos_emb
            if args:
                return (hidden, *args[1:]), kwargs
            kwargs["hidden_states"] = hidden
            return args, kwargs

        hook.mmfast_runner = True  # type: ignore[attr-defined]  (steps aside in a prefill segment)
        return hook

    def _make_deepstack_hook(self, level: int) -> Callable:
        from .models.qwen2_vl import DEEPSTACK

        def hook(module, args, output):
            state = self._active
            if state is None or self._phase != "prefill" or DEEPSTACK not in state.inputs.tags:
                return None
            hidden = output[0] if isinstance(output, tuple) else output  # [B, T, d]
            g = state.group_of(level)
            src = state.groups[g].source.clamp(min=0)  # [B, T]
            feats = state.inputs.tags[DEEPSTACK][:, :, level]  # [B, L, d]
            feats = feats.gather(1, src[:, :, None].expand(-1, -1, feats.shape[-1])).to(hidden.dtype)  # [B, T, d]
            vis = state.vision_slots(g)[:, :, None]
            hidden = torch.where(vis, hidden + feats, hidden)
            return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

        return hook

    def _prune(self, layer: int, hidden: torch.Tensor, state: LMState, bucket: int = 1) -> torch.Tensor:
        """Create a new layer group at ``layer`` from the pruners' keep masks; returns gathered hidden.
        ``bucket``: the group's length is rounded up to a multiple of it (more left padding). One host read (the
        group's length, and whether anything was dropped); the layout is :func:`group_layout`, a captured call
        where the session captures (:attr:`calls`)."""
        prev = state.groups[state.group_of(layer)]
        vision = state.vision_slots(state.group_of(layer))
        src = prev.source.clamp(min=0)
        text_after = state.inputs.text_after_image.gather(1, src) & (prev.source >= 0)
        view = PrefillView(layer, hidden, state, prev, vision, text_after)
        keep = prev.key_mask.clone()
        compact = False
        ref = None
        order = None
        edited = False
        for fn, is_compact, ref_layer in self._select[layer]:
            t0 = time.perf_counter()
            k = fn(view)
            self.scoring_s += time.perf_counter() - t0
            compact = compact or is_compact
            ref = ref_layer if ref is None else min(ref, ref_layer) if ref_layer is not None else ref
            if isinstance(k, SlotEdit):
                if k.replace is not None:  # an edit, whether or not a slot is replaced (no read of it)
                    hidden = torch.where(k.replace[..., None], k.hidden.to(hidden.dtype), hidden)  # [B, T, d]
                    edited = True
                if k.order is not None:  # several reorderings at one layer add their displacements
                    base = torch.arange(keep.shape[1], device=keep.device, dtype=torch.float64)
                    order = k.order if order is None else order + (k.order - base)
                    edited = True
                k = k.keep
            if k is not None:
                keep &= k
        keep[:, -1] = prev.key_mask[:, -1]  # the last prompt token produces the first logits
        counts = keep.sum(1)  # [B]
        if self.skip_noop_groups and not edited:  # the one read: the new group's length, and whether it is new
            longest, same = torch.stack([counts.max(), (keep == prev.key_mask).all().long()]).tolist()
            if same:
                return hidden  # nothing dropped: the layers keep computing exactly as without pruning
        else:
            longest = int(counts.max())
        new_len = min(keep.shape[1], -(-longest // bucket) * bucket)
        mrope = compact and prev.positions.dim() == 3  # its compaction walks each row's runs on the host
        tensors = (keep, prev.positions, prev.source) + (() if order is None else (order,))
        layout = partial(group_layout, new_len=new_len, compact=compact and not mrope)
        valid, positions, source, index = self.calls(("group", new_len, compact, order is None), layout, *tensors)
        # the hidden states gathered outside the graph: it would hold a copy of the batch's [B, T, d] per layout
        hidden = hidden.gather(1, index[:, :, None].expand(-1, -1, hidden.shape[-1]))  # [B, T', d]
        if mrope:
            from .models.mrope import compact_positions

            image_index = state.inputs.image_index.gather(1, source.clamp(min=0)).masked_fill(source < 0, -1)
            positions = compact_positions(positions, image_index, valid)
        grp = LayerGroup(layer, valid, positions, source, compact, ref)
        if not self._by_hand:  # what the layer hooks hand the group's layers (a segment builds its own)
            impl = self.adapter.text_config._attn_implementation
            causal = torch.ones(new_len, new_len, dtype=torch.bool, device=keep.device).tril()
            grp.fwd_mask = compat.format_mask(
                _block_causal_mask(valid, causal.expand(len(valid), -1, -1)), impl, hidden.dtype
            )
            grp.fwd_pos_ids = positions
        state.groups.append(grp)
        state.groups.sort(key=lambda g: g.start)
        return hidden  # [B, T', d]


def group_layout(
    keep: torch.Tensor,
    positions: torch.Tensor,
    source: torch.Tensor,
    order: torch.Tensor | None = None,
    *,
    new_len: int,
    compact: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A new layer group's layout from the previous group's: every row's kept slots (``keep`` [B, T] bool) first,
    in ``order``'s layout ([B, T] float64 sort keys, ties by slot; None: slot order), left-padded to ``new_len``
    (at least the largest kept count). Fixed shapes, no host read (:meth:`LMRunner._prune` runs it as a captured
    call). ``positions`` [B, T] (M-RoPE [B, T, 3]) and ``source`` [B, T] are the previous group's; ``compact``
    renumbers 1-D positions 0..n-1 over the kept slots. Returns ``valid`` [B, T'] (left padding False),
    ``positions``, ``source`` (-1 at padding) and ``index`` [B, T'] (the previous group's slot at each position)."""
    bsz, t = keep.shape
    counts = keep.sum(1)  # [B]
    rank = order if order is not None else torch.arange(t, device=keep.device, dtype=torch.float64).expand(bsz, -1)
    ranked = rank.masked_fill(~keep, float("inf")).argsort(dim=1, stable=True)[:, :new_len]  # [B, T']
    at = torch.arange(new_len, device=keep.device)[None, :] - (new_len - counts)[:, None]  # [B, T'] rank held
    valid = at >= 0  # [B, T'] left padding False
    index = ranked.gather(1, at.clamp(min=0)).masked_fill(~valid, 0)  # [B, T'] kept slot per position
    if compact:
        positions = (valid.long().cumsum(1) - 1).masked_fill(~valid, 1)
    else:
        positions = gather_slots(positions, index)
    source = source.gather(1, index).masked_fill(~valid, -1)
    return valid, positions, source, index


_UNCHECKED = object()  # a static block whose capture blocker is not computed yet


def _is_runner_hook(hook: Callable) -> bool:
    """A layer pre-hook of the runner's own (it steps aside in a prefill segment)."""
    return bool(getattr(hook, "mmfast_runner", False))


# a captured prefill's length is a multiple of this (left padding), and so is a segment's after in-LLM pruning:
# the pads cost compute in every layer (FastV-64's ~80 kept slots would run as 128 at a bucket of 64), and each
# new length rounded up is one more capture
PREFILL_BUCKET = 16


class StepGraph:
    """A captured decode step: ``capture(fn)`` records ``fn``'s kernels without running them,
    ``replay()`` runs them and returns ``fn``'s output tensor (static: copy it before the next replay).
    :class:`mmfast._graph_emulator.ReplayEmulator` is one with CUDA-graph semantics on any device (tests)."""

    capture_s: float = 0.0

    def warmup(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Run ``fn`` once for real (the step the graph is first needed for)."""
        return fn()

    def capture(self, fn: Callable[[], torch.Tensor]) -> None:
        raise NotImplementedError

    def replay(self) -> torch.Tensor:
        raise NotImplementedError


class CudaGraph(StepGraph):
    """:class:`StepGraph` as one ``torch.cuda.CUDAGraph`` (its own memory pool)."""

    def __init__(self) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.out: torch.Tensor | None = None

    def warmup(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """On a side stream, as ``torch.cuda.graphs`` asks (lazy library initialisation stays out of the graph)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out = fn()
        torch.cuda.current_stream().wait_stream(side)
        return out

    def capture(self, fn: Callable[[], torch.Tensor]) -> None:
        t0 = time.perf_counter()
        torch.cuda.synchronize()
        with torch.cuda.graph(self.graph):
            self.out = fn()
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - t0

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.out


@dataclass
class _StepInputs:
    """What a static step's forward reads besides the cache: the graph's inputs when captured."""

    tokens: torch.Tensor | None  # [B, Q] new token ids, or None with ``embeds``
    embeds: torch.Tensor | None  # [B, Q, d] their embeddings when the caller gives them
    positions: list[torch.Tensor]  # per group: [B, Q] (M-RoPE [B, Q, 3]) positions of the new slots
    block_mask: torch.Tensor | None  # [B, Q, Q] bool: which new slots see which (None: causal)
    held: list[torch.Tensor] = field(default_factory=list)  # per group [B, T_g] key_mask before the append
    # a captured graph's static copies only: per group [B, C_g] bool, the held slots' validity in front,
    # and the key_mask whose validity it holds (nothing to copy when the next step's held is that one)
    valid: list[torch.Tensor] = field(default_factory=list)
    synced: list[torch.Tensor | None] = field(default_factory=list)
    records: list = field(default_factory=list)  # [(Carried, the result its graph writes)] of replayable decode hooks

    @property
    def q(self) -> int:
        return int(self.positions[0].shape[1])

    def lm_embeds(self, adapter: VLMAdapter) -> torch.Tensor:
        return adapter.embed_tokens(self.tokens) if self.embeds is None else self.embeds

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.tokens, self.embeds, *self.positions, self.block_mask) if t is not None]

    def load(self, step: _StepInputs, groups: list[LayerGroup]) -> None:
        """Copy ``step``'s inputs and the held slots' validity into these static tensors."""
        for dst, src in zip(self.tensors(), step.tensors()):
            dst.copy_(src)
        synced = self.synced or [None] * len(self.valid)
        for dst, held, done in zip(self.valid, step.held, synced):
            if held is not done:
                dst[:, : held.shape[1]].copy_(held)
        self.synced = [g.key_mask for g in groups]  # held + the new slots the graph marks


@dataclass
class _SegmentInputs:
    """A prefill segment's inputs (a captured one's static copies) and, captured, the probe records its graph
    writes (put back after each replay)."""

    hidden: torch.Tensor  # [B, T, d] (the prompt's embeddings, left-padded, for the first segment)
    key_mask: torch.Tensor  # [B, T] bool: the layer group's slot validity (False = padding)
    positions: torch.Tensor  # [B, T] (M-RoPE [B, T, 3])
    records: list = field(default_factory=list)  # [(Carried, the result its graph writes)]

    def tensors(self) -> list[torch.Tensor]:
        return [self.hidden, self.key_mask, self.positions]

    def shapes(self) -> tuple:
        return tuple((t.shape, t.dtype) for t in self.tensors())

    def load(self, live: _SegmentInputs) -> None:
        for dst, src in zip(self.tensors(), live.tensors()):
            dst.copy_(src)


@dataclass
class _IndexInputs:
    """A captured index step's input: a keep's kept slots' offsets in the verified block, padded, and the kept
    count; a reorder's batch rows to gather."""

    packed: torch.Tensor  # [W + 1] long (a reorder's: [B])

    def tensors(self) -> list[torch.Tensor]:
        return [self.packed]


@dataclass
class _Captured:
    graph: StepGraph
    static: Any  # its fixed inputs: _StepInputs, _SegmentInputs, _IndexInputs, a drafter's


def _replays(hook: Callable) -> bool:
    """A hook marked :func:`~mmfast.hooks.attention.replayable`: a captured step may replay its work."""
    return getattr(hook, "mmfast_replayable", None) is not None


def _put_back(records: list) -> None:
    """Put each carried hook result back where its reader looks (None: the hook did not act in that run)."""
    for carried, result in records:
        if result is not None:
            carried.put(result)


def gather_slots(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``t`` ([B, T] or [B, T, k]: M-RoPE positions) at slots ``index`` ([B, T'])."""
    if t.dim() == 2:
        return t.gather(1, index)
    return t.gather(1, index[:, :, None].expand(-1, -1, t.shape[-1]))


def static_step_mask(valid: torch.Tensor, write: torch.Tensor, q: int, block: torch.Tensor | None) -> torch.Tensor:
    """[B, 1, Q, C] bool mask of a static step whose Q new slots start at ``write`` ([] long, on the
    device): slots before it attend where ``valid`` ([B, C] bool; what lies at and after ``write`` is
    not read), the new ones where ``block`` ([B, Q, Q] bool; None: causal) says, each new slot sees
    itself, later slots nothing. :func:`_block_causal_mask` of the held slots plus the new ones,
    padded to C, without a host sync (a captured graph computes it from the write index)."""
    cap, dev = valid.shape[1], valid.device
    rel = torch.arange(cap, device=dev) - write  # [C] slot - first new slot
    rows = torch.arange(q, device=dev)[:, None]  # [Q, 1]
    if block is None:  # causal: new slot i sees new slots 0..i
        new = (rel >= 0) & (rel <= rows)  # [Q, C]
    else:
        new = block.index_select(2, rel.clamp(0, q - 1)) & ((rel >= 0) & (rel < q))  # [B, Q, C]
    mask = (valid[:, None, :] & (rel < 0)) | new | (rel == rows)  # [B, Q, C]
    return mask[:, None]


def _block_causal_mask(key_mask: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """[B, 1, Q, T] bool mask: the Q newest slots see valid older slots and ``block`` among themselves.

    Each query also always sees itself, so padded query rows never produce NaN (an all-masked row
    would poison the cached values of that slot).
    """
    bsz, total = key_mask.shape
    q = block.shape[-1]
    past = key_mask[:, None, : total - q].expand(bsz, q, total - q)  # [B, Q, T-Q]
    new = block & key_mask[:, None, total - q :]  # [B, Q, Q]
    eye = torch.eye(q, dtype=torch.bool, device=key_mask.device)
    mask = torch.cat([past, new | eye], dim=2)  # [B, Q, T]
    return mask[:, None]
