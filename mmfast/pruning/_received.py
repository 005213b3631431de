"""VisionZip's CLS substitute on towers without a CLS token (Qwen-VL), as LightCompress runs it.

Source: ModelTC/LightCompress (formerly llmc) @9701d03, ``llmc/compression/token_reduction/visionzip.py``:
``Qwen2_5_VLVisionAttention_forward`` (the last tower block's attention probabilities and its keys
after the vision RoPE), ``merger_hook`` (pooling per 2x2 merge unit, window order -> raster order)
and ``prune_qwenv25vl_hook`` (dominant / contextual selection on the LLM input embeddings).

- :class:`ReceivedAttention`: a recorder on the last block's attention (the probe wrapper,
  ``hooks.attach``): for every chunk the block attends over (an image or frame in a full-attention
  block, a window in a windowed one), the attention each patch *receives*: the head-mean softmax
  summed over the chunk's query rows (fp32, computed in row blocks, never the whole matrix at once),
  and the head-mean keys;
- :func:`per_unit`: those per-patch values pooled over each merge unit's 4 patches (mean) and put
  back in raster order of the merged grid (Qwen2.5-VL: ``argsort(window_index)``), split per image;
- :func:`select`: the release's selection on one image.
"""

from __future__ import annotations

import torch

#: query rows per block when summing received attention (bounds the [H, rows, L] fp32 temporary)
ROW_BLOCK = 512


class ReceivedAttention:
    """Recorder (``ModuleAttentionHooks.recorders``) of the attention each key receives, per chunk call."""

    def __init__(self) -> None:
        self.received: list[torch.Tensor] = []  # per call [L_c] fp32
        self.keys: list[torch.Tensor] = []  # per call [L_c, head_dim] fp32

    def __call__(self, module, query, key, attention_mask, scaling) -> None:
        # query / key [B, H, L, D] after RoPE (the Qwen towers call attention once per chunk with B = 1)
        q, k = query.float(), key.float()
        bsz, heads, length, _ = q.shape
        got = torch.zeros(bsz, length, device=q.device)
        for r0 in range(0, length, ROW_BLOCK):
            logits = q[:, :, r0 : r0 + ROW_BLOCK] @ k.transpose(-1, -2) * scaling  # [B, H, rows, L]
            if attention_mask is not None:  # a tower mask (none on the Qwen towers' per-chunk calls)
                m = attention_mask[..., r0 : r0 + ROW_BLOCK, :]
                logits = logits.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else logits + m.float()
            got += logits.softmax(-1).mean(1).sum(1)  # [B, L]: head mean, summed over the rows
        self.received.extend(got.unbind(0))
        self.keys.extend(k.mean(1).unbind(0))  # [L, D]: the head-mean keys (the release's "attn_key")

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        """([S] received, [S, D] keys) of the tower's sequence since the last call, then forget them."""
        if not self.received:
            raise RuntimeError("visionzip: the tower's last block recorded no attention")
        out = torch.cat(self.received), torch.cat(self.keys)
        self.received, self.keys = [], []
        return out


def per_unit(
    values: torch.Tensor, unit: int, window_order: torch.Tensor | None, counts: list[int]
) -> list[torch.Tensor]:
    """Per-patch ``values`` ([S] or [S, D], tower order) -> per image [N_i] / [N_i, D]: the mean over
    each merge unit's ``unit`` consecutive patches, in raster order (``window_order``: the tower's
    unit permutation, Qwen2.5-VL's ``window_index``; None: already raster)."""
    pooled = values.reshape(-1, unit, *values.shape[1:]).mean(1)  # [S / unit, ...]
    if window_order is not None:
        pooled = pooled[torch.argsort(window_order.to(pooled.device))]
    return list(torch.split(pooled, counts))


def window_order(tower, merged_grids: list[tuple[int, int, int]], merge: int) -> torch.Tensor | None:
    """Qwen2.5-VL's unit permutation for these images (``get_vision_window_index``), None elsewhere."""
    if not hasattr(tower, "window_size"):
        return None
    from transformers.vision_utils import get_vision_window_index

    grid_thw = torch.tensor([[t, h * merge, w * merge] for t, h, w in merged_grids])
    index, _ = get_vision_window_index(
        grid_thw, spatial_merge_size=merge, window_size=tower.window_size, patch_size=tower.patch_size, kwargs={}
    )
    return index


def targets(r: int, n_ctx: int) -> torch.Tensor:
    """VisionZip's contextual targets among ``r`` remaining tokens: the first ``n_ctx`` of 0, step, 2 step, ..."""
    step = max(1, r // max(n_ctx, 1))
    return torch.arange(0, r, step)[: min(n_ctx, r)]


def select(
    received: torch.Tensor, keys: torch.Tensor, dominant: int, contextual: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The release's rule on one image of N merged tokens (``received`` [N], ``keys`` [N, D]):
    dominant = the top ``dominant`` by received attention; of the rest (raster order), ``contextual``
    targets by stride; every other remaining token goes to its most cosine-similar target (keys,
    L2-normalised). Returns (kept [K] raster indices, sorted; the rows of ``kept`` that are targets
    [C]; rest [R] raster indices; assign [R] long: the target (0..C-1) of each rest token, -1 for the
    targets themselves)."""
    n = received.shape[0]
    dev = received.device
    top = received.topk(min(dominant, n)).indices
    is_top = torch.zeros(n, dtype=torch.bool, device=dev)
    is_top[top] = True
    rest = (~is_top).nonzero().squeeze(1)  # [R] raster order
    tgt = targets(rest.numel(), contextual).to(dev)  # [C] into rest
    assign = torch.full((rest.numel(),), -1, dtype=torch.long, device=dev)
    if tgt.numel():
        m = keys[rest].float()
        m = m / m.norm(dim=-1, keepdim=True)
        others = torch.ones(rest.numel(), dtype=torch.bool, device=dev)
        others[tgt] = False
        assign[others] = (m[others] @ m[tgt].T).argmax(1)
    kept_mask = is_top.clone()
    kept_mask[rest[tgt]] = True
    kept = kept_mask.nonzero().squeeze(1)  # [K] raster order
    target_rows = torch.searchsorted(kept, rest[tgt])  # [C] rows of the targets in ``kept``
    return kept, target_rows, rest, assign


def merge_rows(x: torch.Tensor, kept: torch.Tensor, target_rows: torch.Tensor, rest, assign) -> torch.Tensor:
    """``x`` [N, ...] -> [K, ...]: the kept rows, each target replaced by itself + the mean of the rows
    assigned to it (the target added, not averaged in; a target with nothing assigned stays itself),
    computed in fp32 and cast back."""
    out = x[kept].clone()
    n_ctx = target_rows.numel()
    if n_ctx == 0:
        return out
    xf = x.float()
    moved = assign >= 0
    summed = torch.zeros(n_ctx, *x.shape[1:], device=x.device).index_add_(0, assign[moved], xf[rest[moved]])
    counts = torch.bincount(assign[moved], minlength=n_ctx).clamp(min=1).reshape(-1, *[1] * (x.dim() - 1))
    out[target_rows] = (xf[kept[target_rows]] + summed / counts).to(x.dtype)
    return out
