"""ToMe's temporal merge of one video's frame tokens (``tome.py``, "Video"): the pair merge, the merge
schedule over the steps, and the whole merge.

A *segment* is a run of consecutive frames' tokens (at first one frame). Each step pairs segments
(0, 1), (2, 3), ...: the later segment's tokens are ToMe's set A (sources), the earlier one's set B
(destinations); each source links to its most cosine-similar destination; the r_j best edges of pair
j merge by a size-weighted average (ToMe's ``bipartite_soft_matching`` + ``merge_wavg``), and the pair
becomes one segment. Every token carries its *representative*: the row (frame-major) of the original
token whose place it keeps; a destination keeps its own, so a merged token keeps the earliest of its
members (the destination side is always the earlier segment).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class Segment:
    """Tokens of consecutive frames, in representative order."""

    x: torch.Tensor  # [n, D] fp32 values (the first ``metric_dim`` columns are the metric)
    size: torch.Tensor  # [n] fp32 original tokens merged into each
    rep: torch.Tensor  # [n] long representative row (frame-major index of the video's frame tokens)


def pair_merge(dst: Segment, src: Segment, r: int, metric_dim: int) -> tuple[Segment, torch.Tensor, torch.Tensor]:
    """Merge ``r`` of ``src``'s tokens into ``dst`` (ToMe's bipartite rule, A = ``src``, B = ``dst``).

    Returns (the pair as one segment in representative order, the merged sources' representatives
    [r], their destinations' representatives [r])."""
    r = min(r, src.x.shape[0])
    a = src.x[:, :metric_dim]
    b = dst.x[:, :metric_dim]
    a = a / a.norm(dim=-1, keepdim=True)
    b = b / b.norm(dim=-1, keepdim=True)
    best, dst_of = (a @ b.T).max(dim=-1)  # [n_src] each source's most similar destination
    order = best.argsort(descending=True, stable=True)
    merged, kept = order[:r], order[r:]  # [r], [n_src - r]
    to = dst_of[merged]  # [r]
    weighted = (dst.x * dst.size[:, None]).index_add(0, to, src.x[merged] * src.size[merged, None])  # [n_dst, D]
    size = dst.size.index_add(0, to, src.size[merged])  # [n_dst]
    x = torch.cat([weighted / size[:, None], src.x[kept]])
    size = torch.cat([size, src.size[kept]])
    rep = torch.cat([dst.rep, src.rep[kept]])
    perm = rep.argsort()
    return Segment(x[perm], size[perm], rep[perm]), src.rep[merged], dst.rep[to]


def _spread(total: int, caps: list[int]) -> list[int]:
    """``total`` merges over pairs with capacities ``caps``: as even as the caps allow, earlier pairs
    one more (water filling)."""
    out = [0] * len(caps)
    left = total
    while left > 0:
        open_ = [j for j, c in enumerate(caps) if out[j] < c]
        if not open_:
            raise ValueError(f"{total} merges exceed the step's capacity {sum(caps)}")
        share = max(1, left // len(open_))
        for j in open_:
            take = min(share, caps[j] - out[j], left)
            out[j] += take
            left -= take
            if left == 0:
                break
    return out


def _after(lengths: list[int], rs: list[int]) -> list[int]:
    """Segment lengths after a step merging ``rs[j]`` in pair j."""
    out = [lengths[2 * j] + lengths[2 * j + 1] - r for j, r in enumerate(rs)]
    return out + lengths[2 * len(rs) :]


def n_steps(n_frames: int) -> int:
    """Steps until one segment is left: ceil(log2 F)."""
    return math.ceil(math.log2(n_frames)) if n_frames > 1 else 0


def video_schedule(n_frames: int, per_frame: int, *, keep: int | None = None, r: int | None = None) -> list[list[int]]:
    """r of every pair at every step, for F = ``n_frames`` frames of T = ``per_frame`` tokens.

    ``r``: ToMe's constant schedule, r merges per step (spread over the step's pairs, capped by what
    the step can merge). ``keep``: F T - keep merges spread evenly over the ceil(log2 F) steps (the
    first steps one more), a step taking more where the rest could not finish otherwise; at most
    (F - 1) T merges (one frame's worth of tokens is left), else ValueError."""
    lengths = [per_frame] * n_frames
    steps = n_steps(n_frames)
    plan = []
    if r is not None:
        for _ in range(steps):
            caps = lengths[1::2][: len(lengths) // 2]
            rs = _spread(min(r, sum(caps)), caps)
            plan.append(rs)
            lengths = _after(lengths, rs)
        return plan
    assert keep is not None
    remaining = max(0, n_frames * per_frame - keep)
    most = (n_frames - 1) * per_frame
    if remaining > most:
        raise ValueError(
            f"a video of {n_frames} frame(s) x {per_frame} tokens cannot be merged to {keep} tokens: adjacent-frame "
            f"merging leaves at least one frame's worth ({per_frame} tokens)"
        )
    for s in range(steps):
        caps = lengths[1::2][: len(lengths) // 2]
        total = min(-(-remaining // (steps - s)), sum(caps))
        while True:
            rs = _spread(total, caps)
            nxt = _after(lengths, rs)
            if remaining - total <= sum(nxt) - nxt[0] or total >= sum(caps):  # the rest can still finish
                break
            total += 1
        plan.append(rs)
        lengths = nxt
        remaining -= total
    return plan


def temporal_merge(frames: torch.Tensor, plan: list[list[int]], metric_dim: int) -> tuple[Segment, list[int]]:
    """Run ``plan`` (:func:`video_schedule`) on one video's frame tokens ``frames`` [F, T, D] (fp32; the
    first ``metric_dim`` columns are the metric). Returns the merged tokens (one segment, in
    representative order) and the merges made per step."""
    n_frames, per = frames.shape[:2]
    segs = [
        Segment(
            frames[f],
            frames.new_ones(per),
            torch.arange(f * per, (f + 1) * per, device=frames.device),
        )
        for f in range(n_frames)
    ]
    done = []
    for rs in plan:
        nxt = [pair_merge(segs[2 * j], segs[2 * j + 1], r, metric_dim)[0] for j, r in enumerate(rs)]
        segs = nxt + segs[2 * len(rs) :]
        done.append(sum(rs))
    if len(segs) > 1:  # an empty plan (one frame, or r = 0 on every step)
        x = torch.cat([s.x for s in segs])
        segs = [Segment(x, torch.cat([s.size for s in segs]), torch.cat([s.rep for s in segs]))]
    return segs[0], done
