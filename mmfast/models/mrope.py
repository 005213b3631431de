"""Multimodal RoPE (M-RoPE) positions of the Qwen-VL families, for mmfast's kept-token layouts.

Qwen2-VL, Qwen2.5-VL and Qwen3-VL give every token three rotary positions (temporal, height, width).
HF's ``get_rope_index`` numbers a sample span by span: a text run continues 1-D (the same id on the
3 axes); an image whose merged-token grid is (t, h, w) starting at position ``s`` gives its token at
grid cell (i, j, k) the ids (s + i, s + j, s + k); the text after it starts at ``s + max(h, w)``.
Decoding continues at (max over all positions) + 1 (``rope_deltas``).

mmfast's rules, for every layout a pruner can leave (docs/methods.md, "Positions under M-RoPE"):

* **Kept tokens keep their original ids**, text included: :func:`sample_positions` numbers the
  sample as if no vision token had been dropped (an image always reserves ``max(h, w)`` positions),
  then each kept vision token takes the ids of its grid cell (from its patch id). With nothing
  pruned this is exactly ``get_rope_index``; with tokens dropped before the LLM, every surviving
  token has the ids it would have had in the unpruned run (as in-LLM pruning keeps them), and the
  text after the image starts where it did. LightCompress's Qwen2.5-VL VisionZip and SparseVLM
  (ModelTC/LightCompress @9701d03) keep the kept tokens' ``position_ids`` rows / position
  embeddings likewise (a VisionZip contextual token: its target's row).
* **Merged or synthetic tokens** (patch id -1: VisionZip's contextual tokens, ToMe's merges reported
  as -1) take the ids of the nearest real token before them in the same image (in sequence order),
  or the image's first cell (s, s, s) when none precedes them.
* **Compact** renumbering (methods whose paper renumbers survivors 0..L'-1) is
  :func:`compact_positions` (no pruner uses it on the Qwen families: PyramidDrop and SparseVLM keep
  the original ids there).
"""

from __future__ import annotations

from typing import Any

import torch


def grid_offsets(patch_ids: torch.Tensor, grid: Any, time_interval: float = 1.0) -> torch.Tensor:
    """[N, 3] (t, h, w) offsets of tokens with raster ids ``patch_ids`` ([N]) in grid (t, h, w).

    The temporal offset of frame group ``i`` is ``int(i * time_interval)`` (HF's
    ``(arange(t) * time_interval).long()``; Qwen2.5-VL's videos space groups by
    ``tokens_per_second * second_per_grid_t``, :func:`mmfast.compat.qwen25_time_interval`).
    Tokens with id -1 copy the offsets of the nearest real token before them (or 0 if none).
    """
    t, h, w = (int(x) for x in grid[:3])
    pid = patch_ids.long()
    real = pid >= 0
    p = pid.clamp(min=0)
    frame = p // (h * w)
    tpos = frame if time_interval == 1 else (frame * time_interval).long()
    offs = torch.stack([tpos, (p // w) % h, p % w], dim=-1)  # [N, 3]
    if bool(real.all()):
        return offs
    n = pid.shape[0]
    idx = torch.where(real, torch.arange(n, device=pid.device), torch.full_like(pid, -1))
    last = idx.cummax(0).values  # [N] index of the last real token at or before each token
    return torch.where((last >= 0)[:, None], offs[last.clamp(min=0)], torch.zeros_like(offs))


def sample_positions(layout: list, device: torch.device) -> torch.Tensor:
    """[L, 3] positions of one sample. ``layout``: ("text", n) and ("image", patch_ids [N], (t, h, w)
    or (t, h, w, time_interval) for a video) pieces in sequence order (``build_lm_inputs``). As HF's
    ``get_rope_index``, the text after a video starts at s + max(h, w) too (its temporal ids may
    reach further; decoding continues after the maximum)."""
    parts, cur = [], 0
    for piece in layout:
        if piece[0] == "text":
            n = piece[1]
            parts.append((torch.arange(n, device=device) + cur)[:, None].expand(n, 3))
            cur += n
            continue
        _, pids, grid = piece
        if grid is None:
            raise ValueError("M-RoPE positions need each image's grid (VisionBatch.extras['grid_thw'])")
        interval = float(grid[3]) if len(grid) > 3 else 1.0
        parts.append(cur + grid_offsets(pids.to(device), grid, interval))
        cur += max(int(grid[1]), int(grid[2]))  # HF: the text after an image starts at s + max(h, w)
    if not parts:
        return torch.zeros(0, 3, dtype=torch.long, device=device)
    return torch.cat(parts).long()


def compact_positions(positions: torch.Tensor, image_index: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Compact M-RoPE renumbering of kept slots. ``positions`` [B, T, 3], ``image_index`` [B, T] (-1 at
    text), ``valid`` [B, T] bool. Returns [B, T, 3] (padding 1).

    The analogue of renumbering 1-D survivors 0..L'-1: text tokens are numbered consecutively; each
    image's kept tokens (a run of slots with the same ``image_index``) keep their offsets from the
    kept minimum of each axis and start at the running position; the next span starts after that
    image's maximum + 1. With nothing dropped this reproduces HF's numbering for images.
    """
    out = torch.ones_like(positions)
    for b in range(positions.shape[0]):
        slots = valid[b].nonzero().squeeze(1).tolist()
        cur, i = 0, 0
        while i < len(slots):
            s = slots[i]
            img = int(image_index[b, s])
            if img < 0:
                out[b, s] = cur
                cur += 1
                i += 1
                continue
            j = i
            while j < len(slots) and int(image_index[b, slots[j]]) == img:
                j += 1
            run = torch.tensor(slots[i:j], device=positions.device)
            p = positions[b, run]  # [n, 3]
            p = p - p.amin(0, keepdim=True) + cur
            out[b, run] = p
            cur = int(p.max()) + 1
            i = j
    return out
