"""HICom (Liu et al., "Hybrid-Level Instruction Injection for Video Token Compression in Multi-modal
Large Language Models", CVPR 2025, arXiv 2503.16036; code lntzm/HICom @df67ea1), as a feature stage:
a training-free instruction-conditioned local compressor plus HICom's lightly trained global branch,
on LLaVA-1.5 images (CLIP guide) and on LLaVA-OneVision videos (the release's SigLIP path, below).

Algorithm (per prompt; its images are the frames of one clip unless ``frames: images``):
1. Guide g = CLIP ``text_embeds`` of the user instruction (``batch.prompts``, answer-format suffixes
   and option lists stripped as HICom's ``extract_guided_prompt``).
2. Local: split the (T, H, W) patch volume into groups of ``temporal_kernel`` x g x g patches
   (T = 1 for an image; 24x24: g=2 -> 144, g=3 -> 64 tokens per frame group); values = the
   feature-layer patch features, token = sum_j w_j v_j, fed to the model's own projector.
   ``local_rule: release`` (default; HICom's released local attention with the instruction as the
   query, CLIP path without a logit scale): k = ``visual_projection(last-layer patch tokens)``,
   w = softmax(g . k_j / sqrt(P)) over the group. ``local_rule: blend`` (mmfast's earlier training-free
   rule): k = ``visual_projection(post_layernorm(.))`` (MaskCLIP-style), w = alpha * softmax(s *
   cos(g, k_j)) + (1 - alpha) / |G| (alpha = 0: plain average pooling). Measured on the embedded
   model (docs/methods.md, "HICom on the embedded model"): release 0.622 vs blend 0.492 POPE F1 at 64
   local tokens.
3. Global: ``global_queries`` queries, one multi-head cross-attention over all frame features plus 3-D
   sinusoidal positions, readout MLP(q + attn) to the LLM width (trained: scripts/train_hicom.py).
   ``global_mode: coarse`` (default, the paper): learnable queries FiLM-modulated by g
   (LN(q * (1 + scale) + shift)). ``global_mode: direct`` (the release, ``--use_guide direct`` in its
   ``directg_local43_global32`` script): every query is MLP(g), so the learned queries go unused and the
   global tokens are identical copies. The mode is stored with the trained weights and must match.
4. Tokens: local in (t, h, w) raster order, then global, in the prompt's first image slot; the
   prompt's other frame slots get zero tokens (``build_lm_inputs`` accepts empty images).

Hook points: a forward hook on the last vision layer (reads its output; shape-only, so the tower still runs
as a captured graph where the session captures, the output carried across replays), ``vision_features``. The
CLIP text guide runs as a captured graph there too (``MethodContext.captured``: the ids right-padded to the text
tower's width and no padding mask, which the causal tower does not need for the pooled last real token;
``ClipGuide.text_embeds``).
Positions: contiguous (feature stage). With the global branch, ``projected`` holds
[projector(local); global tokens] and ``features`` [local; query + attn] (pre-readout).

Deviations and limits (reasons):
- Training-free local branch: HICom trains its readout MLP (and, with adapt_k/q/v, key/query/value
  adapters) after the local attention; mmfast keeps LLaVA's projector so the tokens stay in its input
  space. The weighting itself is the release's (``local_rule: release``); ``blend`` (alpha = 0.5,
  s = 20, not from the paper) degrades towards average pooling and measured worse.
- Keys apply CLIP's post-layernorm before ``visual_projection`` (MaskCLIP); HICom's CLIP branch
  projects the raw last hidden state. ``local_rule: release`` takes the release's local weighting
  instead: raw keys, w = softmax(g . k / sqrt(P)) (its trained readout is still replaced by LLaVA's
  projector). The guide is the CLIP text tower, as HICom's CLIP-L variant.
- Global queries start from N(0, 0.02) (HICom: zeros, identical queries until the LLM's positions
  break the symmetry), to train quickly on CPU. Heads = Dv // 128 (at least 1) as HICom.
- Frame counts not divisible by the temporal kernel use adaptive bins (neighbouring groups overlap
  by a frame; HICom's ``balance_divide_feature`` also overlaps); grids not divisible by g likewise.
- The CLS token (``full`` select strategy) is dropped. Must be the first feature stage.
- The global branch needs weights trained for this model: ``<model dir>/hicom_global.safetensors``
  by default (a clear error names the file and the training command when missing).
No-op: spatial_kernel 1, temporal_kernel 1, global_queries 0 (no local_tokens) returns the vision
batch untouched.

Budget (``budget: {tokens: B}``, vision tokens per image (frame group) at the LLM input; sets
``local_tokens`` and overrides ``spatial_kernel``, which must not be given): local_tokens =
B - global_queries (``global_queries`` stays the trained branch's size; B must exceed it), so the
total is the near-square local grid (``_grid.near_square_grid``, the avgpool rule) + global_queries.

Video (LLaVA-OneVision, as the release runs video; helpers in ``_hicom_video.py``): a video item's
frames (T x 27 x 27 on SigLIP-so400m-384) are compressed *instead of* OneVision's 2x2 pooling:
values = the feature-layer patches (SigLIP's layer -2, OneVision's last of 26); keys = z +
head.mlp(head.layernorm(z)), z = SigLIP's post-layernorm last hidden state (the tower's last hidden
state through the SigLIP layers it lacks); guide = the SigLIP text tower's ``pooler_output`` of the
instruction (padded to max_length). Groups: ``temporal_kernel`` x ``spatial_kernel``^2 (local43:
4 x 3 x 3) cut as the release's ``divide_feature`` / ``balance_divide_feature``; weights
softmax(g . k / sqrt(D)) (``clip_scale``: cos * exp(logit_scale) + logit_bias, ``use_clip_scale``);
tokens through the model's projector, then the global tokens, then the video's closing newline;
positions contiguous. ``local_tokens`` (or a budget) sets adaptive spatial bins instead.
The SigLIP parts come from ``guide_model`` (a ``google/siglip-so400m-patch14-384`` directory, read
offline with safetensors; default ``<model dir>/siglip``): OneVision checkpoints hold none of them.
Video deviations: the stock SigLIP head and text tower (the released HICom model fine-tunes them);
OneVision's fine-tuned tower layers completed by the stock 27th layer; the model's projector instead
of HICom's trained readout; ``local_rule`` / ``alpha`` / ``scale`` are the CLIP image path's (unused);
the guide text is ``guide_text`` (``extract_guided_prompt``'s training-set category prompts not listed);
where the release's split has unequal groups (its ``torch.stack`` fails: 6 frames, kernel 4),
adaptive bins of the same count. No global weights ship for OneVision: ``global_queries`` > 0 needs a
file trained for it (refused otherwise, naming it); ``global_queries: 0`` runs the local branch.
Budget on a video (``tokens: N``): N tokens per video = frame groups x the largest local grid with
at most (N - global - 1) // groups cells + global + the newline. On OneVision images are refused
before compute (``image_needs``: its images are tiled); the model needs video input.

Qwen-VL families (qwen2_vl, qwen2_5_vl, qwen3_vl): refused (no fixed square grid): its global
queries and CLIP guide are trained for LLaVA-1.5 features; no Qwen-VL weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ..capabilities import Capabilities, Need
from ..config import opt
from ..errors import ConfigError
from ..hooks.attention import Carried, replayable
from ..models.base import VisionBatch
from ..models.features import has
from ..registry import PRUNERS
from ._grid import grid_features, per_sample
from ._hicom_guide import guide_text, load_clip_guide, model_dir
from ._hicom_modules import (
    GLOBAL_WEIGHTS,
    load_global,
    local_compress,
    local_grid,
)
from ._hicom_video import budget_cells, load_siglip_guide, splice_video, video_bins, video_local
from .base import Pruner


@PRUNERS.register(
    "hicom", description="HICom: instruction-guided local group pooling + trained global queries before the LLM"
)
class HICom(Pruner):
    """HICom."""

    hook_points = frozenset({"vision_features"})
    caps = Capabilities(
        needs=frozenset({Need.UNTILED, Need.SQUARE_GRID}),
        why={
            Need.UNTILED: "its local groups need one square patch grid per image (its global queries and CLIP guide "
            "are trained for LLaVA-1.5's); on a model whose images are tiled it compresses videos only, whose "
            "frames are untiled",
            Need.SQUARE_GRID: "its local groups and guide towers (CLIP for LLaVA-1.5, SigLIP for OneVision video) "
            "are built for a fixed square patch grid",
        },
        substitutes={Need.UNTILED: frozenset({Need.VIDEO_ONE_ITEM})},
        image_needs=frozenset({Need.UNTILED}),
        edits_features=True,
        needs_full_grid=True,
    )

    @dataclass(frozen=True)
    class Config:
        spatial_kernel: int = opt(
            3, lo=1, doc="g: local groups of g x g patches (paper local43: 3; 24x24 -> 64, g=2 -> 144)"
        )
        temporal_kernel: int = opt(4, lo=1, doc="frames per local group when a prompt has several frames (paper: 4)")
        local_tokens: int | None = opt(
            None, lo=1, doc="overrides spatial_kernel: near-square grid of about this many local tokens per frame group"
        )
        local: bool = opt(True, doc="the local branch (false: global tokens only)")
        alpha: float = opt(
            0.5, lo=0.0, hi=1.0, doc="w = alpha * softmax(s * cos) + (1 - alpha) / |G| (0: average pooling)"
        )
        scale: float = opt(20.0, lo=0.0, hi=200.0, doc="s: cosine scale of the local softmax (spec: 10-50; CLIP: 100)")
        local_rule: Literal["blend", "release"] = opt(
            "release",
            doc="blend: alpha * softmax(s cos) + (1 - alpha) / |G| on post-layernorm keys; release: HICom's "
            "released local attention softmax(g . k / sqrt(P)) on raw keys (alpha, scale unused)",
        )
        global_queries: int = opt(32, lo=0, doc="learnable global queries (paper: 32; 0 = training-free local only)")
        global_mode: Literal["coarse", "direct"] = opt(
            "coarse",
            doc="global-branch instruction injection: coarse (the paper: FiLM-modulated learned queries) or "
            "direct (the release: the queries are the projected instruction); must match the trained weights",
        )
        global_weights: str | None = opt(
            None,
            doc="trained global branch (default <model dir>/hicom_global.safetensors; 'random': untrained, for timings on random-weight shapes and tests)",
        )
        clip_model: str | None = opt(
            None,
            doc="guide CLIP (default <model dir>/clip; LLaVA-1.5: openai/clip-vit-large-patch14-336; 'random': timings on random-weight shapes and tests)",
        )
        frames: Literal["video", "images"] = opt("video", doc="video: a prompt's images are frames compressed jointly")
        guide_model: str | None = opt(
            None,
            doc="video input: the SigLIP the tower was cut from (a SiglipModel directory; default <model dir>/siglip; "
            "OneVision: google/siglip-so400m-patch14-384; 'random': timings on random-weight shapes and tests)",
        )
        clip_scale: bool = opt(
            False,
            doc="video input: local weights softmax(cos * exp(logit_scale) + logit_bias) (release use_clip_scale)",
        )

        def __post_init__(self) -> None:
            if not self.local and self.global_queries == 0:
                raise ValueError("local: false needs global_queries > 0 (nothing would be left)")

    budget_knobs = ("local_tokens", "spatial_kernel")

    @classmethod
    def noop_params(cls, adapter):
        return {"spatial_kernel": 1, "temporal_kernel": 1, "global_queries": 0}

    @classmethod
    def budget_params(cls, tokens, n, adapter, config, path):
        """local_tokens = B - global_queries."""
        n_global = config.global_queries if config.local else 0
        if not config.local:
            raise ConfigError(
                f"{path}.tokens", "local: false leaves only the global queries; set global_queries instead of a budget"
            )
        if tokens <= n_global:
            raise ConfigError(
                f"{path}.tokens",
                f"{tokens} tokens leave no local tokens beside the {n_global} global queries; the smallest feasible "
                f"budget is {n_global + 1} (or set params.global_queries lower)",
            )
        return {"local_tokens": tokens - n_global}

    @classmethod
    def test_params(cls, adapter):
        return {"spatial_kernel": 2, "global_queries": 0, "clip_model": "random", "guide_model": "random"}

    @classmethod
    def random_shape_params(cls):
        return {"clip_model": "random", "guide_model": "random", "global_weights": "random"}

    def is_noop(self) -> bool:
        c = self.config
        return (
            c.local
            and c.spatial_kernel == 1
            and c.temporal_kernel == 1
            and c.local_tokens is None
            and c.global_queries == 0
        )

    def install(self) -> None:
        self.clip = self.siglip = self.glob = None
        self._last_hidden: torch.Tensor | None = None
        if self.is_noop():
            return
        cfg = self.config
        model, features = self.adapter.model, self.adapter.features
        d = model_dir(model)
        if has(features, Need.UNTILED):  # images (LLaVA-1.5): the CLIP guide
            self.clip = load_clip_guide(cfg.clip_model, model, self.ctx.tokenizer)
            if self._guided():  # shape-only: the tower may still run as a captured graph, the output carried
                carried = Carried(lambda: self._last_hidden, lambda h: setattr(self, "_last_hidden", h.clone()))
                self.ctx.hooks.forward_hook(self.adapter.vision_layers[-1], replayable(self._record_last, carried))
        if features.video:  # video (OneVision): the SigLIP guide (local weights and the global queries)
            vc = self.adapter.vision_config
            self.siglip = load_siglip_guide(
                cfg.guide_model, d, vc, len(self.adapter.vision_layers), self.ctx.tokenizer, self.ctx.device
            )
            if self.siglip.text_dim != self.siglip.dim:
                raise ConfigError(
                    "guide_model",
                    f"the SigLIP guide's text embeddings are {self.siglip.text_dim} wide but its keys "
                    f"{self.siglip.dim}: the release's training-free query needs them equal (so400m: 1152)",
                )
        if cfg.global_queries > 0:
            path = cfg.global_weights or (str(d / GLOBAL_WEIGHTS) if d is not None else None)
            if path is None:
                raise ConfigError(
                    "global_weights", "this model has no local directory; set global_weights to the trained file"
                )
            guide = self.clip or self.siglip
            expect = {
                "vision_hidden": self.adapter.vision_config.hidden_size,
                "llm_hidden": self.adapter.text_config.hidden_size,
                "text_dim": guide.dim if guide is not None else self.adapter.vision_config.hidden_size,
                "n_queries": cfg.global_queries,
                "mode": cfg.global_mode,
            }
            self.glob, _ = load_global(path, model_hint=str(d or "<model dir>"), expect=expect)
            self.glob.to(self.ctx.device)

    def _guided(self) -> bool:
        cfg = self.config
        return cfg.local and (cfg.alpha > 0 or cfg.local_rule == "release")

    def _record_last(self, module, args, output) -> None:
        self._last_hidden = output[0] if isinstance(output, tuple) else output  # [n_img, 1 + N, Dv]

    def _units(self, batch) -> list[tuple[int, list[int]]]:
        """(sample, image indices) compressed together (videos are compressed on their own)."""
        per: dict[int, list[int]] = {}
        for i, b in enumerate(batch.image_owner):
            if not batch.item(i).is_video:
                per.setdefault(b, []).append(i)
        if self.config.frames == "images":
            return [(b, [i]) for b, idx in per.items() for i in idx]
        return list(per.items())

    def prune_vision(self, vision: VisionBatch, batch) -> VisionBatch:
        n_before = vision.counts()
        if self.is_noop():
            vision.stats[self.name] = {"per_sample_kept": per_sample(n_before, batch.image_owner, batch.batch_size)}
            return vision
        n_local, n_frames = [0] * batch.batch_size, [0] * batch.batch_size
        grids: list[list[int] | None] = [None] * batch.batch_size  # each sample's local grid (its last unit's)
        units = self._units(batch)
        if units:
            self._images(vision, batch, units, n_local, n_frames, grids)
        videos = [i for i in range(vision.n_images) if batch.item(i).is_video]
        if videos:
            guides = self.siglip.text_embeds([guide_text(p) for p in batch.prompts]) if self.siglip else None  # [B, D]
            for i in videos:
                b = batch.image_owner[i]
                out_grid = self._video(vision, batch, i, None if guides is None else guides[b], n_before[i])
                n_local[b] += out_grid[0] * out_grid[1] * out_grid[2]
                grids[b] = list(out_grid)
                n_frames[b] += batch.item(i).n_frames
        vision.stats[self.name] = {
            "per_sample_kept": per_sample(vision.counts(), batch.image_owner, batch.batch_size),
            "per_sample_local": n_local,
            "per_sample_frames": n_frames,
            "global": self.config.global_queries if self.glob is not None else 0,
            "global_mode": self.config.global_mode if self.glob is not None else None,
            "per_sample_local_grid": grids,
        }
        return vision

    def _project(self, vision: VisionBatch, local: torch.Tensor) -> torch.Tensor:
        """The model's own projector on pre-projection tokens [n, Dv] -> [n, d]."""
        pid = torch.full((local.shape[0],), -1, device=local.device)
        return self.adapter.project(VisionBatch([local], [pid], None, vision.grid, vision.pixel_values[:0]))[0]

    def _images(self, vision: VisionBatch, batch, units, n_local, n_frames, grids) -> None:
        """Images (LLaVA-1.5): each prompt's images are the frames of one clip (module docstring)."""
        cfg = self.config
        if self.clip is None:
            raise RuntimeError("hicom: images reached a model whose images it does not take (refused before compute)")
        rows, cols = vision.grid
        guides = self.clip.text_embeds([guide_text(p) for p in batch.prompts], run=self.ctx.captured)  # [B, P]
        keys = None
        if self._guided():
            last, self._last_hidden = self._last_hidden, None
            if last is None or last.shape[1] != 1 + rows * cols:
                raise RuntimeError("hicom: the last vision layer did not run on the full patch grid")
            keys = self.clip.patch_embeds(last[:, 1:], post_layernorm=cfg.local_rule == "blend")  # [n_img, N, P]
        for b, idx in units:
            values = torch.stack([grid_features(vision, i, "hicom")[0] for i in idx])  # [T, H, W, Dv]
            t, dtype, dev = len(idx), values.dtype, values.device
            guide = guides[b]
            pieces_f, pieces_p = [], []
            if cfg.local:
                out_grid = local_grid(
                    t, rows, cols, cfg.temporal_kernel if t > 1 else 1, cfg.spatial_kernel, cfg.local_tokens
                )
                k = keys[idx].reshape(t, rows, cols, -1) if keys is not None else None
                local, _, _ = local_compress(values, k, guide, out_grid, cfg.alpha, cfg.scale, cfg.local_rule)
                pieces_f.append(local.to(dtype))
                n_local[b] += local.shape[0]
                grids[b] = list(out_grid)
            if self.glob is not None:
                pre, tok = self.glob(values.float()[None].to(self.ctx.device), guide[None])
                pieces_f.append(pre[0].to(dev, dtype))
                if cfg.local:
                    pieces_p.append(self._project(vision, pieces_f[0]))
                pieces_p.append(tok[0].to(dev))
            feats = torch.cat(pieces_f)
            proj = torch.cat(pieces_p).to(pieces_p[0].dtype) if pieces_p else None
            for j, i in enumerate(idx):
                keep = feats if j == 0 else feats[:0]
                vision.features[i] = keep
                vision.patch_ids[i] = torch.full((keep.shape[0],), -1, dtype=torch.long, device=dev)
                vision.projected[i] = None if proj is None else (proj if j == 0 else proj[:0])
            n_frames[b] += t

    def _video(self, vision: VisionBatch, batch, i: int, guide, n_tokens: int) -> tuple[int, int, int]:
        """Video item ``i`` (one item of all its frames, OneVision): its frames' feature-layer grids are
        compressed instead of the model's own 2x2 pooling; its non-frame tokens (the closing newline) stay
        last. Returns the local grid (groups along t, h, w)."""
        cfg = self.config
        rows, cols = vision.grid
        t = batch.item(i).n_frames
        feats, pid = vision.features[i], vision.patch_ids[i]
        dtype, dev = feats.dtype, feats.device
        if feats.shape[0] != t * rows * cols or vision.projected[i] is None:
            raise ValueError(f"hicom needs the full {rows}x{cols} grid of each of the video's {t} frames; put it first")
        values = feats.reshape(t, rows, cols, -1)  # [T, H, W, Dv] feature-layer values
        extra = vision.projected[i][pid < 0]  # [e, d] the model's non-frame tokens (OneVision: the newline)
        n_global = cfg.global_queries if self.glob is not None else 0
        cells = cfg.local_tokens
        if self.budget_rule is not None:  # N tokens for the whole video
            target = self.budget_rule.target(n_tokens)
            cells = budget_cells(target, t, cfg.temporal_kernel, n_global + extra.shape[0], self.budget_path)
        pieces_f, pieces_p, grid = [], [], (0, 0, 0)
        if cfg.local:
            bins = video_bins(t, rows, cols, cfg.temporal_kernel, cfg.spatial_kernel, cells)
            x = values.reshape(t, rows * cols, -1)  # the tower's last layers after the feature layer (none here)
            for layer in self.adapter.vision_layers[self.adapter.vision_feature_layer_index() + 1 :]:
                x = layer(x, None)
                x = x[0] if isinstance(x, tuple) else x
            keys = self.siglip.keys(x).reshape(t, rows, cols, -1)  # [T, H, W, D]
            scale = (self.siglip.logit_scale, self.siglip.logit_bias) if cfg.clip_scale else None
            local, _, _ = video_local(values, keys, guide, bins, scale)  # [G, Dv]
            pieces_f, pieces_p, grid = (
                [local.to(dtype)],
                [self._project(vision, local.to(dtype))],
                tuple(map(len, bins)),
            )
        if self.glob is not None:
            pre, tok = self.glob(values.float()[None].to(self.ctx.device), guide[None])
            pieces_f.append(pre[0].to(dev, dtype))
            pieces_p.append(tok[0].to(dev))
        proj = torch.cat([p.to(extra.dtype) for p in (*pieces_p, extra)])  # [G + n_global + e, d]
        splice_video(vision, i, torch.cat(pieces_f), proj, grid)
        return grid
