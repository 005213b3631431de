"""Helpers for feature-stage methods that work on the patch grid (VisionZip, HICom, avgpool, random).

- :func:`grid_features`: an image's patch tokens as a full ``[rows, cols, Dv]`` grid (plus any
  non-patch tokens such as CLS under the ``full`` select strategy), or a clear error when an earlier
  stage already removed patches;
- :func:`adaptive_bins` / :func:`near_square_grid`: the bins of ``torch.nn.AdaptiveAvgPool`` and the
  output grid with about ``n`` cells;
- :func:`group_index`: padded member lists of (t, h, w) groups, for grouped weighted pooling;
- :func:`per_sample`: per-image counts summed per prompt (stats).
"""

from __future__ import annotations

import functools
import math

import torch

from ..models.base import VisionBatch


def grid_features(vision: VisionBatch, i: int, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Image ``i``'s patch features as ``[rows, cols, Dv]`` and its non-patch rows (``patch_ids == -1``).

    Raises ValueError when the image does not hold exactly the full raster grid of patches (an
    earlier stage pruned or reordered it): grid methods must be the first feature stage.
    """
    rows, cols = vision.grid
    ids = vision.patch_ids[i]
    feats = vision.features[i]
    is_patch = ids >= 0
    patch_ids = ids[is_patch]
    if patch_ids.numel() != rows * cols or not torch.equal(patch_ids, torch.arange(rows * cols, device=ids.device)):
        raise ValueError(
            f"{method} needs the full {rows}x{cols} patch grid of every image, but an earlier stage left "
            f"{patch_ids.numel()} patches; put {method} first among the feature stages"
        )
    if vision.projected[i] is not None:
        raise ValueError(f"{method} works on pre-projection features, but an earlier stage already projected image {i}")
    return feats[is_patch].reshape(rows, cols, -1), feats[~is_patch]


def adaptive_bins(n_in: int, n_out: int) -> list[tuple[int, int]]:
    """[start, end) of each of ``n_out`` bins over ``n_in`` cells, exactly as adaptive pooling cuts them.

    Bins tile ``n_in`` when ``n_out`` divides it; otherwise neighbouring bins overlap by one cell.
    """
    return [(math.floor(i * n_in / n_out), math.ceil((i + 1) * n_in / n_out)) for i in range(n_out)]


def near_square_grid(n: int, rows: int, cols: int) -> tuple[int, int]:
    """An output grid ``(oh, ow)`` with about ``n`` cells and the aspect ratio of ``rows x cols``."""
    oh = min(rows, max(1, round(math.sqrt(n * rows / cols))))
    ow = min(cols, max(1, round(n / oh)))
    return oh, ow


def group_index(shape: tuple[int, int, int], out: tuple[int, int, int], device=None) -> torch.Tensor:
    """[G, S] long: raster indices (into a flattened ``t x h x w`` volume) of each group's members.

    Groups are the products of adaptive bins along t, h and w (``out`` bins each), listed in
    (t, h, w) raster order; groups smaller than the largest are padded with -1.
    """
    (t, h, w), (ot, oh, ow) = shape, out
    return group_index_bins(shape, (adaptive_bins(t, ot), adaptive_bins(h, oh), adaptive_bins(w, ow)), device)


def group_index_bins(shape: tuple[int, int, int], bins: tuple[list, list, list], device=None) -> torch.Tensor:
    """[G, S] long: raster indices into the flattened (t, h, w) volume of each group (the products of
    the per-axis ``bins``, groups in (t, h, w) raster order, members in (t, h, w) raster order, as the
    release's ``'(t1 h1 w1) (t2 h2 w2) d'``); smaller groups padded with -1. A fresh tensor on ``device``
    (built once per shape and bins: ~500 small host ops for HICom's 576 tokens, every call otherwise)."""
    index = _group_index(tuple(shape), tuple(tuple(tuple(b) for b in axis) for axis in bins))
    return index.clone() if device is None else index.to(device, copy=True)


@functools.lru_cache(maxsize=64)
def _group_index(shape: tuple[int, int, int], bins: tuple) -> torch.Tensor:
    _, h, w = shape
    groups = []
    for t0, t1 in bins[0]:
        for h0, h1 in bins[1]:
            for w0, w1 in bins[2]:
                tt = torch.arange(t0, t1)[:, None, None]
                hh = torch.arange(h0, h1)[None, :, None]
                ww = torch.arange(w0, w1)[None, None, :]
                groups.append(((tt * h + hh) * w + ww).reshape(-1))
    size = max(g.numel() for g in groups)
    index = torch.full((len(groups), size), -1, dtype=torch.long)
    for j, g in enumerate(groups):
        index[j, : g.numel()] = g
    return index


def select_rows(vision: VisionBatch, i: int, rows: torch.Tensor) -> None:
    """Keep rows ``rows`` of image ``i`` (features, patch ids, tags and projected tokens if set), in place."""
    vision.features[i] = vision.features[i][rows]
    vision.patch_ids[i] = vision.patch_ids[i][rows]
    for tags in vision.tags.values():
        tags[i] = tags[i][rows.to(tags[i].device)]
    if vision.projected[i] is not None:
        vision.projected[i] = vision.projected[i][rows]


def per_sample(counts: list[int], owner: list[int], batch_size: int) -> list[int]:
    """Per-image counts summed per prompt."""
    out = [0] * batch_size
    for n, b in zip(counts, owner):
        out[b] += int(n)
    return out
