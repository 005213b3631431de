"""OPERA's over-trust penalty in fp32 log space (the math, separate from the decoder's loop).

For a (renormalised) attention map restricted to the response part, OPERA's score of column j is
``phi_j = 1e-7 * prod_{i >= j} (scale * a_ij)``; the over-trust score is the max over columns and its
location. Everything here works with running column sums of ``log(scale * a)``, so hundreds of
factors never underflow and a candidate's score costs O(response length). The retrospection rule
(where a fired trigger rolls back to) is here too.
"""

from __future__ import annotations

import math

import torch

PHI_OFFSET = 1e-7  # phi_j = 1e-7 * prod(...), as released
MIN_LOCATION = 10  # no rollback to a location < 10
LOG_PHI_OFFSET = math.log(PHI_OFFSET)
_F32_MAX = torch.finfo(torch.float32).max


# --------------------------------------------------------------------------- over-trust scores


def column_log_scores(attn: torch.Tensor, scale: float) -> torch.Tensor:
    """Dense reference: ``log phi_j = log 1e-7 + sum_{i >= j} log(scale * a_ij)``.

    ``attn`` is [..., T, T] (rows = queries, lower triangle used); returns [..., T] in fp32.
    """
    t = attn.shape[-1]
    logs = torch.log(scale * attn.float())
    tri = torch.ones(t, t, dtype=torch.bool, device=attn.device).tril()
    return LOG_PHI_OFFSET + logs.masked_fill(~tri, 0.0).sum(-2)


def phi_from_log(log_phi: torch.Tensor, fp16_saturation: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Over-trust score and location from per-column log scores [..., T] -> (phi [...], loc [...]).

    fp32 (default): phi = exp(max_j log phi_j), clamped to the fp32 range; loc = the first argmax.
    ``fp16_saturation``: the released code's fp16 arithmetic: the column product is held in fp16 (a
    product above fp16's range, >= 65520 after rounding, is inf), ``1e-7 *`` that product is rounded to
    fp16 again (below 2^-25 it is 0), and the max / argmax run on that fp16 buffer (loc = the first
    maximal column, so with a saturated column the first inf).
    """
    if fp16_saturation:
        prod = torch.exp((log_phi - LOG_PHI_OFFSET).double()).to(torch.float16)  # [..., T] fp16 column products
        phi16 = (prod.float() * PHI_OFFSET).to(torch.float16)  # [..., T] the released fp16 score buffer
        best, loc = phi16.float().max(-1)
        return best, loc
    best, loc = log_phi.max(-1)
    return torch.exp(best).clamp(max=_F32_MAX), loc


class OverTrustHistory:
    """Per-beam running column log-sums of the response part of the attention map.

    ``col[k, j] = sum_{j <= i < t} log(scale * a_ij)`` over the t response rows seen so far (rows
    renormalised, max over heads). A candidate row ``c`` ([t+1], its own column last) then has
    ``log phi_j = log 1e-7 + col_j + log(scale * c_j)`` for j < t and ``log 1e-7 + log(scale * c_t)``.
    ``fp16_factors`` (OPERA's ``release`` preset): every factor is formed as the release forms it in
    fp16, ``fp16(scale * fp16(a))``, and the sums are kept in fp64 so that rounding the product to fp16
    afterwards (``phi_from_log(fp16_saturation=True)``) sees the exact product of those factors.
    """

    def __init__(self, n_beams: int, scale: float, device: torch.device, fp16_factors: bool = False) -> None:
        self.scale = float(scale)
        self.fp16 = fp16_factors
        self.col = torch.zeros(n_beams, 0, device=device, dtype=torch.float64 if fp16_factors else torch.float32)

    def _logs(self, rows: torch.Tensor) -> torch.Tensor:
        if self.fp16:
            factors = (self.scale * rows.to(torch.float16).float()).to(torch.float16)
            return torch.log(factors.double())
        return torch.log(self.scale * rows.float())

    @property
    def length(self) -> int:
        return int(self.col.shape[1])

    def nbytes(self) -> int:
        return self.col.numel() * self.col.element_size()

    def reorder(self, index: torch.Tensor) -> None:
        self.col = self.col[index]

    def append(self, row: torch.Tensor) -> None:
        """Add the newest response row ([K, t+1], renormalised, its own column last)."""
        logs = self._logs(row)
        self.col = torch.cat([self.col + logs[:, :-1], logs[:, -1:]], 1)

    def candidate_log_scores(self, rows: torch.Tensor) -> torch.Tensor:
        """log phi_j for candidate rows [K, N, t+1] -> [K, N, t+1]."""
        logs = self._logs(rows)
        return LOG_PHI_OFFSET + torch.cat([self.col[:, None, :] + logs[..., :-1], logs[..., -1:]], -1)

    def snapshot(self) -> torch.Tensor:
        return self.col.clone()

    def restore(self, snap: torch.Tensor) -> None:
        self.col = snap.clone()


def mode(x: torch.Tensor) -> torch.Tensor:
    """Most frequent value along the last dim, the smallest on ties (``torch.mode``'s CPU rule)."""
    v = x.sort(-1).values
    counts = (v[..., :, None] == v[..., None, :]).sum(-1)
    first = (counts == counts.max(-1, keepdim=True).values).int().argmax(-1)
    return v.gather(-1, first[..., None]).squeeze(-1)


def renormalised(rows: torch.Tensor) -> torch.Tensor:
    """Attention rows ([..., keys]) rescaled to sum to 1."""
    return rows / rows.sum(-1, keepdim=True).clamp_min(1e-30)


# --------------------------------------------------------------------------- retrospection


def rollback_target(
    locs: list[torch.Tensor], loc: int, step: int, counts: dict[int, int], oldest: int, threshold: int, limit: int
) -> int | None:
    """The response position to roll back to, or None (trigger not fired, or positions exhausted).

    ``locs``: per step, [K] over-trust location per beam slot; ``loc``: this step's; ``counts``: rollbacks
    per position so far (updated); ``oldest``: the oldest step kept for rollback; ``threshold``: r;
    ``limit``: rollbacks allowed per position (N_can).
    """
    hits = (torch.stack(locs, 1) == loc).sum(1)  # [K] per beam slot, as released (not reordered)
    if not bool((hits > threshold).all()) or loc < MIN_LOCATION:
        return None
    pos = loc + 1
    if counts.get(pos, 0) >= limit:
        pos = loc
        if counts.get(pos, 0) >= limit:
            return None
    pos = max(pos, oldest)  # older than the rollback window: the oldest kept step
    if pos >= step:  # nothing was chosen there yet (threshold <= 1 only)
        return None
    counts[pos] = counts.get(pos, 0) + 1
    return pos
