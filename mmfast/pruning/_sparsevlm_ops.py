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


#: a filter's plan: (sample, image, slots present, kept, recycled, clusters) of every image still present (host-known)
Plan = tuple[tuple[int, int, int, int, int, int], ...]


def filter_ranks(probs: torch.Tensor, rows: torch.Tensor, image: torch.Tensor, plan: Plan) -> torch.Tensor:
    """A filter's first part over a batch, in fixed shapes (a captured call): each vision slot's score is the raters'
    mean head-mean attention (``probs`` [B, R, T], ``rows`` [B, R]: -1 pads); each image of ``plan`` (``image``
    [B, T]: each slot's image, -1 elsewhere) keeps its top ``k`` slots by score, and its best ``top`` deleted slots
    (by descending score) are recycled. Returns [sum(k + top + 1) + sum(top)] long, packed per entry: the kept
    slots, the recycled slots, the anchor the merged tokens go after (the last kept slot, or the image's first slot
    - 1); then every recycled slot's place in the flattened [B * T] batch (what the hidden states are read at)."""
    n_r = (rows >= 0).sum(1).clamp(min=1)  # [B]
    score = probs.sum(1) / n_r[:, None]  # [B, T]
    t = image.shape[1]
    parts, places = [], []
    for b, j, n, k, top, _clusters in plan:
        cand = torch.argsort((image[b] != j).to(torch.int8), stable=True)[:n]  # [n] image j's slots, in order
        ranked = cand[score[b, cand].float().argsort(descending=True, stable=True)]
        kept, recycled = ranked[:k], ranked[k : k + top]
        anchor = (kept.max() if k else cand.min() - 1).reshape(1)
        parts += [kept, recycled, anchor]
        places.append(recycled + b * t)
    return torch.cat(parts + places)


def filter_edit(
    ranks: torch.Tensor, recycled: torch.Tensor, vision: torch.Tensor, plan: Plan
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A filter's second part (a captured call): from :func:`filter_ranks`' ``ranks`` and the recycled slots' hidden
    states ``recycled`` ([sum top, d], in its order), each image's recycled tokens merged into ``clusters`` DPC-kNN
    clusters. Returns the keep mask [B, T] (every slot but the dropped vision ones; ``vision`` [B, T] bool), and,
    where ``plan`` recycles, the runner's edit besides: the merged tokens' slots [B, T] bool (each takes its cluster
    centre's slot), the layout key [B, T] float64 that puts them after their image's kept tokens, their places in
    the flattened batch [C] and their hidden states [C, d] (fp32)."""
    bsz, t = vision.shape
    keep = ~vision  # [B, T] text and padding kept (the runner keeps padding out)
    replace = torch.zeros_like(keep)
    order = torch.arange(t, device=keep.device, dtype=torch.float64).expand(bsz, -1).clone()
    places, merged_all = [], []
    at, row = 0, 0
    for b, _j, _n, k, top, clusters in plan:
        kept, slots, anchor = ranks[at : at + k], ranks[at + k : at + k + top], ranks[at + k + top]
        at += k + top + 1
        keep[b, kept] = True
        if clusters:
            merged, centres = dpc_knn_merge(recycled[row : row + top], clusters)  # [c, d], [c]
            hosts = slots[centres]  # [c] each merged token takes its centre's slot
            keep[b, hosts] = True
            replace[b, hosts] = True
            step = (torch.arange(clusters, device=keep.device, dtype=torch.float64) + 1) / (clusters + 1)
            order[b, hosts] = anchor + step
            places.append(hosts + b * t)
            merged_all.append(merged)
        row += top
    if not places:
        return keep
    return keep, replace, order, torch.cat(places), torch.cat(merged_all)
