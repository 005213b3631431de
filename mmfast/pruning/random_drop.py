"""Random token dropping: the floor every vision-token pruning method must beat (no paper of its own).

Baseline used in the ablations of FastV (arXiv 2403.06764), VisionZip (arXiv 2412.04467) and others.

Algorithm: for each image, draw a uniformly random subset of ``keep`` of its vision tokens (without
replacement) and drop the rest before the projector; kept tokens stay in their original order.
The generator is seeded per image from ``seed`` and a hash of the image's pixel values
(``per_image``, default), so a given image always loses the same tokens whatever batch it is in, or
from ``seed`` alone (``shared``: the same patch positions for every image).

Hook points: ``vision_features`` only. Positions: the kept tokens are spliced contiguously (as
every feature-stage method); under M-RoPE (Qwen-VL) each kept token keeps its grid cell's original
(t, h, w) ids and the text after the image keeps its unpruned position (``mmfast/models/mrope.py``).
Limits: none (batch > 1, several images per prompt, any grid, dynamic resolution).
No-op: ``keep`` >= the tokens of the image returns the vision batch untouched.

Budget (``budget: {tokens: B}`` or ``{ratio: r}``, vision tokens per image at the LLM input): keep =
the image's target (B, or round(r N_i)), exact, on every family (``_budget.py``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal

import torch

from ..capabilities import Capabilities, Need
from ..config import opt
from ..registry import PRUNERS
from ._grid import per_sample, select_rows
from .base import Pruner


def image_seed(seed: int, pixel_values: torch.Tensor) -> int:
    """A 63-bit seed from ``seed`` and the bytes of one image's pixel values."""
    h = hashlib.blake2b(pixel_values.detach().float().cpu().contiguous().numpy().tobytes(), digest_size=8)
    h.update(int(seed).to_bytes(8, "little", signed=True))
    return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)


@PRUNERS.register("random", description="Random drop: keep a seeded random subset of image tokens (baseline)")
class RandomDrop(Pruner):
    """Random token drop (baseline)."""

    hook_points = frozenset({"vision_features"})
    caps = Capabilities(
        needs=frozenset({Need.UNTILED}),
        why={
            Need.UNTILED: "it edits pre-projector features, which the tile packing re-packs: the edit would not "
            "reach the LLM"
        },
        edits_features=True,
    )

    @dataclass(frozen=True)
    class Config:
        keep: int = opt(64, lo=0, doc="image tokens kept per image (576 -> 192/128/64 in the papers' tables)")
        fraction: float | None = opt(
            None, lo=0.0, hi=1.0, doc="fraction KEPT: round(fraction * N_i) of each image (overrides keep)"
        )
        seed: int = opt(0, doc="random seed")
        mask: Literal["per_image", "shared"] = opt(
            "per_image", doc="per_image: seed from the image's pixels too; shared: one subset for all"
        )

    budget_knobs = ("keep", "fraction")

    @classmethod
    def noop_params(cls, adapter):
        rows, cols = adapter.grid
        return {"keep": rows * cols}

    @classmethod
    def budget_params(cls, tokens, n, adapter, config, path):
        """keep = the image's target (``_budget.py``)."""
        return {"keep": tokens}

    @classmethod
    def test_params(cls, adapter):
        return {"keep": 5}

    def n_keep(self, n: int) -> int:
        cfg = self.config_for(n)  # a budget's keep for this image's own count
        return min(n, cfg.keep) if cfg.fraction is None else round(cfg.fraction * n)

    def prune_vision(self, vision, batch):
        cfg = self.config
        counts = vision.counts()
        keeps = [self.n_keep(n) for n in counts]
        if all(n <= k for n, k in zip(counts, keeps)):
            vision.stats[self.name] = {"per_sample_kept": per_sample(counts, batch.image_owner, batch.batch_size)}
            return vision
        for i, (n, k) in enumerate(zip(counts, keeps)):
            if n <= k:
                continue
            rows_px = vision.extras.get("n_patches")  # padded pixel rows (Qwen-VL): hash the image's own
            pixels = vision.pixel_values[i] if rows_px is None else vision.pixel_values[i][: rows_px[i]]
            seed = image_seed(cfg.seed, pixels) if cfg.mask == "per_image" else cfg.seed
            g = torch.Generator().manual_seed(seed)
            rows = torch.randperm(n, generator=g)[:k].sort().values
            select_rows(vision, i, rows.to(vision.features[i].device))
        vision.stats[self.name] = {"per_sample_kept": per_sample(vision.counts(), batch.image_owner, batch.batch_size)}
        return vision
