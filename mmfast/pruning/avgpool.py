"""2-D average pooling of the patch grid: the "uniform merge" baseline (no paper of its own).

The unconditional compression that HICom (arXiv 2503.16036) and LLaVA-Video style models start from,
and a baseline row in VisionZip's (arXiv 2412.04467) ablations.

Algorithm: reshape each image's pre-projection patch features to the ``rows x cols`` grid, apply
2-D adaptive average pooling to a near-square ``oh x ow`` grid with about ``keep`` cells
(``oh = round(sqrt(keep * rows / cols))``, ``ow = round(keep / oh)``; 24x24 -> 64: 8x8, 128: 11x12
= 132, 192: 14x14 = 196; the actual count is in the stats), and feed the pooled tokens in
raster order to the existing projector. A non-patch token (CLS under the ``full`` select strategy)
is kept in front.

Hook points: ``vision_features``. Positions: contiguous. Limits: must be the first feature stage
(needs the full grid). No-op: ``keep`` >= rows x cols returns the vision batch untouched.

Budget (``budget: {tokens: B}``, vision tokens per image at the LLM input): keep = B; the count is
the near-square grid's ``oh * ow`` above (granularity: 24x24 -> 64: 64, 128: 132, 192: 196; the
rule is :func:`~mmfast.pruning._grid.near_square_grid`), not always B exactly.

Qwen-VL families (qwen2_vl, qwen2_5_vl, qwen3_vl): refused: pools one square patch grid
shared by all images; per-image dynamic grids are not wired.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..capabilities import Capabilities, Need
from ..config import opt
from ..registry import PRUNERS
from ._grid import grid_features, near_square_grid, per_sample
from .base import Pruner


@PRUNERS.register(
    "avgpool", description="Average pooling: adaptive 2-D pooling of the patch grid to about `keep` tokens (baseline)"
)
class AvgPool(Pruner):
    """2-D adaptive average pooling (baseline)."""

    hook_points = frozenset({"vision_features"})
    caps = Capabilities(
        needs=frozenset({Need.UNTILED, Need.SQUARE_GRID}),
        why={
            Need.UNTILED: "it pools one square patch grid per image",
            Need.SQUARE_GRID: "it pools one square patch grid shared by all images; per-image dynamic grids are "
            "not wired",
        },
        edits_features=True,
        needs_full_grid=True,
    )

    @dataclass(frozen=True)
    class Config:
        keep: int = opt(
            64, lo=1, doc="about this many pooled tokens per image (near-square grid; see stats for the count)"
        )

    budget_knobs = ("keep",)

    @classmethod
    def noop_params(cls, adapter):
        rows, cols = adapter.grid
        return {"keep": rows * cols}

    @classmethod
    def budget_params(cls, tokens, n, adapter, config, path):
        """keep = B (the pooled grid rounds it, see the module docstring)."""
        return {"keep": tokens}

    @classmethod
    def test_params(cls, adapter):
        return {"keep": 4}

    def out_grid(self, grid: tuple[int, int]) -> tuple[int, int]:
        return near_square_grid(self.config.keep, *grid)

    def prune_vision(self, vision, batch):
        rows, cols = vision.grid
        if self.config.keep >= rows * cols:
            vision.stats[self.name] = {
                "per_sample_kept": per_sample(vision.counts(), batch.image_owner, batch.batch_size)
            }
            return vision
        oh, ow = self.out_grid((rows, cols))
        for i in range(vision.n_images):
            grid, extra = grid_features(vision, i, "avgpool")  # [rows, cols, Dv], [E, Dv]
            pooled = F.adaptive_avg_pool2d(grid.permute(2, 0, 1).float(), (oh, ow))  # [Dv, oh, ow]
            pooled = pooled.flatten(1).T.to(grid.dtype)  # [oh*ow, Dv] raster order
            vision.features[i] = torch.cat([extra, pooled])
            vision.patch_ids[i] = torch.full((extra.shape[0] + oh * ow,), -1, dtype=torch.long, device=grid.device)
        vision.stats[self.name] = {
            "per_sample_kept": per_sample(vision.counts(), batch.image_owner, batch.batch_size),
            "grid": [oh, ow],
        }
        return vision
