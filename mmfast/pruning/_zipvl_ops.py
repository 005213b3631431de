"""ZipVL's selection and sparse-attention steps as pure functions (the method: :mod:`.zipvl`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from .. import compat
from ..hooks.attention import pad_rows
from ._common import topk_keep


@functools.lru_cache(maxsize=4096)
def _drawn(n: int, recent_ratio: float, random_ratio: float, seeds: tuple[int, ...]) -> torch.Tensor:
    """[len(seeds), R] the probe draw of a sample with ``n`` valid slots, as indices among them, one row per
    seed: :func:`probe_rows`'s rule, which depends on ``n`` and the seed only (so drawn once per length)."""
    n_rec = min(n, max(1, int(recent_ratio * n)))
    n_rand = min(n - n_rec, int(random_ratio * n))
    recent = torch.arange(n - n_rec, n)
    out = []
    for seed in seeds:
        rand = recent[:0]
        if n_rand > 0:
            gen = torch.Generator().manual_seed(seed)
            rand = torch.randperm(n - n_rec, generator=gen)[:n_rand].sort().values
        out.append(torch.cat([rand, recent]))
    return torch.stack(out)


def probe_rows(valid: torch.Tensor, recent_ratio: float, random_ratio: float, seed: int) -> torch.Tensor:
    """[B, R] probe query slots (-1 = unused): the last ``max(1, int(recent_ratio n))`` valid slots plus
    ``int(random_ratio n)`` random earlier ones (n = valid slots of the sample).

    The draw depends only on the sample's own length and ``seed``, never on the rest of the batch.
    """
    return _rows(valid, recent_ratio, random_ratio, (seed,))[0].to(valid.device)


def layer_probe_rows(
    valid: torch.Tensor, n_layers: int, recent_ratio: float, random_ratio: float, seed: int
) -> torch.Tensor:
    """[n_layers, B, W] every layer's :func:`probe_rows` (layer ``i`` drawn with seed ``seed * 1_000_003 + i``),
    on the host from ``valid`` ([B, K] bool, read once), padded with -1 to a multiple of
    :data:`~mmfast.hooks.attention.ROW_PAD` rows (unused rows add exact zeros: :func:`accumulate_scores`), so
    that prompts of similar lengths give one width."""
    return pad_rows(_rows(valid, recent_ratio, random_ratio, tuple(seed * 1_000_003 + i for i in range(n_layers))))


def _rows(valid: torch.Tensor, recent_ratio: float, random_ratio: float, seeds: tuple[int, ...]) -> torch.Tensor:
    """[len(seeds), B, W] long on the host: each seed's draw for every sample of ``valid`` ([B, K], read once),
    padded with -1 to the widest sample. A few ops per sample: the draw of a length is made once (:func:`_drawn`)."""
    host = valid.cpu()
    per = []
    for b in range(host.shape[0]):
        pos = host[b].nonzero().squeeze(1)  # [n] the sample's valid slots
        per.append(pos[_drawn(pos.numel(), recent_ratio, random_ratio, seeds)])  # [L, R_b]
    width = max(r.shape[1] for r in per)
    return torch.stack([torch.nn.functional.pad(r, (0, width - r.shape[1]), value=-1) for r in per], 1)


