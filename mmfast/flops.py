"""Analytical FLOPs in the convention of the token-pruning papers.

Per decoder layer with ``n`` tokens, hidden size ``d`` and MLP size ``m``: ``4 n d^2 + 2 n^2 d + 3 n d m``
(q/k/v/o projections, attention scores and values, gated MLP), summed over layers. FastV,
SparseVLM, MustDrop and PDrop report this quantity (LLM only, vision tower excluded), and their
"equivalent token count" is the layer average of the vision tokens. mmfast reports it for the model
at hand and projected onto the real LLaVA-1.5-7B shape (32 layers, d=4096, m=11008).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LMShape:
    n_layers: int
    d: int
    m: int

    @classmethod
    def of(cls, text_config) -> LMShape:
        return cls(text_config.num_hidden_layers, text_config.hidden_size, text_config.intermediate_size)


LLAVA_7B = LMShape(32, 4096, 11008)


def layer_flops(n: float, shape: LMShape) -> float:
    d, m = shape.d, shape.m
    return 4 * n * d * d + 2 * n * n * d + 3 * n * d * m


def prefill_flops(tokens_per_layer: Sequence[float], shape: LMShape) -> float:
    """Sum of :func:`layer_flops` over layers (``len(tokens_per_layer) == shape.n_layers``)."""
    return float(sum(layer_flops(n, shape) for n in tokens_per_layer))


def project_schedule(starts: Sequence[float], counts: Sequence[float], n_layers: int) -> list[float]:
    """Per-layer token counts of a depth-``n_layers`` model from group starts (reference layers).

    ``starts[g]`` is where group ``g`` begins in that depth (group 0 starts at 0); layer ``l`` uses the
    last group whose start is ``<= l``.
    """
    out = []
    for layer in range(n_layers):
        g = max(i for i, s in enumerate(starts) if s <= layer)
        out.append(counts[g])
    return out


#: Text tokens of the "typical prompt" a ``budget: {flops: r}`` is converted on: LLaVA-1.5's system
#: prompt + chat template + a short question with the answer-format suffix (about 64 tokens).
TYPICAL_TEXT_TOKENS = 64


def tokens_for_flops_ratio(ratio: float, shape: LMShape, n_vision: int, n_text: int = TYPICAL_TEXT_TOKENS) -> int:
    """Vision tokens per image whose prefill FLOPs are ``ratio`` x those of the unpruned model.

    Rule: a prompt of ``n_text`` text tokens and one image of ``n_vision`` tokens; the budget ``t``
    is the vision-token count which, held at every layer of ``shape``, gives
    ``prefill_flops([n_text + t] * L) = ratio * prefill_flops([n_text + n_vision] * L)`` (the papers'
    FLOPs, :func:`layer_flops`), rounded to the nearest token. In-LLM methods use ``t`` as their
    layer-averaged budget (exact up to the small quadratic attention term). Raises ValueError when
    ``ratio`` is below the text-only cost (naming the smallest feasible ratio).
    """
    full = layer_flops(n_text + n_vision, shape)
    floor = layer_flops(n_text, shape) / full
    if ratio < floor:
        raise ValueError(
            f"a FLOPs ratio of {ratio} is below the text-only cost of a typical prompt; the smallest feasible is {floor:.4f}"
        )
    lo, hi = 0.0, float(n_vision)
    for _ in range(60):
        mid = (lo + hi) / 2
        if layer_flops(n_text + mid, shape) < ratio * full:
            lo = mid
        else:
            hi = mid
    return max(1, round((lo + hi) / 2)) if ratio > floor else 0
