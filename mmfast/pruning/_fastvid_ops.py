"""FastVID's pure functions (LunarShen/FastVID @a40a109). The release has two variants, ported here:

- Qwen2.5-VL (``fastvid_qwen25vl/lmms-eval/lmms_eval/models/qwenvlutils/modeling_qwen2_5_vl.py``):
  :func:`frame_attention` (``Qwen2_5_VLVisionFlashAttention2.forward``) and :func:`select_video`
  (``Qwen2_5_VLForConditionalGeneration.forward``: DySeg, sub-segments, STPrune, DTM per anchor);
- LLaVA-OneVision (``fastvid_llavaonevision/LLaVA-NeXT/llava/model/``): :func:`pooled_attention`
  (``llava_arch.get_attn_2dPool``) and :func:`select_video_ov` (``language_model/modeling_qwen2.py``,
  ``Qwen2Model.forward``: DySeg, every frame's salient tokens, parallel density peaks, DTM).

The method is :mod:`mmfast.pruning.fastvid`; these functions take one video's tensors and know nothing
of the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class FastVIDParams:
    """The release's knobs (``fastvid_*`` of ``eval.sh``)."""

    retention_ratio: float  # fraction of a frame's tokens kept (frame_retain_num = int(n r))
    c: int  # DySeg: at least c segments (the c - 1 least similar adjacent pairs are cuts)
    tau: float  # DySeg: every adjacent pair with cosine < tau is a cut too
    ignore: float  # within a segment: sub-segments end where cosine < ignore; only their last frame keeps tokens
    d: float  # STPrune: fraction of a segment's kept tokens that are context (density-merged) tokens
    p: int  # DTM: one in every p sub-segments (counted from the end) is an anchor holding context tokens
    beta: float  # DTM: an anchor's own weight is at least beta


