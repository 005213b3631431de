"""MustDrop's tensor operations (``mustdrop.py`` holds the stage): the window merge of the vision
encoder, the dual-attention drop rule of the prefill filters, what the stage tracks through a prefill,
the KV policy after prefill and the stage's token counts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .. import compat
from ..runtime import LayerGroup, LMState


def window_similarity(patches: torch.Tensor, grid: tuple[int, int], window: int) -> torch.Tensor:
    """Mean off-diagonal pairwise cosine similarity of each w x w window: [B, W] fp32.

    ``patches``: [B, rows * cols, D] in raster order. Windows are listed in raster order of the
    window grid.
    """
    tokens = window_tokens(grid, window, patches.device)  # [W, w*w]
    x = patches.float()[:, tokens]  # [B, W, w*w, D]
    x = x / x.norm(dim=-1, keepdim=True).clamp(min=1e-8)
    sims = x @ x.transpose(-1, -2)  # [B, W, n, n]
    n = tokens.shape[1]
    off_diag = sims.sum((-1, -2)) - sims.diagonal(dim1=-2, dim2=-1).sum(-1)
    return off_diag / (n * (n - 1))


def window_tokens(grid: tuple[int, int], window: int, device=None) -> torch.Tensor:
    """[W, w*w] raster patch indices of each window (windows in raster order, members in raster order)."""
    rows, cols = grid
    idx = torch.arange(rows * cols, device=device).reshape(rows // window, window, cols // window, window)
    return idx.permute(0, 2, 1, 3).reshape(-1, window * window)


def spatial_merge(
    hidden: torch.Tensor, grid: tuple[int, int], window: int, threshold: float
) -> tuple[torch.Tensor, int, torch.Tensor]:
    """MustDrop's local spatial merge of ``hidden`` [B, 1 + N, D] (CLS first).

    Returns the merged hidden states [B, 1 + N - r (w*w - 1), D], r (windows merged per image, the
    batch minimum of the windows whose similarity is >= ``threshold``) and the raster patch id of
    every output patch token [B, N'] (-1 for merged windows). r = 0 returns ``hidden`` itself.
    """
    bsz, t, d = hidden.shape
    if t != 1 + grid[0] * grid[1]:
        raise ValueError(f"MustDrop's merge expects CLS + {grid[0]}x{grid[1]} patches, got {t} tokens")
    cls, patches = hidden[:, :1], hidden[:, 1:]
    sim = window_similarity(patches, grid, window)  # [B, W]
    r = int((sim >= threshold).sum(1).min())
    n = patches.shape[1]
    if r == 0:
        return hidden, 0, torch.arange(n, device=hidden.device).expand(bsz, -1)
    tokens = window_tokens(grid, window, hidden.device)  # [W, w*w]
    chosen = sim.argsort(dim=1, descending=True, stable=True)[:, :r]  # [B, r] most similar first
    members = tokens[chosen]  # [B, r, w*w]
    merged = patches.float().gather(1, members.reshape(bsz, -1, 1).expand(-1, -1, d))  # [B, r*w*w, D]
    merged = merged.reshape(bsz, r, -1, d).mean(2)  # size-weighted average of size-1 tokens
    in_window = torch.zeros(bsz, n, dtype=torch.bool, device=hidden.device)
    in_window.scatter_(1, members.reshape(bsz, -1), True)
    keep_ids = torch.arange(n, device=hidden.device).expand(bsz, -1)[~in_window].reshape(bsz, -1)  # raster order
    unmerged = patches.gather(1, keep_ids[..., None].expand(-1, -1, d))
    out = torch.cat([cls, merged.to(hidden.dtype), unmerged], dim=1)
    ids = torch.cat([torch.full((bsz, r), -1, dtype=torch.long, device=hidden.device), keep_ids], dim=1)
    return out, r, ids


def padded_spatial_merge(
    hidden: torch.Tensor, grid: tuple[int, int], window: int, threshold: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`spatial_merge` in fixed shapes with no host read (a captured tower graph's), each row its own r.

    ``threshold``: a 0-dim tensor on the device (the graph reads its memory). Returns the merged hidden states
    padded to the input's [B, 1 + N, D] (row b: CLS, its r_b merged windows most similar first, its unmerged patches
    in raster order, then zeros), ``valid`` [B, 1 + N] bool (the first 1 + N'_b slots) and the raster patch id of
    every patch slot [B, N] (-1 for a merged window and for padding). Row b's valid part equals what
    :func:`spatial_merge` gives that image alone."""
    bsz, t, d = hidden.shape
    if t != 1 + grid[0] * grid[1]:
        raise ValueError(f"MustDrop's merge expects CLS + {grid[0]}x{grid[1]} patches, got {t} tokens")
    cls, patches = hidden[:, :1], hidden[:, 1:]
    n = patches.shape[1]
    sim = window_similarity(patches, grid, window)  # [B, W]
    tokens = window_tokens(grid, window, hidden.device)  # [W, w*w]
    order = sim.argsort(dim=1, descending=True, stable=True)  # [B, W] most similar first: the merged ones lead
    merged = (sim >= threshold).gather(1, order)  # [B, W] window (in that order) is merged
    members = tokens[order]  # [B, W, w*w]
    means = patches.float().gather(1, members.reshape(bsz, -1, 1).expand(-1, -1, d))  # [B, W*w*w, D]
    means = means.reshape(bsz, members.shape[1], -1, d).mean(2).to(hidden.dtype)  # [B, W, D]
    in_window = torch.zeros(bsz, n, dtype=torch.bool, device=hidden.device)
    in_window.scatter_(1, members.reshape(bsz, -1), merged[:, :, None].expand_as(members).reshape(bsz, -1))
    # candidates: every window's mean, then every patch; the merged windows' and the unmerged patches' are kept,
    # moved to the front in that order (N' <= N of them)
    cand = torch.cat([means, patches], 1)  # [B, W + N, D]
    keep = torch.cat([merged, ~in_window], 1)  # [B, W + N]
    ids = torch.cat(
        [torch.full_like(merged, -1, dtype=torch.long), torch.arange(n, device=hidden.device).expand(bsz, -1)], 1
    )
    pos = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)[:, :n]  # [B, N] kept candidates first
    valid = keep.gather(1, pos)  # [B, N]
    out = cand.gather(1, pos[..., None].expand(-1, -1, d)).masked_fill(~valid[..., None], 0)  # [B, N, D]
    out_ids = ids.gather(1, pos).masked_fill(~valid, -1)  # [B, N]
    valid = torch.cat([torch.ones_like(valid[:, :1]), valid], 1)  # [B, 1 + N] CLS is valid
    return torch.cat([cls, out], 1), valid, out_ids


