"""Shared machinery of the single-pass decoders that edit LLM attention (PAI, ClearSight, ONLY).

The model keeps running sdpa: each decoder sets the probe wrapper's per-module *override*
(``hooks.attach(ctx.hooks, self_attn).override``) on the layers it edits. The override calls the base
implementation for every row, then recomputes only the rows the method edits -- scores
``q K^T * scale`` in fp32 for those rows, the method's edit on the logits, the mask, softmax, times V
(O(rows x keys)) -- and writes them over the base rows. Which key slots are vision tokens, system
prompt, instruction or generated text comes from the running state's layer group (``source`` indices
into the prompt), so pruning stages that drop or reorder slots compose.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from functools import partial

import torch

from .. import compat
from ..capabilities import Capabilities
from ..errors import IncompatibleRecipeError
from ..hooks.attention import Carried, attach, replayable, staged_copy
from ..models.captured_tower import eager_call


@dataclass
class SlotClasses:
    """What each slot of one layer's cache holds ([B, K] bool each, K = the layer group's length)."""

    valid: torch.Tensor  # a real token (not padding)
    image: torch.Tensor  # a vision token
    before_image: torch.Tensor  # prompt text before the first vision token (BOS + system prompt + "USER:")
    after_image: torch.Tensor  # text after the last vision token: instruction, assistant prompt, generated
    bos: torch.Tensor  # the first real prompt token of the row
    generated: torch.Tensor  # a generated token (cached decode, or a decode-without-cache re-prefill)


def override_caps(active: bool, **more) -> Capabilities:
    """The capabilities of a decoder whose attention override is installed when ``active`` (``more``: its other
    fields). Its static decode steps read staged slot classes (:class:`StagedSlotClasses`): served by the static
    cache and captured."""
    return Capabilities(overrides_llm_attention=active, **more)


def slot_classes(state, layer: int) -> SlotClasses:
    """The slot classes of ``layer``'s current layout in the running ``state``."""
    grp = state.groups[state.group_of(layer)]
    return layout_classes(grp.source, grp.key_mask, *_prompt_masks(state.inputs))


def _prompt_masks(inputs) -> tuple[torch.Tensor, ...]:
    """The prompt's masks :func:`layout_classes` reads: image ([B, L]), attention ([B, L]), and the generated
    tokens' tag ([B, L]) where the prompt has one."""
    from ..models.base import GENERATED

    tagged = inputs.tags.get(GENERATED)
    return (inputs.image_mask, inputs.attention_mask) + (() if tagged is None else (tagged,))


def layout_classes(
    source: torch.Tensor,
    valid: torch.Tensor,
    img_mask: torch.Tensor,
    attention_mask: torch.Tensor,
    tagged: torch.Tensor | None = None,
) -> SlotClasses:
    """The slot classes of a layer group's layout (``source`` [B, K]: each slot's prompt index, -1 for generated
    or padding; ``valid`` [B, K]: its key mask) over the prompt's masks ([B, L]; ``tagged``: generated tokens
    re-prefilled)."""
    real = source >= 0  # [B, K] slot holds a prompt token (generated / padding: -1)
    src = source.clamp(min=0)
    batch, length = img_mask.shape
    pos = torch.arange(length, device=src.device).expand(batch, -1)  # [B, L]
    first_img = torch.where(img_mask, pos, torch.full_like(pos, length)).min(1, keepdim=True).values  # [B, 1]
    last_img = torch.where(img_mask, pos, torch.full_like(pos, -1)).max(1, keepdim=True).values  # [B, 1]
    first_real = attention_mask.long().argmax(1, keepdim=True)  # [B, 1]
    image = img_mask.gather(1, src) & real & valid
    generated = valid & ~real
    if tagged is not None:
        generated = generated | (tagged.gather(1, src) & real & valid)
    return SlotClasses(
        valid=valid,
        image=image,
        before_image=valid & real & ~image & (source < first_img),
        after_image=valid & ~image & ((source > last_img) | ~real),
        bos=valid & real & (source == first_real),
        generated=generated,
    )


def packed_classes(*tensors: torch.Tensor, fields: tuple[str, ...]) -> torch.Tensor:
    """:func:`layout_classes`' ``fields`` and whether each row holds a vision token: [F + 1, B, K] bool (the last:
    has_image, the same in every column). A pure function of its tensors (a captured call)."""
    cls = layout_classes(*tensors)
    has = cls.image.any(1, keepdim=True)  # [B, 1]
    return torch.stack([getattr(cls, name) for name in fields] + [has.expand_as(cls.valid)])  # [F + 1, B, K]