def frame_attention(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The release's frame attention on one video, from its tower's last block: ``q`` / ``k`` [H, F, n, D]
    (after the vision RoPE, pooled per 2x2 merge unit, raster order): the frame's mean query against each
    unit's key, softmax over the frame's units, mean over heads. Returns [F, n] fp32."""
    q, k = q.float(), k.float()
    logits = q.mean(2, keepdim=True) @ k.transpose(-1, -2) / q.shape[-1] ** 0.5  # [H, F, 1, n]
    return logits.softmax(-1).mean(2).mean(0)  # [F, n]


def dyseg(glob: torch.Tensor, c: int, tau: float) -> list[int]:
    """DySeg on one video's frame features ``glob`` [F, d] (L2-normalised): segment sizes, in order."""
    n_frames = glob.shape[0]
    if n_frames < 2:
        return [n_frames]
    sim = (glob[:-1] * glob[1:]).sum(1)  # [F - 1]
    topk = torch.topk(sim, min(c - 1, n_frames - 1), largest=False).indices
    cuts = torch.unique(torch.cat([topk, torch.nonzero(sim < tau).squeeze(1)])).sort().values.tolist()
    return _sizes(cuts, n_frames)


def _sizes(cuts: list[int], n: int) -> list[int]:
    """Segment sizes of n frames cut after each frame in ``cuts`` (sorted)."""
    if not cuts:
        return [n]
    return [cuts[0] + 1] + [b - a for a, b in zip(cuts, cuts[1:])] + [n - cuts[-1] - 1]


def frame_counts(glob: torch.Tensor, n: int, prm: FastVIDParams) -> tuple[list[int], list[int]]:
    """STPrune's per-frame (salient, context) counts for one segment of L frames (``glob`` [L, d],
    L2-normalised) of n tokens each: the release's loop, line by line."""
    seg_len = glob.shape[0]
    seg_retain = int(n * prm.retention_ratio) * seg_len
    seg_context = max(int(seg_retain * prm.d), 1)
    seg_salient = seg_retain - seg_context
    if seg_len == 1:
        return [seg_salient], [seg_context]
    sub = _sizes(torch.nonzero((glob[:-1] * glob[1:]).sum(1) < prm.ignore).squeeze(1).sort().values.tolist(), seg_len)
    v = len(sub)
    salient = [seg_salient // v + (1 if i < seg_salient % v else 0) for i in range(v)]
    n_temp = (v + prm.p - 1) // prm.p
    temp = [seg_context // n_temp + (1 if i < seg_context % n_temp else 0) for i in range(n_temp)]
    context, t = [], 0
    for i in range(v):
        if i % prm.p == 0:
            context.append(min(temp[t], n // 2))
            if temp[t] + context[-1] > n:  # the release's (dead) adjustment, kept for the port's sake
                temp[t] = n - context[-1]
            t += 1
        else:
            context.append(0)
    context.reverse()
    out_s, out_c = [], []
    for j in range(v):  # only the last frame of each sub-segment keeps tokens
        out_s += [0] * (sub[j] - 1)
        out_c += [0] * (sub[j] - 1)
        if context[j] == 0:
            out_s.append(min(salient[j], n))
            out_c.append(0)
        else:
            out_c.append(min(context[j], n // 2))
            out_s.append(min(salient[j], n - out_c[-1]))
    return out_s, out_c


def density_peaks(x: torch.Tensor, k: int, generator: torch.Generator | None) -> torch.Tensor:
    """The release's density-peak selection of ``k`` of the rows of ``x`` [R, D]: indices, sorted."""
    x = x.float()[None]  # [1, R, D]
    dist = torch.cdist(x, x) / x.shape[-1] ** 0.5  # [1, R, R]
    nearest = torch.topk(dist, k=min(4, x.shape[1]), dim=-1, largest=False).values
    density = (-(nearest**2).mean(dim=-1)).exp()  # [1, R]
    noise = torch.rand(density.shape, generator=generator, device=density.device, dtype=density.dtype)
    density = density + noise * 1e-6
    mask = (density[:, None, :] > density[:, :, None]).float()
    dist_max = dist.flatten(1).max(dim=-1)[0][:, None, None]
    parent = (dist * mask + dist_max * (1 - mask)).min(dim=-1).values  # [1, R]
    return torch.topk(parent * density, k=k, dim=-1).indices[0].sort().values


def dtm_merge(tokens: torch.Tensor, keep: torch.Tensor, target: torch.Tensor, beta: float) -> torch.Tensor:
    """DTM: every token of ``tokens`` [M, d] not in ``keep`` goes to its most cosine-similar ``target``
    (indices into ``tokens``); a target becomes w x + (1 - w) mean(assigned), w = max(1 / (count + 1), beta).
    Returns the merged targets [C, d] fp32."""
    t = tokens.float()
    normed = t / t.norm(dim=-1, keepdim=True)
    is_kept = torch.zeros(t.shape[0], dtype=torch.bool, device=t.device)
    is_kept[keep] = True
    rest = (~is_kept).nonzero().squeeze(1)
    if rest.numel() == 0:
        return t[target]
    assign = torch.zeros(rest.numel(), target.numel(), device=t.device)  # [R, C] one-hot
    assign.scatter_(1, (normed[rest] @ normed[target].T).argmax(1, keepdim=True), 1)
    count = assign.sum(0).unsqueeze(-1)  # [C, 1]
    w = (1 / (count + 1)).clamp(min=beta)
    return w * t[target] + (1 - w) * (assign.T @ t[rest]) / count.clamp(min=1)


def select_video(
    video: torch.Tensor, attn: torch.Tensor, glob: torch.Tensor, prm: FastVIDParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """FastVID on one video: ``video`` [F, n, d] LLM-input tokens, ``attn`` [F, n] frame attention,
    ``glob`` [F, d] frame features. Returns (kept [K] flat indices into F n, ascending; tokens [K, d] fp32:
    salient tokens as they are, context tokens merged by DTM)."""
    n_frames, n, dim = video.shape
    glob = glob.float() / glob.float().norm(dim=1, keepdim=True)
    kept, rows, start = [], [], 0
    for seg_len in dyseg(glob, prm.c, prm.tau):
        n_sal, n_ctx = frame_counts(glob[start : start + seg_len], n, prm)
        seg = video[start : start + seg_len].reshape(seg_len * n, dim)  # [L n, d]
        salient, contexts = [], []
        for f in range(seg_len):
            top = torch.topk(attn[start + f], n_sal[f]).indices if n_sal[f] > 0 else None
            if top is not None:
                salient.append(top + f * n)
            if n_ctx[f] > 0:
                left = torch.arange(n, device=video.device)
                if top is not None:
                    left = left[~torch.isin(left, top)]
                contexts.append(left[density_peaks(video[start + f][left], n_ctx[f], generator)] + f * n)
        sal = torch.cat(salient) if salient else torch.zeros(0, dtype=torch.long, device=video.device)
        merged = [dtm_merge(seg, torch.cat([sal, ctx]), ctx, prm.beta) for ctx in contexts]
        idx = torch.cat([sal, *contexts])
        tok = torch.cat([seg[sal].float(), *merged])
        order = torch.argsort(idx)
        kept.append(idx[order] + start * n)
        rows.append(tok[order])
        start += seg_len
    return torch.cat(kept), torch.cat(rows)


# -- the release's LLaVA-OneVision variant -------------------------------------------------------------
def pooled_attention(weights: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``get_attn_2dPool``: the pooling head's attention [F, rows cols] -> bilinear to OneVision's pooled
    grid, ceil(rows / 2) x ceil(cols / 2): [F, T]."""
    grid = weights.reshape(weights.shape[0], 1, rows, cols)
    return F.interpolate(grid, size=[math.ceil(rows / 2), math.ceil(cols / 2)], mode="bilinear").flatten(1)


def _density_scores(x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """The release's parallel density-peak score of every row of ``x`` [F, R, d] (fp32): [F, R]."""
    dist = torch.cdist(x, x) / x.shape[-1] ** 0.5  # [F, R, R]
    nearest = torch.topk(dist, k=min(4, x.shape[1]), dim=-1, largest=False).values
    density = (-(nearest**2).mean(dim=-1)).exp()  # [F, R]
    density = density + torch.rand(density.shape, generator=generator, device=x.device, dtype=density.dtype) * 1e-6
    mask = (density[:, None, :] > density[:, :, None]).float()
    dist_max = dist.flatten(1).max(dim=-1)[0][:, None, None]
    return (dist * mask + dist_max * (1 - mask)).min(dim=-1).values * density


def _merge_into(pool: torch.Tensor, targets: torch.Tensor, beta: float) -> torch.Tensor:
    """DTM, batched: every row of ``pool`` [B, M, d] to its most cosine-similar row of ``targets`` [B, C, d];
    a target becomes w x + (1 - w) mean(assigned), w = max(1 / (count + 1), beta). [B, C, d]."""
    normed, tn = pool / pool.norm(dim=-1, keepdim=True), targets / targets.norm(dim=-1, keepdim=True)
    assign = torch.zeros(*pool.shape[:2], targets.shape[1], device=pool.device)  # [B, M, C]
    assign.scatter_(2, torch.bmm(normed, tn.transpose(1, 2)).argmax(dim=2, keepdim=True), 1)
    count = assign.sum(dim=1).unsqueeze(-1)  # [B, C, 1]
    w = (1 / (count + 1)).clamp(min=beta)
    return w * targets + (1 - w) * torch.bmm(assign.transpose(1, 2), pool) / count.clamp(min=1)


def select_video_ov(
    video: torch.Tensor, attn: torch.Tensor, glob: torch.Tensor, prm: FastVIDParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The OneVision variant on one video: ``video`` [F, T, d] pooled frame tokens, ``attn`` [F, T] pooled
    head attention, ``glob`` [F, D] head outputs. Returns (kept [K] flat indices into F T, ascending; tokens
    [K, d] fp32). ``ignore`` is not used (the Qwen variant's)."""
    n_frames, n, dim = video.shape
    x = video.float()
    sizes = dyseg(glob.float() / glob.float().norm(dim=1, keepdim=True), prm.c, prm.tau)
    retain = int(n * prm.retention_ratio)
    n_sal = retain - int(retain * prm.d)
    n_ctx = retain - n_sal
    ctx_per_frame = torch.zeros(n_frames, dtype=torch.long)
    offset = 0
    for seg_len in sizes:  # anchors: every p-th frame from the segment's end
        from_end = torch.arange(seg_len - 1, -1, -1)
        ctx_per_frame[offset : offset + seg_len][from_end % prm.p == 0] = n_ctx * seg_len // -(-seg_len // prm.p)
        offset += seg_len
    flat = torch.arange(n_frames * n, device=x.device).view(n_frames, n)
    sal = torch.topk(attn.float(), n_sal, dim=1).indices  # [F, S]
    kept, rows = [flat.gather(1, sal).flatten()], [x.gather(1, sal[..., None].expand(-1, -1, dim)).flatten(0, 1)]
    left = torch.ones(n_frames, n, dtype=torch.bool, device=x.device)
    left.scatter_(1, sal, False)
    rest = flat[left].view(n_frames, n - n_sal)  # [F, R] ascending per frame
    pool = x.flatten(0, 1)[rest.flatten()].view(n_frames, n - n_sal, dim)  # [F, R, d]
    if n_ctx > 0 and n - n_sal > 0:
        score = _density_scores(pool, generator)  # [F, R]
        pick = torch.topk(score, k=n_ctx, dim=-1).indices  # [F, C]
        single = ctx_per_frame.to(x.device) == n_ctx  # frames of one-frame segments
        targets = pool.gather(1, pick[..., None].expand(-1, -1, dim))
        kept.append(rest.gather(1, pick)[single].flatten())
        rows.append(_merge_into(pool, targets, prm.beta)[single].flatten(0, 1))
        start = 0
        for seg_len in sizes:
            seg = slice(start, start + seg_len)
            start += seg_len
            if seg_len == 1:
                continue
            anchors = (ctx_per_frame[seg] > n_ctx).to(x.device)
            k = min(int(ctx_per_frame[seg][-1]), n - n_sal)  # the release takes the segment's last frame's count
            pick = torch.topk(score[seg][anchors], k=k, dim=-1).indices  # [A, k]
            targets = pool[seg][anchors].gather(1, pick[..., None].expand(-1, -1, dim))
            seg_pool = pool[seg].reshape(1, -1, dim).expand(targets.shape[0], -1, -1)  # [A, L R, d]
            kept.append(rest[seg][anchors].gather(1, pick).flatten())
            rows.append(_merge_into(seg_pool, targets, prm.beta).flatten(0, 1))
    idx, tok = torch.cat(kept), torch.cat(rows)
    order = torch.argsort(idx)
    return idx[order], tok[order]