@dataclass
class PrefillData:
    """What MustDrop tracks through one prefill (kept in that state's ``extras``)."""

    n_text: torch.Tensor  # [B] instruction tokens after the image
    width: int  # max(1, max n_text): the text rows' count (read once a prefill, for every filter's probe rows)
    key_full: torch.Tensor  # [B, L] bool key-set slots of the prefill sequence
    counts: list[torch.Tensor]  # [B] vision tokens entering the LLM, then after each stage


def text_rows(n_text: torch.Tensor, q_len: int, width: int) -> torch.Tensor:
    """[B, width] query rows of the text after the image: the last ``n_text[b]`` of ``q_len`` rows of each sample,
    left-padded with -1 (``width``: max(1, max n_b), known on the host)."""
    i = torch.arange(width, device=n_text.device)
    rows = (q_len - width + i).expand(n_text.shape[0], -1)
    return rows.masked_fill(i[None, :] < width - n_text[:, None], -1)


def dual_attention_drop(
    attn: torch.Tensor,
    vision: torch.Tensor,
    key: torch.Tensor,
    lambda_g: float | torch.Tensor,
    lambda_i: float | torch.Tensor,
) -> torch.Tensor:
    """[B, T] bool slots MustDrop drops: vision, not key, g < lambda_g * sum(g) and m < lambda_i.

    ``attn``: [B, R, T] head-mean attention of the text rows (all-zero rows are ignored) to all slots;
    ``vision``, ``key``: [B, T] bool.
    """
    g = attn.sum(1)  # [B, T] global attention each slot receives
    m = attn.amax(1)  # [B, T] largest individual attention
    total = (g * vision).sum(1, keepdim=True)  # over the surviving image tokens
    return vision & ~key & (g < lambda_g * total) & (m < lambda_i)


