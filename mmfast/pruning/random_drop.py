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
Models that re-pack anyres tiles after the projector (LLaVA-NeXT, LLaVA-OneVision; their images' and
OneVision's videos' LLM-input tokens are the packed base view, mosaic and newlines, or pooled frames and
the closing newline): the subset is drawn from those packed tokens (as DivPrune's candidates), since an
edit of the per-tile features before the projector would not reach the LLM.
Limits: none (batch > 1, several images per prompt, any grid, dynamic resolution, tiles, video).
No-op: ``keep`` >= the tokens of the image returns the vision batch untouched.

Budget (``budget: {tokens: B}`` or ``{ratio: r}``, vision tokens per image at the LLM input): keep =
the image's target (B, or round(r N_i)), exact, on every family (``_budget.py``); N_i counts the image's
LLM-input tokens (packed tiles and newlines included where the model packs them), per video on a video.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal

import torch

from ..capabilities import Capabilities
from ..config import opt
from ..registry import PRUNERS
from ._grid import per_sample, select_rows
from .base import Pruner
from .divprune import select_image_rows


def image_seed(seed: int, pixel_values: torch.Tensor) -> int:
    """A 63-bit seed from ``seed`` and the bytes of one image's pixel values."""
    h = hashlib.blake2b(pixel_values.detach().float().cpu().contiguous().numpy().tobytes(), digest_size=8)
    h.update(int(seed).to_bytes(8, "little", signed=True))
    return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)


def own_pixels(vision, i: int) -> torch.Tensor:
    """Image ``i``'s own pixel values, whatever the batch: Qwen-VL pads each image's patch rows to the batch's
    longest; anyres towers (LLaVA-NeXT, OneVision) take every image's tiles as one flat list, OneVision's videos
    come padded to the batch's most frames."""
    pv = vision.pixel_values
    rows = vision.extras.get("n_patches")
    if rows is not None:
        return pv[i][: int(rows[i])]
    tiles = vision.extras.get("n_tiles")
    if tiles is None:
        return pv[i]
    if pv.shape[0] == sum(int(t) for t in tiles):  # [sum tiles, 3, H, W]: every image's tiles in one list
        start = sum(int(t) for t in tiles[:i])
        return pv[start : start + int(tiles[i])]
    return pv[i][: int(tiles[i])]  # [n_items, max frames, 3, H, W]: a video's frames, padded to the batch's longest


@PRUNERS.register("random", description="Random drop: keep a seeded random subset of image tokens (baseline)")
class RandomDrop(Pruner):
    """Random token drop (baseline)."""

    hook_points = frozenset({"vision_features"})
    # the candidates are an image's LLM-input tokens, whatever their layout (packed tiles: after the projector)
    caps = Capabilities(edits_features=True)

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
        return {"fraction": 1.0}  # every token of every image, whatever its count

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
        packed = self.adapter.features.tiles != "none"  # counts (and rows) are the packed LLM-input tokens
        for i, (n, k) in enumerate(zip(counts, keeps)):
            if n <= k:
                continue
            seed = image_seed(cfg.seed, own_pixels(vision, i)) if cfg.mask == "per_image" else cfg.seed
            g = torch.Generator().manual_seed(seed)
            rows = torch.randperm(n, generator=g)[:k].sort().values  # [k] original order
            if packed:  # rows of the packed LLM-input tokens (the adapter's projection)
                select_image_rows(vision, i, rows.to(vision.projected[i].device))
            else:
                select_rows(vision, i, rows.to(vision.features[i].device))
        vision.stats[self.name] = {"per_sample_kept": per_sample(vision.counts(), batch.image_owner, batch.batch_size)}
        return vision
