"""Helpers shared by pruning methods: layer mapping, top-k keep masks, budget presets."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from ..errors import ConfigError

#: Depth of LLaVA-1.5-7B's LLM, the reference for every paper's layer indices.
REFERENCE_LAYERS = 32

LayerMapping = Literal["absolute", "proportional"]


def map_layers(
    paper_layers: Sequence[int], n_layers: int, mode: LayerMapping, *, param: str = "layers"
) -> list[tuple[int, int]]:
    """Map layer indices given for a 32-layer LLM onto a model with ``n_layers`` layers.

    ``absolute`` keeps the indices (they must exist); ``proportional`` scales them by
    ``n_layers / 32`` (rounded, at least 1) so a shallow model prunes at the same relative depth.
    Returns sorted unique ``(model_layer, paper_layer)`` pairs (the first paper layer wins a tie).
    A layer that does not exist is a :class:`ConfigError` about the method parameter ``param``.
    """
    out: dict[int, int] = {}
    for p in paper_layers:
        layer = p if mode == "absolute" else max(1, round(p * n_layers / REFERENCE_LAYERS))
        if not 0 < layer < n_layers:
            where = f" (mapped proportionally to layer {layer})" if mode == "proportional" else ""
            raise ConfigError(
                param,
                f"layer {p}{where} does not exist in this {n_layers}-layer LLM (layers 1..{n_layers - 1} can "
                "prune); use layer_mapping: proportional or smaller layer indices",
            )
        out.setdefault(layer, p)
    return sorted(out.items())


def topk_keep(scores: torch.Tensor, candidates: torch.Tensor, k: int | torch.Tensor) -> torch.Tensor:
    """[B, T] bool: the ``k`` highest-scoring candidate slots of each row (``k`` int or [B]).

    Non-candidate slots are False; ties break toward lower indices.
    """
    bsz, t = scores.shape
    s = scores.float().masked_fill(~candidates, float("-inf"))
    order = s.argsort(dim=1, descending=True, stable=True)  # [B, T]
    kk = torch.as_tensor(k, device=scores.device).expand(bsz) if not torch.is_tensor(k) or k.dim() == 0 else k
    ranks = torch.empty_like(order)
    ranks.scatter_(1, order, torch.arange(t, device=scores.device).expand(bsz, -1))
    return (ranks < kk[:, None]) & candidates


def keep_only(view_vision: torch.Tensor, vision_keep: torch.Tensor) -> torch.Tensor:
    """Full-slot keep mask: every non-vision slot kept, vision slots as ``vision_keep`` says."""
    return ~view_vision | vision_keep


def image_counts(image: torch.Tensor) -> list[list[int]]:
    """[B][J] each sample's slots of each of the J images (``image`` [B, T]: the slot's image, -1 for others; J: the
    largest image index + 1, 0 without images): one read."""
    bsz, t = image.shape
    counts = torch.zeros(bsz, t + 1, dtype=torch.long, device=image.device)
    rows = counts.scatter_add_(1, image + 1, torch.ones_like(image))[:, 1:].tolist()  # column 0: no image
    n_images = max((j + 1 for row in rows for j, c in enumerate(row) if c), default=0)
    return [row[:n_images] for row in rows]