def filter_keep(
    attn: torch.Tensor, vision: torch.Tensor, key_full: torch.Tensor, source: torch.Tensor, lambdas: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One filter in fixed shapes (a captured call): the keep mask [B, T] (:func:`dual_attention_drop`'s complement)
    and the vision tokens it keeps [B]. ``key_full`` [B, L]: the key set over the prompt; ``source`` [B, T]: each
    slot's prompt index (-1: none); ``lambdas`` [2]: (lambda_g, lambda_i)."""
    key = key_full.gather(1, source.clamp(min=0)) & (source >= 0)  # [B, T] key-set slots
    drop = dual_attention_drop(attn, vision, key, lambdas[0], lambdas[1])
    return ~drop, (vision & ~drop).sum(1)


class DeviceScalars:
    """Host floats as one device tensor, made again only when they change (what a captured call copies in)."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._values = torch.zeros(0)

    def __call__(self, values: tuple[float, ...], device: torch.device) -> torch.Tensor:
        if self._key != (values, device):
            self._key, self._values = (values, device), torch.tensor(values, dtype=torch.float64, device=device)
        return self._values


def apply_kv_policy(state: LMState, first: int, last_start: int, ref_start: float | None = None) -> None:
    """Trim the caches of layers ``first`` .. ``last_start - 1`` to the slots that survive at ``last_start``.

    The group holding ``first`` is split there (earlier layers keep their cache); each trimmed group's
    positions are renumbered 0..L_final-1, so its next token takes the cache length as position, as
    the MustDrop code does.
    """
    final_g = state.group_of(last_start)
    final = state.groups[final_g]
    if final.start <= first:
        return  # nothing was dropped at or after ``first``
    g1 = state.group_of(first)
    head = state.groups[g1]
    if head.start < first:
        state.groups.insert(
            g1 + 1,
            LayerGroup(
                first,
                head.key_mask.clone(),
                head.positions.clone(),
                head.source.clone(),
                compact=True,
                ref_start=ref_start,
            ),
        )
        g1, final_g = g1 + 1, final_g + 1
    length = int(state.inputs.input_ids.shape[1])
    src = final.source.clamp(min=0)
    survivor = torch.zeros(final.key_mask.shape[0], length, dtype=torch.long, device=src.device)
    survivor.scatter_add_(1, src, (final.key_mask & (final.source >= 0)).long())
    survivor = survivor > 0  # [B, L] prefill tokens that reach the last stage
    for g in range(g1, final_g):
        grp = state.groups[g]
        keep = grp.key_mask & (grp.source >= 0) & survivor.gather(1, grp.source.clamp(min=0))
        state.select_slots(g, *right_aligned(keep))
        grp.positions = (grp.key_mask.long().cumsum(1) - 1).masked_fill(~grp.key_mask, 1)


def right_aligned(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """keep [B, T] bool -> (index [B, T'] of each row's kept slots in order, right-aligned, 0 before them;
    valid [B, T']), T' the largest count: one read of the counts, no read per row."""
    counts = keep.sum(1)  # [B]
    width = int(counts.max()) if keep.shape[0] else 0
    order = torch.argsort(keep.to(torch.int8), dim=1, stable=True)[:, keep.shape[1] - width :]  # kept ones last
    valid = torch.arange(width, device=keep.device)[None, :] >= (width - counts)[:, None]  # [B, T']
    return order.masked_fill(~valid, 0), valid


def kv_policy_bytes(state: LMState, first: int, last_start: int) -> torch.Tensor:
    """[B] float64 logical KV bytes of ``state``'s cache after :func:`apply_kv_policy` (layers from ``first`` hold
    the slots that reach ``last_start``), without trimming it (what nothing reads: a one-token call's)."""
    held = [grp.key_mask.sum(1) for grp in state.groups]  # [B] each: valid prefill slots per group
    final = held[state.group_of(last_start)]
    per_layer = torch.stack([final if i >= first else held[state.group_of(i)] for i in range(state.n_layers)])
    slot = torch.tensor([compat.slot_bytes(lay) for lay in state.cache.layers], dtype=torch.float64)  # [L]
    return (per_layer.double().cpu() * slot[:, None]).sum(0)  # one read


def token_stats(counts: list[torch.Tensor], filters: list[int], n_layers: int) -> dict[str, Any]:
    """The vision-token figures of one prefill from ``counts`` ([B] each: the tokens entering the LLM, then
    after the filter at the output of each of the layers ``filters``) of an ``n_layers``-layer LLM."""
    kept = torch.stack(counts, 1)  # [B, 1 + n_stages] vision tokens entering the LLM, after each stage

    def layer_average(starts: list[int]) -> list[float]:
        idx = [max(i for i, s in enumerate(starts) if s <= layer) for layer in range(n_layers)]
        return kept[:, idx].float().mean(1).tolist()

    return {
        "per_sample_kept": kept.tolist(),
        # what prefill computed: stage k's count from layer l_k + 1 on
        "per_sample_prefill_tokens_layer_avg": layer_average([0] + [layer + 1 for layer in filters]),
        # the figure the MustDrop code prints (and its tables call "tokens"): counted from layer l_k
        "per_sample_equivalent_tokens": layer_average([0] + filters),
        "filter_layers": filters,
    }
