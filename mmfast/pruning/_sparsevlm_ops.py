"""SparseVLM's per-image filter and counts as pure functions (the method: :mod:`.sparsevlm`)."""

from __future__ import annotations

import torch

from ._dpc_knn import dpc_knn_merge


def text_raters(embeds: torch.Tensor, vision: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
    """Every sample's raters (SparseVLM step 1) at once: M = softmax over the sample's text after the image of
    (vision embeds x text embeds^T), averaged over its vision tokens; the raters are the text tokens with M above
    its mean (all of them when none is: one text token). ``embeds`` [B, L, d] (the LLM's input embeddings),
    ``vision``, ``text`` [B, L] bool (the text after the image: each row's last tokens). Two reads (the widest
    text, the most raters). Returns [B, R] long: each sample's raters as offsets into its text, in order, then -1
    (R: the most raters of a sample, at least 1; a sample without vision or text tokens has none)."""
    n_text = text.sum(1)  # [B]
    width = max(1, int(n_text.max()))  # the first read
    ar = torch.arange(width, device=text.device)
    start = width - n_text  # [B] where each row's text starts in its last ``width`` slots
    valid = ar[None, :] >= start[:, None]  # [B, W]
    tail = embeds[:, embeds.shape[1] - width :].float()  # [B, W, d] each row's last slots: its text, after padding
    logits = (embeds.float() @ tail.transpose(1, 2)).masked_fill(~valid[:, None, :], float("-inf"))  # [B, L, W]
    n_vis = vision.sum(1)  # [B]
    rel = (logits.softmax(-1).nan_to_num() * vision[:, :, None]).sum(1) / n_vis.clamp(min=1)[:, None]  # [B, W]
    mean = (rel * valid).sum(1, keepdim=True) / n_text.clamp(min=1)[:, None]  # [B, 1]
    raters = valid & (rel > mean)
    raters |= valid & ~raters.any(1, keepdim=True)  # nobody above the mean: every text token rates
    raters &= (n_vis > 0)[:, None]
    n_raters = max(1, int(raters.sum(1).max()))  # the second read: the probe computes this many rows
    ranked = torch.where(raters, ar, width + ar).sort(1).values[:, :n_raters]  # [B, R] the raters' slots first
    return torch.where(ranked < width, ranked - start[:, None], -1)


def image_counts(image: torch.Tensor) -> list[list[int]]:
    """[B][J] each sample's slots of each of the J images (``image`` [B, T]: the slot's image, -1 for others; J: the
    largest image index + 1, 0 without images): one read."""
    bsz, t = image.shape
    counts = torch.zeros(bsz, t + 1, dtype=torch.long, device=image.device)
    rows = counts.scatter_add_(1, image + 1, torch.ones_like(image))[:, 1:].tolist()  # column 0: no image
    n_images = max((j + 1 for row in rows for j, c in enumerate(row) if c), default=0)
    return [row[:n_images] for row in rows]


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


def filter_stage(
    probs: torch.Tensor,
    rows: torch.Tensor,
    image: torch.Tensor,
    hidden: torch.Tensor,
    vision: torch.Tensor,
    plan: tuple[tuple[int, int, int, int, int, int], ...],
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One filter over a batch, in fixed shapes (a captured graph where the session captures): each vision
    slot's score is the raters' mean head-mean attention (``probs`` [B, R, T], ``rows`` [B, R]: -1 pads), and
    each image of each sample in ``plan`` ((sample, image, slots present, kept, recycled, clusters), host-known)
    is :func:`filter_image`'d. ``image`` [B, T]: each slot's image (-1 elsewhere); ``hidden`` [B, T, d];
    ``vision`` [B, T] bool. Returns the keep mask [B, T] (every slot but the dropped vision ones), and,
    where ``plan`` recycles, the runner's edit besides: the merged tokens' slots [B, T] bool, their hidden
    states [B, T, d] and the layout key [B, T] float64 that puts them after their image's kept tokens."""
    n_r = (rows >= 0).sum(1).clamp(min=1)  # [B]
    score = probs.sum(1) / n_r[:, None]  # [B, T]
    bsz, t = vision.shape
    keep = ~vision  # [B, T] text and padding kept (the runner keeps padding out)
    replace = torch.zeros_like(keep)
    new_hidden = torch.zeros_like(hidden)
    order = torch.arange(t, device=keep.device, dtype=torch.float64).expand(bsz, -1).clone()
    for b, j, n, k, top, clusters in plan:
        packed = filter_image(score[b], image[b], hidden[b], j=j, n=n, k=k, top=top, clusters=clusters)
        keep[b, packed[:k].long()] = True
        if clusters:
            hosts, anchor = packed[k : k + clusters].long(), packed[k + clusters]
            keep[b, hosts] = True
            replace[b, hosts] = True
            new_hidden[b, hosts] = packed[k + clusters + 1 :].view(clusters, -1).to(new_hidden.dtype)
            step = (torch.arange(clusters, device=keep.device, dtype=torch.float64) + 1) / (clusters + 1)
            order[b, hosts] = anchor + step
    if not any(p[-1] for p in plan):
        return keep
    return keep, replace, new_hidden, order