def accumulate_scores(
    probs: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accumulated and causally normalised scores.

    Args:
        probs: [B, R, K] probe attention (head-averaged; unused rows all zero).
        rows: [B, R] slot index of each probe query (-1 = unused).
        valid: [B, K] key slots holding real tokens.

    Returns:
        a [B, K] = sum_i A'_ij, and a~ [B, K] = a_j / #(probe queries i with slot_i >= j).
    """
    k = probs.shape[-1]
    a = probs.float().sum(1) * valid
    j = torch.arange(k, device=probs.device)
    sees = (rows[:, :, None] >= j[None, None, :]) & (rows[:, :, None] >= 0)  # [B, R, K]
    count = sees.sum(1)
    norm = torch.where(valid & (count > 0), a / count.clamp(min=1), torch.zeros_like(a))
    return a, norm


def mass_count(scores: torch.Tensor, valid: torch.Tensor, tau: float) -> torch.Tensor:
    """[B] smallest p whose top-p scores reach ``tau`` x the total score of the valid slots (>= 1)."""
    s = scores.float().masked_fill(~valid, 0.0).sort(dim=1, descending=True).values
    cum = s.cumsum(1)
    total = cum[:, -1:]
    p = (cum < tau * total).sum(1) + 1
    return torch.minimum(p, valid.sum(1)).clamp(min=1)


def select_important(
    probs: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor, tau: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """ZipVL's important set: p from the raw accumulated mass, T = top-p by the normalised score.

    Returns (keep [B, K] bool, p [B]).
    """
    if tau >= 1.0:
        return valid.clone(), valid.sum(1)
    a, norm = accumulate_scores(probs, rows, valid)
    p = mass_count(a, valid, tau)
    return topk_keep(norm, valid, p), p


def with_generating_row(keep: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``keep`` [B, K] plus each sample's last valid slot: the row whose output predicts the first answer token.

    Skipping its attention (U rows get output 0) would predict the first token from a residual stream that
    attended to nothing in that layer (issue 29: "inNo" at tight tau on the embedded model).
    """
    slots = torch.arange(valid.shape[1], device=valid.device)  # [K]
    last = (valid.long() * (slots + 1)).argmax(1, keepdim=True)  # [B, 1] last valid slot
    return keep | ((slots[None, :] == last) & valid.any(1, keepdim=True))  # no advanced index: capturable


def key_validity(attention_mask: torch.Tensor | None, bsz: int, k_len: int, device) -> torch.Tensor:
    """[B, K] key slots visible to the last query row (prefill: the real tokens)."""
    if attention_mask is None:
        return torch.ones(bsz, k_len, dtype=torch.bool, device=device)
    m = attention_mask[:, 0, -1, :k_len]
    if m.dtype != torch.bool:
        m = m > torch.finfo(m.dtype).min / 2
    return m.expand(bsz, -1).clone() if m.shape[0] != bsz else m.clone()


def sparse_attention(
    module, query, key, value, keep, scaling, base, dropout: float = 0.0, width: int | None = None, **kwargs
) -> torch.Tensor:
    """Attention among the ``keep`` slots only ([B, L] bool; query, key, value: [B, H(kv), L, D], q_len == k_len).

    The kept slots of each sample are gathered (left-padded to the batch maximum), attend causally to
    each other through the base implementation, and are scattered back; other rows are 0. ``width``: the
    largest kept count when the caller has it on the host (else read here).
    Returns [B, L, H, D], the layout attention functions return.
    """
    bsz, heads, length, dim = query.shape
    counts = keep.sum(1)
    p = max(int(counts.max()) if width is None else width, 1)
    dev = keep.device
    # left-padded gather index: kept slot -> position (p - count + rank); others -> dump column p
    rank = keep.long().cumsum(1) - 1 + (p - counts)[:, None]
    target = rank.masked_fill(~keep, p)
    idx = torch.zeros(bsz, p + 1, dtype=torch.long, device=dev)
    idx.scatter_(1, target, torch.arange(length, device=dev).expand(bsz, -1))
    idx = idx[:, :p]
    valid = torch.arange(p, device=dev)[None, :] >= (p - counts)[:, None]  # [B, P]

    def gather(t: torch.Tensor) -> torch.Tensor:
        return t.gather(2, idx[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[-1]))

    causal = torch.ones(p, p, dtype=torch.bool, device=dev).tril()
    eye = torch.eye(p, dtype=torch.bool, device=dev)
    mask = (causal[None] & valid[:, None, :]) | eye  # padded rows see themselves (no NaN)
    mask = compat.format_mask(mask[:, None], module.config._attn_implementation, query.dtype)
    out_g, _ = base(module, gather(query), gather(key), gather(value), mask, scaling=scaling, dropout=dropout, **kwargs)
    out = out_g.new_zeros(bsz, length + 1, *out_g.shape[2:])
    dest = idx.masked_fill(~valid, length)[:, :, None, None].expand(-1, -1, *out_g.shape[2:])
    out.scatter_(1, dest, out_g)
    return out[:, :length]


def masked_sparse_attention(
    module, query, key, value, keep, scaling, base, dropout: float = 0.0, **kwargs
) -> torch.Tensor:
    """:func:`sparse_attention` in fixed shapes (a captured prefill: no count read to the host): every slot is
    a query row, a row in ``keep`` ([B, L] bool) attends causally to the ``keep`` slots, the others get output
    0. The same attention set as the gathered form, over all L slots instead of the widest kept count.
    Returns [B, L, H, D]."""
    length = query.shape[2]
    dev = keep.device
    causal = torch.ones(length, length, dtype=torch.bool, device=dev).tril()  # [L, L]
    eye = torch.eye(length, dtype=torch.bool, device=dev)
    mask = (causal[None] & keep[:, None, :]) | eye  # [B, L, L]; dropped rows see themselves (no NaN), then 0
    mask = compat.format_mask(mask[:, None], module.config._attn_implementation, query.dtype)
    out, _ = base(module, query, key, value, mask, scaling=scaling, dropout=dropout, **kwargs)  # [B, L, H, D]
    return out.masked_fill(~keep[:, :, None, None], 0.0)


# --------------------------------------------------------------------------- per-forward records


@dataclass
class LayerSelection:
    keep: torch.Tensor  # [B, L] important slots
    valid: torch.Tensor  # [B, L] real tokens
    p: torch.Tensor  # [B]


@dataclass
class Scratch:
    """Per-forward data of one state: prefill selections per layer, the last decode query per layer."""

    prefill: dict[int, LayerSelection] = field(default_factory=dict)
    last_query: dict[int, tuple[torch.Tensor, float]] = field(default_factory=dict)
    #: every layer's probe rows of this prefill, drawn from its key validity read once: (mask key, [L, B, W])
    rows: tuple[tuple, torch.Tensor] | None = None

    def left_by(self, layer: int) -> tuple[LayerSelection | None, tuple[torch.Tensor, float] | None]:
        """What layer ``layer``'s attention left here in this forward (a captured graph's record of it)."""
        return self.prefill.get(layer), self.last_query.get(layer)

    def put(self, layer: int, got: tuple[LayerSelection | None, tuple[torch.Tensor, float] | None]) -> None:
        sel, query = got
        if sel is not None:
            self.prefill[layer] = sel
        if query is not None:
            self.last_query[layer] = query
