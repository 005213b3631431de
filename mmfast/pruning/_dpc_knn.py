"""DPC-kNN token clustering (density peaks over k nearest neighbours, as SparseVLM's release recycles its
deleted tokens: ``cluster_and_merge`` in its code, after TCFormer), the pairwise distances a block of rows at
a time."""

from __future__ import annotations

import math

import torch

#: bytes of the [rows, n, C] differences :func:`pairwise_distance` holds at once
PAIRWISE_CHUNK_BYTES = 1 << 30


def pairwise_distance(xf: torch.Tensor, chunk_bytes: int = PAIRWISE_CHUNK_BYTES) -> torch.Tensor:
    """``(xf[:, None] - xf[None]).norm(dim=-1)`` ([n, n]), the release's arithmetic, a block of rows at a time:
    the release materialises all [n, n, C] differences at once (fp32: 60 GiB above the model for SparseVLM at 64
    frames of LLaVA-OneVision-7B on the H200, growing with the square of the tokens); each distance is the
    same norm of the same difference vector, so the blocks give the same values."""
    n, c_dim = xf.shape
    rows = max(1, chunk_bytes // max(1, n * c_dim * xf.element_size()))
    if rows >= n:
        return (xf[:, None] - xf[None]).norm(dim=-1)
    return torch.cat([(xf[i : i + rows, None] - xf[None]).norm(dim=-1) for i in range(0, n, rows)])  # [n, n]


def dpc_knn_merge(x: torch.Tensor, n_clusters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DPC-kNN clustering of ``x`` ([n, C]) into ``n_clusters``; returns the merged tokens [c, C] (fp32,
    cluster order = descending centre score) and the centre indices [c] into ``x``."""
    n, c_dim = x.shape
    xf = x.float()
    dist = pairwise_distance(xf) / math.sqrt(c_dim)  # [n, n]
    knn = dist.topk(n_clusters, dim=-1, largest=False).values  # [n, k] (self included)
    density = (-(knn**2).mean(-1)).exp()  # [n]
    idx = torch.arange(n, device=x.device)
    denser = (density[None, :] > density[:, None]) | (
        (density[None, :] == density[:, None]) & (idx[None, :] < idx[:, None])
    )
    indicator = torch.where(denser, dist, dist.max()).min(-1).values  # [n] distance to the nearest denser token
    centres = (indicator * density).topk(n_clusters).indices  # [c]
    assign = dist[:, centres].argmin(-1)  # [n] nearest centre
    assign[centres] = torch.arange(n_clusters, device=x.device)
    sums = torch.zeros(n_clusters, c_dim, device=x.device).index_add_(0, assign, xf)
    sizes = torch.zeros(n_clusters, device=x.device).index_add_(0, assign, torch.ones(n, device=x.device))
    return sums / (sizes[:, None] + 1e-6), centres
