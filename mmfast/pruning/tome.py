"""ToMe (Bolya et al., "Token Merging: Your ViT But Faster", ICLR 2023, arXiv 2210.09461; code
facebookresearch/ToMe), applied inside the CLIP vision tower of a VLM to images, and across frames on a
video's LLM-input tokens ("Video" below).

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
per-forward state. Their work depends on shapes only (the schedule is fixed), so the tower with its merges
runs as one captured graph where the session captures (``CapturedTower``; ~1,700 ops launched one by one
otherwise at LLaVA-1.5's depth): each hook carries the merge's provenance and sizes across a replay
(``hooks.attention.Carried``). ``prune_vision`` fixes ``patch_ids`` (-1 for merged tokens). Videos:
``vision_features`` only (``prune_vision`` on the adapter's ``project`` output). Helpers:
``_tome_ops.py`` (image merge step, bias, schedule), ``_tome_video.py`` (temporal merge).

Positions: the T tokens (ToMe's order: unmerged then merged, not spatial) are spliced contiguously.
Limits and deviations: no proportional attention or merging inside the LLM (ToMe issue #38: only in
the ViT); blocks after the feature layer do not merge (their output is unused by LLaVA) but keep the
proportional attention; the merge is computed in fp32; the vision tower must get no attention mask.

Images on Qwen-VL (qwen2_vl, qwen2_5_vl, qwen3_vl) and LLaVA-OneVision: refused (before compute):
Qwen-VL towers attend per image / per window (cu_seqlens) with 2-D rotary patch positions and their
PatchMerger needs every 2x2 unit intact; OneVision re-packs each image's tiles after the projector.

Video (temporal merge; Qwen2-VL, Qwen2.5-VL, LLaVA-OneVision: a video is one vision item; Qwen3-VL:
every frame group is its own item, joined into one per video by the session for the merge, ``video_join``,
:mod:`mmfast.pruning._video_items`).
Sources: ToMe's ``tome/merge.py`` (``bipartite_soft_matching``, ``merge_wavg``; facebookresearch/ToMe
@af95e4b), its paper's video experiments (ToMe on the spatiotemporal tokens of a video MAE ViT-L), and
the temporal variants video LLM work uses (VidToMe, Li et al. 2023: each frame's tokens merge into
their most similar tokens of another frame of the chunk by bipartite soft matching; TESTA, Ren et al.
2023: temporal aggregation by bipartite matching of neighbouring frames; DyCoke's TTM pairs adjacent
frames the same way). Where: on a video's LLM-input tokens (a feature stage), because neither tower
lets a token span frames: Qwen's tower attends within each temporal patch group (cu_seqlens per
frame group, 2-D rotary, then the 2x2 PatchMerger), and OneVision runs SigLIP on each frame and pools
2x2 after the projector. Algorithm, per video (frames: Qwen's temporal patch groups, OneVision's frames;
F frames of T tokens):
1. Segments are frames. Each step pairs segments (0, 1), (2, 3), ...: the later segment is ToMe's set A
   (sources), the earlier one set B (destinations); each source links to its most cosine-similar
   destination; the pair's r_j best edges merge, size-weighted (``merge_wavg``: sizes start at 1 and
   add up); the pair becomes one segment (an odd last segment waits). After ceil(log2 F) steps one
   segment is left: merges reach ever further in time, as ToMe's later blocks merge merged tokens.
   For two equal segments interleaved (A at the even rows) this is ``bipartite_soft_matching`` with
   r = r_j exactly, up to the output order (here the representatives'; ``tests/test_tome_video.py``
   checks it against a port of the official function, step by step).
2. Metric: the tokens themselves (cosine of the merged, projected tokens; ToMe uses the attention
   keys, which exist only inside the tower; its paper ablates the token features as metric too).
3. r per step: ``budget`` B (tokens kept per video): F T - (B - non-frame tokens) merges spread evenly
   over the steps (earlier steps one more; a step takes more where the rest could not finish), each
   step's merges spread evenly over its pairs, capped at the source segment (ToMe's 50% cap); B may go
   down to one frame's worth (T, + OneVision's newline), a lower B is refused (ConfigError, naming T).
   ``r``: r merges per step (ToMe's constant schedule), capped likewise.
4. Positions: a merged token keeps its representative's place: the destination's (the earliest of its
   members; Qwen: that cell's (t, h, w) ids and ``frame`` tag; OneVision: contiguous 1-D positions).
   Tokens stay in their representatives' frame-major order (ToMe's unmerged-then-merged order is
   not temporal; the LLM is causal). OneVision's closing newline is no frame token: kept, counted in B.
   Qwen's pre-merger features merge with the same weights (they stay row-aligned).
Deviations: no proportional attention (the next blocks are the LLM's: ToMe issue #38); merges in fp32;
equal edge scores keep their order (a stable sort; the official ``argsort`` is unstable);
the pair split (later frame into earlier one) replaces ToMe's alternate-token split, so a token merges
only with a neighbouring segment. Qwen3-VL: every token goes back to its representative's frame group
(its own timestamp span, its (t, h, w) ids; a group merged away keeps an empty span), and a budget B
counts the whole video. Refused: images where the tower merge cannot run (above).
No-op: ``r: 0``, or B >= the video's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..capabilities import Capabilities, Need, caps_of, videos_only_on
from ..config import opt
from ..errors import ConfigError, IncompatibleRecipeError
from ..hooks import attach
from ..hooks.attention import Carried, replayable
from ..models.base import FRAME, VIDEO
from ..registry import PRUNERS
from ._grid import per_sample
from ._tome_ops import bipartite_merge, merge_schedule, proportional_bias
from ._tome_video import temporal_merge, video_schedule
from .base import Pruner

TOWER_NEEDS = (Need.UNTILED, Need.SQUARE_GRID, Need.GLOBAL_TOWER_ATTENTION)


@dataclass
class _TowerMerge:
    """What ToMe's tower hooks leave for one tower call."""

    ids: torch.Tensor  # [n_img, T] source patch of each token (-1: CLS)
    size: torch.Tensor  # [n_img, T, 1] tokens merged into each
    r: list[int]  # tokens merged per block


