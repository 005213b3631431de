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

import torch

from .. import compat
from ..capabilities import Capabilities
from ..errors import IncompatibleRecipeError
from ..hooks.attention import Carried, attach, replayable, staged_copy


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
    from ..models.base import GENERATED

    grp = state.groups[state.group_of(layer)]
    inputs = state.inputs
    real = grp.source >= 0  # [B, K] slot holds a prompt token (generated / padding: -1)
    src = grp.source.clamp(min=0)
    length = inputs.length
    pos = torch.arange(length, device=src.device).expand(inputs.batch_size, -1)  # [B, L]
    img_mask = inputs.image_mask
    first_img = torch.where(img_mask, pos, torch.full_like(pos, length)).min(1, keepdim=True).values  # [B, 1]
    last_img = torch.where(img_mask, pos, torch.full_like(pos, -1)).max(1, keepdim=True).values  # [B, 1]
    first_real = inputs.attention_mask.long().argmax(1, keepdim=True)  # [B, 1]
    valid = grp.key_mask
    image = img_mask.gather(1, src) & real & valid
    tagged = inputs.tags.get(GENERATED)
    generated = valid & ~real
    if tagged is not None:
        generated = generated | (tagged.gather(1, src) & real & valid)
    return SlotClasses(
        valid=valid,
        image=image,
        before_image=valid & real & ~image & (grp.source < first_img),
        after_image=valid & ~image & ((grp.source > last_img) | ~real),
        bos=valid & real & (grp.source == first_real),
        generated=generated,
    )


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
    (:meth:`imageless`), hold no edit."""

    def __init__(self, layers: list[int], fields: tuple[str, ...], active: Callable, image_only: bool = False) -> None:
        self.layers, self.fields, self._active, self.image_only = list(layers), fields, active, image_only
        self._memory: dict[tuple, torch.Tensor] = {}
        self._prefill: set[int] = set()  # group starts staged for the running prefill segment
        # one mark for every edited layer: the runner stages once a step (it keeps one of each Carried)
        self._carried = Carried(lambda: None, lambda _: None, self.stage_prefill, decode=True, before_step=self.stage)

    def imageless(self, state) -> bool:
        """Whether the method edits nothing in ``state`` (``image_only`` and no row holds a vision token)."""
        return self.image_only and not state.inputs.has_vision

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
        for layer in self.layers:
            g = state.group_of(layer)
            grp = state.groups[g]
            if grp.start in done or (length is not None and grp.length != length):
                continue
            done.add(grp.start)
            width = grp.length if length is not None else compat.static_capacity(state.cache, grp.start)
            cls = slot_classes(state, layer)  # [B, T_g] each (a decode step's new slots appended on the host)
            for name in self.fields:
                fresh = torch.nn.functional.pad(getattr(cls, name), (0, width - grp.length), value=False)  # [B, W]
                staged_copy(self._memory, (grp.start, name, *fresh.shape, fresh.device), fresh, fresh.device)
            has = cls.image.any(1, keepdim=True)  # [B, 1]
            staged_copy(self._memory, (grp.start, "has_image", *has.shape, has.device), has, has.device)
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
        width = 1 if name == "has_image" else k_len
        return self._memory[(grp.start, name, state.batch_size, width, device)]

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
