"""ToMe's image merge inside the tower (``tome.py``): one bipartite soft matching step, the proportional
attention bias, and the per-block merge schedule."""

from __future__ import annotations

import torch


def bipartite_merge(
    x: torch.Tensor,
    metric: torch.Tensor,
    size: torch.Tensor,
    ids: torch.Tensor,
    r: int,
    protect_first: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """One ToMe bipartite soft matching step.

    Args:
        x: [B, T, D] tokens. metric: [B, T, C] similarity features (keys averaged over heads).
        size: [B, T, 1] fp32 token sizes. ids: [B, T] long provenance carried along (any values).
        r: tokens to remove; capped at half of the unprotected tokens.
        protect_first: token 0 (CLS) never merges.

    Returns (x [B, T-r, D] in x's dtype, size [B, T-r, 1], ids [B, T-r], r actually removed). Order:
    unmerged A tokens (even positions, ascending), then every B token (odd positions).
    """
    t = x.shape[1]
    r = min(r, (t - int(protect_first)) // 2)
    if r <= 0:
        return x, size, ids, 0
    bsz, _, d = x.shape
    m = metric.float()
    m = m / m.norm(dim=-1, keepdim=True)
    scores = m[:, ::2] @ m[:, 1::2].transpose(-1, -2)  # [B, Ta, Tb]
    if protect_first:
        scores[:, 0, :] = float("-inf")
    best, dst_of = scores.max(dim=-1)  # [B, Ta] best match of each A token
    order = best.argsort(dim=-1, descending=True, stable=True)
    src = order[:, :r]  # [B, r] A tokens that merge
    unm = order[:, r:].sort(dim=-1).values  # [B, Ta - r] A tokens that stay, in order
    dst = dst_of.gather(1, src)  # [B, r] their B partners
    weighted = x.float() * size
    a, b = weighted[:, ::2], weighted[:, 1::2]
    sa, sb = size[:, ::2], size[:, 1::2]
    b = b.scatter_add(1, dst[..., None].expand(-1, -1, d), a.gather(1, src[..., None].expand(-1, -1, d)))
    sb = sb.scatter_add(1, dst[..., None], sa.gather(1, src[..., None]))
    out_w = torch.cat([a.gather(1, unm[..., None].expand(-1, -1, d)), b], dim=1)
    out_s = torch.cat([sa.gather(1, unm[..., None]), sb], dim=1)
    out_ids = torch.cat([ids[:, ::2].gather(1, unm), ids[:, 1::2]], dim=1)
    return (out_w / out_s).to(x.dtype), out_s, out_ids, r


def proportional_bias(size: torch.Tensor, attention_mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Additive attention mask [B, 1, Q|1, K] adding log(size) of each key to the logits (combined with ``attention_mask``)."""
    bias = size[..., 0].log().to(dtype)[:, None, None, :]  # [B, 1, 1, K]
    if attention_mask is None:
        return bias
    if attention_mask.dtype == torch.bool:
        return torch.where(attention_mask, bias, torch.finfo(dtype).min)
    return attention_mask + bias


def merge_schedule(n_patches: int, n_blocks: int, budget: int, protected: int = 1) -> list[int]:
    """Per-block r so that ``n_patches`` become ``budget`` after ``n_blocks`` blocks (ToMe's 50% cap per block).

    The N - T merges are spread evenly, the first blocks taking one more; where the cap would then
    leave too few tokens for the later blocks (shallow towers, small budgets), a block takes just
    enough more for the rest to stay feasible. Raises ValueError when the budget is unreachable.
    """

    def capacity(tokens: int, blocks: int) -> int:  # most merges ``blocks`` blocks can make
        total = 0
        for _ in range(blocks):
            r = (tokens - protected) // 2
            total, tokens = total + r, tokens - r
        return total

    remaining, tokens, out = max(0, n_patches - budget), n_patches + protected, []
    if remaining > capacity(tokens, n_blocks):
        best = capacity(tokens, n_blocks)
        raise ValueError(
            f"{n_patches} patches cannot reach {budget} tokens in {n_blocks} blocks merging at most half of "
            f"the tokens per block (at most {best} merges, i.e. {n_patches - best} tokens)"
        )
    for i in range(n_blocks):
        cap = (tokens - protected) // 2
        r = min(-(-remaining // (n_blocks - i)), cap)
        while remaining - r > capacity(tokens - r, n_blocks - i - 1):
            r += 1
        out.append(r)
        remaining -= r
        tokens -= r
    return out
