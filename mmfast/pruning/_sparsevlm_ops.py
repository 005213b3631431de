"""SparseVLM's per-image filter and counts as pure functions (the method: :mod:`.sparsevlm`)."""

from __future__ import annotations

import torch

from ._dpc_knn import dpc_knn_merge


def per_image_counts(image: torch.Tensor, n_images: int) -> list[list[int]]:
    """[B][n_images] each sample's slots of each image, from ``image`` ([B, T]: the slot's image, -1 for others):
    one read."""
    counts = torch.zeros(image.shape[0], n_images + 1, dtype=torch.long, device=image.device)
    return counts.scatter_add_(1, image + 1, torch.ones_like(image))[:, 1:].tolist()  # column 0: no image


def filter_image(
    score: torch.Tensor, image: torch.Tensor, hidden: torch.Tensor, j: int, n: int, k: int, top: int, clusters: int
) -> torch.Tensor:
    """One filter on image ``j`` of one sample, whose ``n`` vision slots are present (host-known): keep the top
    ``k`` by ``score`` ([T]; ``image`` [T]: each slot's image, -1 for others), and of the deleted ones (by
    descending score) merge the top ``top`` into ``clusters`` DPC-kNN clusters (``hidden`` [T, d]). A pure function
    of fixed shapes (a captured graph where the session captures). Returns float64, packed: the kept slots [k],
    the clusters' host slots (their centres') [c], the anchor the merged tokens are placed after [1] (the last kept
    slot, or the image's first slot - 1) and the merged tokens [c * d]."""
    cand = torch.argsort((image != j).to(torch.int8), stable=True)[:n]  # [n] image j's slots, in order
    ranked = cand[score[cand].float().argsort(descending=True, stable=True)]
    kept, deleted = ranked[:k], ranked[k:]  # deleted: by descending score
    anchor = (kept.max() if k else cand.min() - 1).reshape(1)
    if not clusters:
        return torch.cat([kept.double(), anchor.double()])
    merged, centres = dpc_knn_merge(hidden[deleted[:top]], clusters)  # [c, d], [c]
    hosts = deleted[:top][centres]  # [c] each merged token takes its centre's slot
    return torch.cat([kept.double(), hosts.double(), anchor.double(), merged.double().flatten()])