class StagedSlotClasses:
    """Slot classes in fixed memory, what an override reads inside a captured graph (a static decode step, a prefill
    segment).

    A static decode step attends over each layer group's whole buffer (``C`` slots, free ones masked): before every
    static step (``Carried.before_step``: :meth:`stage`) the held slots' classes of each layer group holding an edited
    layer are computed from the running state and copied, padded to ``C`` with False, into memory kept per group,
    class, batch and width, so the graph reads this call's. Before a captured prefill segment of ``T`` slots
    (``Carried.stage``: :meth:`stage_prefill`) the same for the groups that hold ``T`` slots; an eager segment stages
    nothing and the override computes its classes itself (:meth:`staged_prefill`).
    ``fields``: the classes the method reads; ``has_image`` ([B, 1]: the row holds a vision token) is always staged.
    ``active``: the running state (``runner.active``). ``image_only``: the method edits nothing where no row holds a
    vision token (a branch's image-free prompt): such a state stages nothing and its graphs, keyed apart
    (:meth:`imageless`), hold no edit. ``enabled``: whether the method edits the running call at all (False: another
    decoder runs it, ``generate(decoding=...)``); likewise keyed apart, no edit."""

    def __init__(
        self,
        layers: list[int],
        fields: tuple[str, ...],
        active: Callable,
        image_only: bool = False,
        run: Callable[..., torch.Tensor] = eager_call,
        enabled: Callable[[], bool] = lambda: True,
    ) -> None:
        self.layers, self.fields, self._active, self.image_only = list(layers), fields, active, image_only
        self._enabled = enabled
        self._run = run  # MethodContext.captured: the classes are one captured call a group where the session captures
        self._memory: dict[tuple, torch.Tensor] = {}
        self._prefill: set[int] = set()  # group starts staged for the running prefill segment
        # one mark for every edited layer: the runner stages once a step (it keeps one of each Carried)
        self._carried = Carried(lambda: None, lambda _: None, self.stage_prefill, decode=True, before_step=self.stage)

    def imageless(self, state) -> bool:
        """Whether the method edits nothing in ``state`` (``image_only`` and no row holds a vision token, or the method
        is not ``enabled`` for the running call)."""
        return (self.image_only and not state.inputs.has_vision) or not self._enabled()

    def stage(self, state) -> Hashable:
        """``Carried.before_step``: stage the classes of a static decode step; returns the graph's key part."""
        self._stage(state)
        return ("slot classes", self.imageless(state))

    def _stage(self, state, length: int | None = None) -> set[int]:
        """Stage the classes of ``state``'s groups holding an edited layer (those of ``length`` slots, if given), each
        padded to its capacity in a decode step; returns the groups' starts (none: :meth:`imageless`)."""
        done: set[int] = set()
        if self.imageless(state):
            return done
        masks = _prompt_masks(state.inputs)
        for layer in self.layers:
            g = state.group_of(layer)
            grp = state.groups[g]
            if grp.start in done or (length is not None and grp.length != length):
                continue
            done.add(grp.start)
            width = grp.length if length is not None else compat.static_capacity(state.cache, grp.start)
            # padded to the capacity: one shape (one graph) for every step; a free slot (source -1, invalid) is
            # of no class
            source, valid = grp.source, grp.key_mask  # [B, T_g]
            if width > grp.length:
                source = torch.nn.functional.pad(source, (0, width - grp.length), value=-1)  # [B, W]
                valid = torch.nn.functional.pad(valid, (0, width - grp.length), value=False)  # [B, W]
            fn = partial(packed_classes, fields=self.fields)
            packed = self._run(("slot classes", self.fields), fn, source, valid, *masks)  # [F + 1, B, W]
            staged_copy(self._memory, (grp.start, *packed.shape[1:], packed.device), packed, packed.device)
        return done

    def stage_prefill(self, length: int | None) -> Hashable:
        """``Carried.stage`` of a captured prefill segment of ``length`` slots (None: it ran)."""
        if length is None:
            self._prefill = set()
            return None
        state = self._active()
        self._prefill = self._stage(state, length)
        return ("slot classes", length, self.imageless(state))

    def staged_prefill(self, state, layer: int) -> bool:
        """Whether ``layer``'s classes are staged for the running prefill segment (it is a captured one)."""
        return state.groups[state.group_of(layer)].start in self._prefill

    def get(self, state, layer: int, name: str, k_len: int, device) -> torch.Tensor:
        """Class ``name`` ([B, K] bool; ``has_image``: [B, 1]) of ``layer``'s group as staged for this graph."""
        grp = state.groups[state.group_of(layer)]
        packed = self._memory[(grp.start, state.batch_size, k_len, device)]  # [F + 1, B, K]
        return packed[-1, :, :1] if name == "has_image" else packed[self.fields.index(name)]

    def carried(self) -> Carried:
        """The override's mark: in a static decode step and a captured prefill segment its work reads this memory
        only (replayable), nothing to carry out."""
        return self._carried


