"""ToMe (Bolya et al., "Token Merging: Your ViT But Faster", ICLR 2023, arXiv 2210.09461; code
facebookresearch/ToMe), applied inside the CLIP vision tower of a VLM.

Algorithm (every CLIP block up to the feature layer, between the attention and the MLP):
1. Metric = the block's attention keys averaged over heads; alternate tokens into sets A (even) and
   B (odd); each A token links to its most cosine-similar B token (CLS, A[0], never links).
2. Keep the r most similar edges; each chosen A token is merged into its B token by a size-weighted
   average (sizes start at 1 and add up); output: unmerged A tokens in order, then the B tokens.
3. Proportional attention: every later block adds log(size) of each key to the attention logits.
4. r per block: the token count reaches the budget T exactly at the feature layer
   (``adapter.vision_feature_layer_index()``): N - T merges spread over its F+1 blocks (the first
   (N - T) mod (F+1) blocks merge one more), at most 50% of a block's tokens (ToMe's cap; where the
   cap forbids the even spread, shallow towers, earlier blocks merge just enough more).
5. LLaVA-1.5 (N = 576, F + 1 = 23 blocks): T = 192 / 128 / 64 gives r = 16-17 / 19-20 / 22-23.
Or ``r`` merges r tokens in every block up to the feature layer (ToMe's constant schedule).
Budget (``budget: {tokens: B}``, vision tokens per image at the LLM input; sets ``budget``, ``r`` must
not be given): budget = B, reached exactly (an unreachable B fails at install with the reachable count).

Hook points: an instance ``forward`` on each merging CLIP encoder layer, set through
``session.hooks.set_attr`` (hook kind #3: the merge sits between the attention and the MLP of the
same block, where no module boundary exists, so neither a forward hook nor a pre-hook can reach it;
the replacement computes exactly what transformers' ``CLIPEncoderLayer.forward`` computes, plus the
merge); a recorder on each merging block's attention for the keys, and an attention override that
adds log(size) as an additive mask (no eager attention); a pre-hook on vision layer 0 resets the
per-forward state. ``prune_vision`` fixes ``patch_ids`` (-1 for merged tokens).

Positions: the T tokens (ToMe's order: unmerged then merged, not spatial) are spliced contiguously.
Limits and deviations: no proportional attention or merging inside the LLM (ToMe issue #38: only in
the ViT); blocks after the feature layer do not merge (their output is unused by LLaVA) but keep the
proportional attention; the merge is computed in fp32; the vision tower must get no attention mask.

Qwen-VL families (qwen2_vl, qwen2_5_vl, qwen3_vl): refused: merges patches inside a CLIP
tower; Qwen-VL towers attend per image / per window (cu_seqlens) with 2-D rotary patch positions and
their PatchMerger needs every 2x2 unit intact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..capabilities import Capabilities, Need
from ..config import opt
from ..errors import ConfigError
from ..hooks import attach
from ..registry import PRUNERS
from .base import Pruner


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


@dataclass
class _TowerMerge:
    """What ToMe's tower hooks leave for one tower call."""

    ids: torch.Tensor  # [n_img, T] source patch of each token (-1: CLS)
    size: torch.Tensor  # [n_img, T, 1] tokens merged into each
    r: list[int]  # tokens merged per block