@PRUNERS.register(
    "tome",
    description="ToMe: bipartite token merging inside the CLIP blocks (proportional attention); videos across frames",
)
class ToMe(Pruner):
    """ToMe."""

    hook_points = frozenset({"vision_tower", "vision_features"})
    caps = Capabilities(
        needs=frozenset(TOWER_NEEDS),
        why={
            Need.UNTILED: "it merges an image inside the tower over one square patch grid per image",
            Need.SQUARE_GRID: "it merges an image's patches inside a CLIP-style tower; dynamic-resolution towers "
            "attend per image / per window with 2-D rotary patch positions and their patch merger needs every 2x2 "
            "unit intact; its temporal merge of a video needs all of the video's frames in one vision item",
            Need.GLOBAL_TOWER_ATTENTION: "a merged token would straddle the tower's attention windows",
        },
        substitutes={need: frozenset({Need.VIDEO_ONE_ITEM}) for need in TOWER_NEEDS},
        image_needs=frozenset(TOWER_NEEDS),  # off a CLIP-style tower it merges a video's frames, no image
        merges_in_tower=True,
        needs_full_grid=True,
        video_join=True,  # the temporal merge is a feature stage (the tower merge never runs on a video)
    )

    @dataclass(frozen=True)
    class Config:
        budget: int = opt(
            64, lo=1, doc="T: patch tokens left at the feature layer (standard: 192, 128, 64); a video: tokens kept"
        )
        r: int | None = opt(
            None, lo=0, doc="tokens merged in every block up to the feature layer (a video: per step; overrides budget)"
        )
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
        if videos_only_on(caps_of(cls, None), adapter.features):  # a budget of the reference grid keeps a tiny video
            return {"r": 8}
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
            raise ConfigError(self.setting_path("budget"), str(exc)) from None  # a budget: its own key

    def install(self) -> None:
        # where the image merge cannot run (the needs met through the video substitute), videos only
        self.in_tower = not videos_only_on(self.caps, self.adapter.features)
        self.r_schedule = self.schedule() if self.in_tower else []
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
        # the hooks' work depends on shapes only: the tower may run them as a captured graph, the merge's
        # provenance and sizes (what observe_tower reads) carried across its replays
        carried = Carried(self._tower_state, self._put_tower_state)
        hooks.pre_hook(layers[0], replayable(self._reset, carried))
        first = next(i for i, r in enumerate(self.r_schedule) if r > 0)
        for i, layer in enumerate(layers):
            attn_hooks = attach(hooks, layer.self_attn)
            if i < len(self.r_schedule) and self.r_schedule[i] > 0:
                attn_hooks.recorders.append(replayable(self._record_metric, carried))
                hooks.set_attr(layer, "forward", replayable(self._make_forward(layer, self.r_schedule[i]), carried))
            if self.config.prop_attn and i > first:
                if attn_hooks.override is not None:
                    raise ConfigError("", f"vision layer {i}'s attention is already overridden by another stage")
                attn_hooks.override = replayable(self._proportional_attention, carried)

    # -- per-forward state -------------------------------------------------------------------------
    def _tower_state(self) -> _TowerMerge | None:
        return None if self._ids is None or self._size is None else _TowerMerge(self._ids, self._size, self._merged)

    def _put_tower_state(self, merge: _TowerMerge) -> None:
        """After a replay of the tower's graph: its provenance and sizes (copies: the next replay overwrites them)."""
        self._ids, self._size, self._merged = merge.ids.clone(), merge.size.clone(), list(merge.r)

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
        if VIDEO in vision.tags:
            return self._merge_videos(vision, batch)
        if not self.in_tower:
            raise IncompatibleRecipeError(
                f"{self.name} needs a video on this model (it merges a video's tokens across its frames and no image "
                "off a CLIP-style tower); pass videos=..."
            )
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

    # -- video: temporal merge on the LLM-input tokens ---------------------------------------------
    def video_plan(self, n_frames: int, per_frame: int, n_tokens: int, n_other: int) -> list[list[int]]:
        """r of every frame pair at every step for a video item of ``n_tokens`` tokens (``n_other`` of
        them no frame token), or a ConfigError naming the budget."""
        cfg = self.config_for(n_tokens)
        if cfg.r is not None:
            return video_schedule(n_frames, per_frame, r=cfg.r)
        try:
            return video_schedule(n_frames, per_frame, keep=cfg.budget - n_other)
        except ValueError as exc:
            raise ConfigError(
                self.setting_path("budget"), f"{exc}; ask for at least {per_frame + n_other} tokens"
            ) from None

    def _merge_videos(self, vision, batch):
        """Every video item's frame tokens merged across time (module docstring, "Video")."""
        if self.in_tower:  # a family with both paths would have merged the frames in the tower already
            raise IncompatibleRecipeError(f"{self.name}: this model's videos went through its tower merge")
        projected = None
        merged = [0] * batch.batch_size
        for i, vid in enumerate(vision.tags[VIDEO]):
            if not bool((vid > 0).any()):
                raise IncompatibleRecipeError(
                    f"{self.name} needs a video on this model (it merges a video's tokens across its frames); item {i} "
                    "is an image: pass videos=... without images"
                )
            pid = vision.patch_ids[i]
            real = (pid >= 0).nonzero().squeeze(1)  # [F T] frame tokens, frame-major
            other = (pid < 0).nonzero().squeeze(1)  # OneVision's closing newline
            _, per = vision.tags[FRAME][i].to(pid.device)[real].unique_consecutive(return_counts=True)
            t, f = int(per[0]), per.numel()
            if bool((per != t).any()):  # needs_full_grid keeps earlier token edits out
                raise RuntimeError(f"tome: the video's frames hold {per.tolist()} tokens; the merge needs whole frames")
            n = int(pid.shape[0])
            plan = self.video_plan(f, t, n, int(other.numel()))
            if not any(r for rs in plan for r in rs):
                continue
            if projected is None:
                projected = self.adapter.project(vision)
            proj = projected[i]  # [n, d]
            d = proj.shape[-1]
            feats = vision.features[i]
            aligned = "n_tiles" not in vision.extras and feats.shape[0] == n  # pre-merger features, row-aligned
            values = proj[real].float()
            if aligned:
                values = torch.cat([values, feats[real.to(feats.device)].float().to(values.device)], -1)
            seg, done = temporal_merge(values.reshape(f, t, -1), plan, d)  # [K, D], representative order
            rows = torch.cat([real[seg.rep], other])  # [K + n_other] rows of the item
            order = rows.argsort()
            rows = rows[order]
            vision.projected[i] = torch.cat([seg.x[:, :d].to(proj.dtype), proj[other]])[order]
            if aligned:
                kept = torch.cat([seg.x[:, d:].to(feats.device, feats.dtype), feats[other.to(feats.device)]])
                vision.features[i] = kept[order.to(feats.device)]
            sizes = torch.cat([seg.size, seg.size.new_ones(other.numel())])[order]
            vision.patch_ids[i] = pid[rows.to(pid.device)]
            for tags in vision.tags.values():
                tags[i] = tags[i][rows.to(tags[i].device)]
            vision.extras.setdefault("tome.size", [None] * vision.n_images)[i] = sizes
            merged[batch.image_owner[i]] += sum(done)
        vision.stats[self.name] = {
            "per_sample_tokens": per_sample(vision.counts(), batch.image_owner, batch.batch_size),
            "per_sample_merged": merged,
        }
        return vision
