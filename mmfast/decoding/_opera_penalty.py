"""OPERA's over-trust penalty in fp32 log space (the math, separate from the decoder's loop).

For a (renormalised) attention map restricted to the response part, OPERA's score of column j is
``phi_j = 1e-7 * prod_{i >= j} (scale * a_ij)``; the over-trust score is the max over columns and its
location. Everything here works with running column sums of ``log(scale * a)``, so hundreds of
factors never underflow and a candidate's score costs O(response length).
"""

from __future__ import annotations

import math

import torch

LOG_PHI_OFFSET = math.log(1e-7)  # phi_j = 1e-7 * prod(...), as released
_FP16_MAX_LOG = math.log(65504.0)  # fp16 saturation of the released score buffer
_FP16_TINY_LOG = math.log(2.0**-24)
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
    ``fp16_saturation``: the released code's fp16 arithmetic, where a column product above 65504 is inf
    (phi = inf, loc = the first such column) and phi below fp16's range is 0.
    """
    if fp16_saturation:
        prod_log = log_phi - LOG_PHI_OFFSET
        sat = prod_log > _FP16_MAX_LOG
        log_phi = torch.where(sat, torch.full_like(log_phi, math.inf), log_phi)
        log_phi = torch.where(~sat & (log_phi < _FP16_TINY_LOG), torch.full_like(log_phi, -math.inf), log_phi)
        best, loc = log_phi.max(-1)
        return torch.exp(best), loc
    best, loc = log_phi.max(-1)
    return torch.exp(best).clamp(max=_F32_MAX), loc


class OverTrustHistory:
    """Per-beam running column log-sums of the response part of the attention map.

    ``col[k, j] = sum_{j <= i < t} log(scale * a_ij)`` over the t response rows seen so far (rows
    renormalised, max over heads). A candidate row ``c`` ([t+1], its own column last) then has
    ``log phi_j = log 1e-7 + col_j + log(scale * c_j)`` for j < t and ``log 1e-7 + log(scale * c_t)``.
    """

    def __init__(self, n_beams: int, scale: float, device: torch.device) -> None:
        self.scale = float(scale)
        self.col = torch.zeros(n_beams, 0, device=device)

    @property
    def length(self) -> int:
        return int(self.col.shape[1])

    def nbytes(self) -> int:
        return self.col.numel() * self.col.element_size()

    def reorder(self, index: torch.Tensor) -> None:
        self.col = self.col[index]

    def append(self, row: torch.Tensor) -> None:
        """Add the newest response row ([K, t+1], renormalised, its own column last)."""
        logs = torch.log(self.scale * row.float())
        self.col = torch.cat([self.col + logs[:, :-1], logs[:, -1:]], 1)

    def candidate_log_scores(self, rows: torch.Tensor) -> torch.Tensor:
        """log phi_j for candidate rows [K, N, t+1] -> [K, N, t+1]."""
        logs = torch.log(self.scale * rows.float())
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