@PRUNERS.register(
    "tome", description="ToMe: bipartite token merging inside the CLIP blocks, with proportional attention"
)
class ToMe(Pruner):
    """ToMe."""

    hook_points = frozenset({"vision_tower"})
    caps = Capabilities(
        needs=frozenset({Need.UNTILED, Need.SQUARE_GRID, Need.GLOBAL_TOWER_ATTENTION}),
        why={
            Need.UNTILED: "it merges inside the tower over one square patch grid per image",
            Need.SQUARE_GRID: "it merges patches inside a CLIP-style tower; dynamic-resolution towers attend per "
            "image / per window with 2-D rotary patch positions and their patch merger needs every 2x2 unit intact",
            Need.GLOBAL_TOWER_ATTENTION: "a merged token would straddle the tower's attention windows",
        },
        merges_in_tower=True,
        needs_full_grid=True,
    )

    @dataclass(frozen=True)
    class Config:
        budget: int = opt(64, lo=1, doc="T: patch tokens left at the feature layer (standard: 192, 128, 64)")
        r: int | None = opt(None, lo=0, doc="tokens merged in every block up to the feature layer (overrides budget)")
        prop_attn: bool = opt(True, doc="proportional attention: add log(size) to the attention logits")

    budget_knobs = ("budget", "r")

    @classmethod
    def noop_params(cls, adapter):
        return {"r": 0}

    @classmethod
    def budget_params(cls, tokens, n, adapter, config, path):
        """budget = B."""
        return {"budget": tokens}

    @classmethod
    def test_params(cls, adapter):
        rows, cols = adapter.grid
        return {"budget": rows * cols // 2}

    def schedule(self) -> list[int]:
        """r of each block 0 .. feature layer."""
        rows, cols = self.adapter.grid
        n_blocks = self.adapter.vision_feature_layer_index() + 1
        if self.config.r is not None:
            return [self.config.r] * n_blocks
        try:
            return merge_schedule(rows * cols, n_blocks, self.config.budget, int(self.adapter.has_cls))
        except ValueError as exc:
            raise ConfigError("budget", str(exc)) from None

    def install(self) -> None:
        self.r_schedule = self.schedule()
        self._size: torch.Tensor | None = None
        self._ids: torch.Tensor | None = None
        self._metric: torch.Tensor | None = None
        self._merged: list[int] = []
        if not any(self.r_schedule):
            return  # r = 0 everywhere: the tower runs untouched
        hooks = self.ctx.hooks
        layers = self.adapter.vision_layers
        for part in ("layer_norm1", "self_attn", "layer_norm2", "mlp"):
            if not hasattr(layers[0], part):
                raise ConfigError(
                    "",
                    f"the vision encoder layer {type(layers[0]).__name__} has no {part!r}; ToMe supports CLIP-style layers",
                )
        hooks.pre_hook(layers[0], self._reset)
        first = next(i for i, r in enumerate(self.r_schedule) if r > 0)
        for i, layer in enumerate(layers):
            attn_hooks = attach(hooks, layer.self_attn)
            if i < len(self.r_schedule) and self.r_schedule[i] > 0:
                attn_hooks.recorders.append(self._record_metric)
                hooks.set_attr(layer, "forward", self._make_forward(layer, self.r_schedule[i]))
            if self.config.prop_attn and i > first:
                if attn_hooks.override is not None:
                    raise ConfigError("", f"vision layer {i}'s attention is already overridden by another stage")
                attn_hooks.override = self._proportional_attention

    # -- per-forward state -------------------------------------------------------------------------
    def _reset(self, module, args) -> None:
        hidden = args[0]
        bsz, t = hidden.shape[:2]
        self._size = None
        ids = torch.arange(t, device=hidden.device) - int(self.adapter.has_cls)  # CLS -> -1, patches 0..N-1
        self._ids = ids.expand(bsz, -1)
        self._merged = []

    def _record_metric(self, module, query, key, attention_mask, scaling) -> None:
        self._metric = key.mean(1)  # [B, T, head_dim]: keys averaged over heads

    def _proportional_attention(self, module, query, key, value, attention_mask, scaling, base, **kwargs):
        size = self._size
        if size is not None and size.shape[1] == key.shape[2]:
            attention_mask = proportional_bias(size, attention_mask, query.dtype)
        return base(module, query, key, value, attention_mask, scaling=scaling, **kwargs)[0]

    def _make_forward(self, layer, r: int):
        def forward(hidden_states, attention_mask=None, **kwargs):
            if attention_mask is not None:
                raise RuntimeError("ToMe: the vision tower received an attention mask, which merging would invalidate")
            residual = hidden_states
            hidden = layer.layer_norm1(hidden_states)
            hidden, _ = layer.self_attn(hidden_states=hidden, attention_mask=attention_mask, **kwargs)
            hidden = residual + hidden
            hidden = self._merge(hidden, r)
            residual = hidden
            hidden = layer.mlp(layer.layer_norm2(hidden))
            return residual + hidden

        return forward

    def _merge(self, hidden: torch.Tensor, r: int) -> torch.Tensor:
        size = self._size if self._size is not None else hidden.new_ones(*hidden.shape[:2], 1, dtype=torch.float32)
        hidden, size, self._ids, done = bipartite_merge(hidden, self._metric, size, self._ids, r, self.adapter.has_cls)
        self._size = size
        self._merged.append(done)
        return hidden

    # -- feature stage -----------------------------------------------------------------------------
    def observe_tower(self, vision) -> None:
        """Right after the tower: the merge's provenance and sizes move into ``vision`` (the hooks'
        per-forward scratch is cleared, so nothing about this batch stays on the stage)."""
        if not any(self.r_schedule):
            return
        if self._ids is None or self._size is None:
            raise RuntimeError("ToMe: the vision tower did not run with ToMe's hooks")
        vision.extras["tome.merge"] = _TowerMerge(self._ids, self._size, list(self._merged))
        self._ids = self._size = self._metric = None
        self._merged = []

    def prune_vision(self, vision, batch):
        if not any(self.r_schedule):
            return vision
        merge: _TowerMerge | None = vision.extras.get("tome.merge")
        if merge is None:
            raise RuntimeError("ToMe: the vision tower did not run with ToMe's hooks")
        ids = merge.ids.masked_fill(merge.size[..., 0] > 1, -1)  # [n_img, T] -1: merged (or CLS)
        sizes = merge.size[..., 0]
        t = ids.shape[1]
        patch_ids, token_sizes = [], []
        for i, feats in enumerate(vision.features):
            n = feats.shape[0]
            if n not in (t, t - 1) or vision.projected[i] is not None:
                raise ValueError(
                    f"ToMe expected {t - 1} patch tokens for image {i} but got {n}; put ToMe first among the feature stages"
                )
            patch_ids.append(ids[i, t - n :].to(vision.patch_ids[i].device))
            token_sizes.append(sizes[i, t - n :])
        vision.patch_ids = patch_ids
        vision.extras["tome.size"] = token_sizes
        per_sample = [0] * batch.batch_size
        for i, owner in enumerate(batch.image_owner):
            per_sample[owner] += int(vision.features[i].shape[0])
        vision.stats[self.name] = {"r": merge.r, "per_sample_tokens": per_sample}
        return vision
