"""Fused vision-tower attention for Qwen2-VL, Qwen2.5-VL and Qwen3-VL.

Problem: transformers' Qwen-VL vision attention (sdpa or eager) splits q / k / v by ``cu_seqlens`` and
calls attention once per chunk in a Python loop: once per image in full-attention blocks, once per
window in Qwen2.5-VL's windowed blocks (a 1036 x 756 image has 70 windows of up to 64 patches, so
28 of the 32 blocks make 70 small kernel calls each). Measured on an H100 by an earlier session
(issue 27): the Qwen2.5-VL-7B tower took 100-180 ms for one image against 29 ms of LLM prefill.

What this does: the same math with few calls. Chunks are bucketed by *length*; each bucket is one
batched, mask-free ``scaled_dot_product_attention`` call over [n_chunks, heads, L, head_dim]. Windows
of one image have at most four lengths (inner, right edge, bottom edge, corner), so a windowed block
makes at most 4 calls per distinct image size instead of one per window; a full-attention block makes
one call per distinct image size (one call for one image or for images of equal size).

Why buckets, not a block-diagonal mask or padding:

* a dense block-diagonal mask over the whole sequence costs O(S^2) memory for many images or video
  frames, and on CUDA a boolean mask rules out the flash kernel (sdpa falls back to the
  memory-efficient one);
* padding all windows to the longest with a key mask is one call, but pads and masks (again no flash
  kernel), and padding images of different sizes in full-attention blocks to the largest wastes up
  to (L_max / L_i)^2 of the work;
* equal-length buckets need no mask at all (every kernel, flash included, is eligible), no padding,
  and memory stays O(sum of per-chunk L^2) in the math kernel (O(S) in flash), exactly what
  transformers' loop uses. The worst case (every image a different size) makes as many calls as
  transformers' loop, never more.
* varlen (``flash_attn_varlen``) is what transformers already calls under ``flash_attention_2``;
  there this forward steps aside. ``flex_attention`` was not used: it compiles per shape and its CPU
  path is slow, while the bucketed sdpa runs everywhere.

Each bucket's gather (chunk starts + arange(L)) is planned once per ``cu_seqlens`` tensor (the tower
passes the same two tensors, full and windowed, to every block) and reused by every block; a bucket
that covers the whole sequence in order is a view, not a gather (one image, or equal-size images).

Hook point: the ``forward`` of every vision attention module (``compat.qwen_vision_attention``),
replaced *per instance* through the :class:`~mmfast.hooks.HookSession` (restored on exit). The
session installs it whenever a Qwen-VL model runs through mmfast (``model.fused_vision_attention``,
default true, turns it off); not where something else already wraps those forwards (accelerate's
offload hooks: a warning says so). It computes only while the tower's implementation is ``sdpa`` (or the probe's
wrapper of sdpa, which passes unprobed modules through): under ``eager`` (asked for explicitly),
flash (already varlen), or on a module the probe records or overrides (it must see every per-chunk
call) it calls transformers' own forward.

Exactness: the same projections, the same rotary function (the modeling module's own), the same
softmax scale; only the batching of the attention kernel changes, so outputs equal transformers'
within float tolerance (tested at 1e-5 in fp32 on all three families, one image and two of different
sizes; greedy generation token-identical; ``tests/test_qwen_tower.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import compat
from ..hooks.attention import is_probed

logger = logging.getLogger(__name__)

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


@dataclass(frozen=True)
class Bucket:
    """Chunks of one length ``length``: ``index`` [n, L] long rows of the packed sequence, or None
    when the bucket is the whole sequence in order (a view [n, L] suffices)."""

    length: int
    n: int
    index: torch.Tensor | None


@dataclass(frozen=True)
class ChunkPlan:
    """How one ``cu_seqlens`` is computed: one batched attention call per bucket."""

    buckets: tuple[Bucket, ...]

    @staticmethod
    def of(cu_seqlens: torch.Tensor) -> ChunkPlan:
        bounds = cu_seqlens.tolist()
        total = int(bounds[-1])
        by_len: dict[int, list[int]] = {}
        for start, end in zip(bounds[:-1], bounds[1:]):
            if end > start:
                by_len.setdefault(int(end - start), []).append(int(start))
        buckets = []
        device = cu_seqlens.device
        for length, starts in by_len.items():
            whole = len(by_len) == 1 and starts == list(range(0, total, length))
            index = None
            if not whole:
                first = torch.tensor(starts, dtype=torch.long, device=device)  # [n]
                index = first[:, None] + torch.arange(length, device=device)  # [n, L]
            buckets.append(Bucket(length, len(starts), index))
        return ChunkPlan(tuple(buckets))


def chunked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: ChunkPlan, scale: float) -> torch.Tensor:
    """Attention within each chunk of ``plan``: q / k / v [S, H, Dh] (packed, after rotary) ->
    [S, H, Dh]."""
    if len(plan.buckets) == 1 and plan.buckets[0].index is None:
        b = plan.buckets[0]
        qb, kb, vb = (t.reshape(b.n, b.length, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))  # [n, H, L, Dh]
        out = F.scaled_dot_product_attention(qb, kb, vb, scale=scale)  # [n, H, L, Dh]
        return out.transpose(1, 2).reshape(q.shape)
    out = torch.empty_like(q)  # [S, H, Dh]
    for b in plan.buckets:
        rows = b.index.reshape(-1)  # [n * L]
        qb, kb, vb = (t[rows].reshape(b.n, b.length, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))  # [n, H, L, Dh]
        ob = F.scaled_dot_product_attention(qb, kb, vb, scale=scale)  # [n, H, L, Dh]
        out[rows] = ob.transpose(1, 2).reshape(-1, *q.shape[1:])  # [n * L, H, Dh]
    return out


class _PlanCache:
    """Plans by ``cu_seqlens`` tensor identity; the entry keeps its tensor alive, so an id is never
    reused while cached. Small: a tower forward has two (full and windowed)."""

    def __init__(self, size: int = 8) -> None:
        self.size = size
        self._plans: dict[int, tuple[torch.Tensor, ChunkPlan]] = {}

    def get(self, cu_seqlens: torch.Tensor) -> ChunkPlan:
        hit = self._plans.get(id(cu_seqlens))
        if hit is not None and hit[0] is cu_seqlens:
            return hit[1]
        if len(self._plans) >= self.size:
            self._plans.clear()
        plan = ChunkPlan.of(cu_seqlens)
        self._plans[id(cu_seqlens)] = (cu_seqlens, plan)
        return plan


def fused_forward(module: nn.Module, rotary: Callable, plans: _PlanCache) -> Callable:
    """The replacement ``forward`` of one vision attention instance (module docstring)."""
    original = module.forward  # the class's bound forward

    def forward(
        hidden_states: torch.Tensor,
        cu_seqlens: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        max_seqlen: int | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        impl = compat.vision_attn_implementation(module).removeprefix(compat.PROBE_PREFIX)
        if impl != "sdpa" or is_probed(module) or position_embeddings is None:
            return original(
                hidden_states, cu_seqlens, position_embeddings=position_embeddings, max_seqlen=max_seqlen, **kwargs
            )
        seq = hidden_states.shape[0]
        q, k, v = module.qkv(hidden_states).reshape(seq, 3, module.num_heads, -1).unbind(1)  # [S, H, Dh] each
        cos, sin = position_embeddings
        q, k = rotary(q, k, cos, sin)
        out = chunked_attention(q, k, v, plans.get(cu_seqlens), module.scaling)  # [S, H, Dh]
        return module.proj(out.reshape(seq, -1))  # [S, D]

    forward.mmfast_fused_tower = True  # type: ignore[attr-defined]  (an open session's: install_fused_tower)
    return forward


def install_fused_tower(adapter, hooks) -> int:
    """Replace the forward of every vision attention module of a Qwen-VL ``adapter``'s tower,
    through ``hooks`` (restored on its close). Returns the number of modules replaced (0 when the
    family has no such tower, or this transformers lays it out differently: a warning says so)."""
    if adapter.family not in FAMILIES:
        return 0
    found = compat.qwen_vision_attention(adapter.family)
    if found is None:
        logger.warning(
            "fused vision attention: transformers %s has no known %s vision attention; the tower "
            "runs as transformers ships it",
            compat.transformers.__version__,
            adapter.family,
        )
        return 0
    cls, rotary = found
    mods = [m for m in adapter.vision_tower.modules() if isinstance(m, cls)]
    if not mods or not all(compat.qwen_vision_attention_matches(m) for m in mods):
        logger.warning(
            "fused vision attention: the %s tower's attention modules lack qkv / proj / num_heads / "
            "scaling; the tower runs as transformers ships it",
            adapter.family,
        )
        return 0
    if all(getattr(m.__dict__.get("forward"), "mmfast_fused_tower", False) for m in mods):  # mods is not empty
        logger.debug("fused vision attention: already installed by an open session on this model")
        return 0
    wrapped = [m for m in mods if "forward" in m.__dict__]
    if wrapped:  # e.g. accelerate's offload hooks: replacing them would skip their device moves
        logger.warning(
            "fused vision attention: %d of the %s tower's attention modules already have a wrapped "
            "forward (%s); the tower runs as transformers ships it",
            len(wrapped),
            adapter.family,
            getattr(wrapped[0].forward, "__qualname__", type(wrapped[0].forward).__name__),
        )
        return 0
    plans = _PlanCache()
    for m in mods:
        hooks.set_attr(m, "forward", fused_forward(m, rotary, plans))
    return len(mods)