def static_step(state, query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether the running forward is a static decode step (its keys: each layer's whole buffer)."""
    return compat.is_static(state.cache) and query.shape[2] < key.shape[2]


def held_slot_classes(state, layer: int, k_len: int, who: str) -> SlotClasses:
    """:func:`slot_classes`, which must lay out the ``k_len`` keys ``layer``'s attention holds (``who``: the
    method, for the error)."""
    cls = slot_classes(state, layer)
    if cls.valid.shape[1] != k_len:
        raise RuntimeError(f"{who}: layer {layer} holds {k_len} keys but its layout {cls.valid.shape[1]} (mmfast bug)")
    return cls


def masked_scores(query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None, r0: int) -> tuple:
    """Raw scores of query rows ``r0..Q-1`` and the mask that applies to them.

    Args:
        query: [B, H, Q, D] (after RoPE). key: [B, Hkv, K, D] (cache included).
    Returns:
        (q K^T [B, H, R, K] fp32 without scaling, additive fp32 mask [B|1, 1, R, K] of 0 / -inf).
    """
    bsz, heads, q_len, _ = query.shape
    k_len = key.shape[2]
    k = key.float()
    if k.shape[1] != heads:  # GQA: repeat_kv
        k = k.repeat_interleave(heads // k.shape[1], dim=1)  # [B, H, K, D]
    scores = torch.matmul(query[:, :, r0:].float(), k.transpose(-1, -2))  # [B, H, R, K]
    if attention_mask is not None:
        m = attention_mask[:, :, r0:q_len, :k_len]
        if m.dtype == torch.bool:
            add = torch.zeros(m.shape, device=m.device).masked_fill(~m, float("-inf"))
        else:
            add = m.float().masked_fill(m <= torch.finfo(m.dtype).min / 2, float("-inf"))
    else:  # causal: row r sees keys up to r + (K - Q)
        rows = torch.arange(r0, q_len, device=query.device)[:, None] + (k_len - q_len)
        allowed = torch.arange(k_len, device=query.device)[None, :] <= rows  # [R, K]
        add = torch.zeros(allowed.shape, device=query.device).masked_fill(~allowed, float("-inf"))[None, None]
    return scores, add


def attend(probs: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """probs [B, H, R, K] fp32 times value [B, Hkv, K, D] -> [B, R, H, D] fp32 (attention-function layout)."""
    v = value.float()
    if v.shape[1] != probs.shape[1]:
        v = v.repeat_interleave(probs.shape[1] // v.shape[1], dim=1)
    return torch.matmul(probs, v).transpose(1, 2)


def install_override(ctx, layer: int, fn: Callable, who: str, carried: Carried | None = None) -> None:
    """Set ``fn`` as the attention override of LLM layer ``layer`` (refused if another method holds it); with
    ``carried``, marked replayable in captured decode steps."""
    hooks = attach(ctx.hooks, ctx.adapter.layers[layer].self_attn)
    if hooks.override is not None:
        raise IncompatibleRecipeError(f"{who}: LLM layer {layer}'s attention is already overridden by another method")
    hooks.override = fn if carried is None else replayable(fn, carried)


def edit_rows(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    base_out: torch.Tensor,
    rows: torch.Tensor,
    edit: Callable[[torch.Tensor, int], torch.Tensor],
    r0: int | None = None,
) -> torch.Tensor:
    """The base output with the rows in ``rows`` ([B, Q] bool) recomputed from edited logits.

    ``edit(logits [B, H, R, K], r0)`` gets the scaled scores ``q K^T * scale`` of rows ``r0..Q-1``
    before the mask is added (the mask is added after the edit) and returns the edited logits.
    base_out: [B, Q, H, D]. Returns [B, Q, H, D] in base_out's dtype. ``r0`` given (a static decode step: no
    host read, the same kernels whichever rows are edited): rows from ``r0`` are recomputed, ``rows`` picks.
    """
    if r0 is None:
        if not bool(rows.any()):
            return base_out
        r0 = int(rows.any(0).nonzero()[0])  # first row edited in any sample
    scores, add = masked_scores(query, key, attention_mask, r0)
    logits = edit(scores * scaling, r0) + add  # [B, H, R, K]
    probs = torch.nan_to_num(torch.softmax(logits, dim=-1), nan=0.0)
    new = attend(probs, value).to(base_out.dtype)  # [B, R, H, D]
    out = base_out.clone()
    keep = rows[:, r0:, None, None]  # [B, R, 1, 1]
    out[:, r0:] = torch.where(keep, new, base_out[:, r0:])
    return out
