"""FastVID (Shen et al., "FastVID: Dynamic Density Pruning for Fast Video Large Language Models",
arXiv 2503.11187; code LunarShen/FastVID @a40a109). The release has two variants, both here, ported in
:mod:`mmfast.pruning._fastvid_ops`:

- Qwen2.5-VL (``fastvid_qwen25vl/lmms-eval/lmms_eval/models/qwenvlutils/modeling_qwen2_5_vl.py``;
  defaults from ``fastvid_qwen25vl/scripts/eval.sh``, this method's defaults) on ``qwen2_vl`` /
  ``qwen2_5_vl``;
- LLaVA-OneVision (``fastvid_llavaonevision/LLaVA-NeXT/llava/model/language_model/modeling_qwen2.py``,
  ``llava_arch.py``, ``multimodal_encoder/siglip_encoder.py``; its ``eval.sh``: r = 0.10, tau = 0.9) on
  ``llava_onevision`` when ``siglip_head`` is given (below).

Algorithm (one video of F frames of n LLM-input tokens, before the LLM):

1. Frame signals. Qwen: A = the tower's last block, per head, the frame's mean query (after the vision
   RoPE) against each 2x2 merge unit's mean key, softmax over the frame's n units, mean over heads;
   G = the frame's mean LLM-input embedding (the merger's output). OneVision: SigLIP's
   ``post_layernorm`` + attention-pooling head on each frame's tower features (the release's
   ``SigLipVisionAbstract``): G = the pooled output, A = the probe's head-mean attention, bilinear to
   the pooled grid (``get_attn_2dPool``).
2. DySeg: s_f = cos(G_f, G_f+1); cuts after the c - 1 least similar pairs (``DySeg_c`` = 8) and after
   every pair with s_f < tau (``DySeg_tau``): segments of consecutive frames.
3. STPrune. Qwen, per segment of L frames: R = int(n r) L kept (r = ``retention_ratio``), of them
   C = max(int(R d), 1) context (``STPrune_d`` = 0.4) and R - C salient. A one-frame segment keeps them
   there. A longer one is cut again where s_f < ``DySeg_ignore`` (0.95) into V sub-segments, and only
   the *last* frame of each keeps tokens: the salient count split evenly over the V frames, the context
   count evenly over ceil(V / p) anchors (``DTM_p`` = 4: every p-th sub-segment from the end), an
   anchor's context capped at n // 2 and its salient at n minus it. OneVision: every frame keeps
   S = K - int(K d) salient tokens (K = int(n r)); a one-frame segment's frame also K - S context tokens;
   in a longer segment the anchors (every p-th frame from its end) get (K - S) L // ceil(L / p) each.
   Salient: the frame's top tokens by A. Context: of the frame's other tokens, the density peaks
   (DPC-KNN: density exp(-mean squared distance to the 4 nearest), times the distance to the nearest
   denser token; distances / sqrt(d); density + uniform noise x 1e-6 as tie-breaker).
4. DTM: a context token absorbs the tokens closest to it by cosine (argmax over the context tokens) and
   becomes w x + (1 - w) mean(absorbed), w = max(1 / (count + 1), ``DTM_beta`` = 0.6). Qwen: per anchor,
   the segment's tokens that are neither salient nor its own context; OneVision: a one-frame segment's
   non-salient tokens of the frame, or all non-salient tokens of the segment for each anchor.
5. The kept tokens in their original order; Qwen: each at its own (t, h, w) ids (a merged one at its
   context token's), as the release's ``position_ids[:, :, keep_indexs]``.

Hook points: ``vision_features`` (the selection and merge on ``VisionBatch.projected``); Qwen: a
recorder on the tower's last block's attention through the probe wrapper (``hooks.attach``: that block
runs transformers' per-chunk attention instead of mmfast's fused one; the release patches it to eager
math) and ``observe_tower`` (A per item into ``VisionBatch.extras``).

Families: Qwen2-VL / Qwen2.5-VL (a "frame" is a temporal patch group of 2 frames; Qwen2-VL's tower has
no windows, the same rule applies). LLaVA-OneVision with ``siglip_head``: a local directory of the
tower's SigLIP checkpoint with its attention-pooling head (the release loads
``google/siglip-so400m-patch14-384`` beside the model; OneVision checkpoints ship no head and nothing is
downloaded), refused without it and refused on Qwen with it. Qwen3-VL (the Qwen variant): each frame
group is its own vision item; ``video_join`` has the session join a video's items into one (A of each
group, [1, n], stacked to [F, n]; :mod:`mmfast.pruning._video_items`), and every kept token goes back
to its own frame group's span with its own (t, h, w) ids (a merged context token: its anchor's); groups
that keep nothing (not a sub-segment's last frame) keep an empty span. Refused: LLaVA-1.5 / NeXT (no
video input).

Deviations: (a) per sample, per video, at any batch size (the release: batch 1, one video); images of
the batch are never touched; (b) A, G, the density and the merge in fp32 (the release: model dtype;
Qwen's A from its flash-attention tower patch); (c) the noise is drawn from a generator seeded with
``seed`` per video (the release: the global RNG), so decisions do not depend on the batch or on earlier
samples; (d) DySeg takes min(c - 1, F - 1) pairs and a one-frame video is one segment (the release's
``topk`` raises when F < c); (e) the nearest neighbours are min(4, candidates) and a OneVision anchor's
context count at most its candidates (the release raises there); no context tokens at all when K - S
is 0 (the release raises); (f) OneVision: the kept tokens get consecutive positions (mmfast's feature
stage on 1-D RoPE; the release keeps their original ids, ``position_ids = keep_indexs``), and the
closing newline stays, as the release (it is outside the video's span there).
No-op: ``retention_ratio: 1.0, tau: 2.0, beta: 1.0`` (every pair a cut: one-frame segments keep all n
tokens and a context token keeps itself: the release's rule, exactly the input).
Budget (``tokens: B`` / ``ratio: r``, per video of N tokens): retention_ratio = B / N, so a frame keeps
about int(n B / N) and a video at most B (fewer where the release's per-anchor caps bind); OneVision's N
counts the closing newline, which is kept on top. A setting where a frame keeps int(n r) = 0 tokens (a
budget below about one token per frame) is refused after the tower, naming the smallest budget: the
release's counts go negative there and every segment keeps a context token, more than B.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from transformers import SiglipVisionModel

from ..capabilities import Capabilities, Need
from ..config import opt
from ..errors import ConfigError
from ..hooks import attach
from ..models.base import VIDEO
from ..registry import PRUNERS
from . import _received
from ._fastvid_ops import FastVIDParams, frame_attention, pooled_attention, select_video, select_video_ov
from ._grid import per_sample
from .base import Pruner
from .divprune import select_image_rows

ATTN_EXTRA = "fastvid.attention"  # VisionBatch.extras: per item [F, n] frame attention (None: an image)

WHY = {
    Need.VIDEO: "it segments a video's frames and prunes their tokens; use an image pruner on images",
    Need.VIDEO_ONE_ITEM: "DySeg compares consecutive frames of one video item",
    Need.DYNAMIC_GRID: "without siglip_head its frame attention is the release's Qwen2.5-VL rule on the tower's "
    "last block over 2x2 merge units; the release's OneVision code needs SigLIP's attention-pooling head, which "
    "OneVision checkpoints do not ship: give siglip_head (a local copy of the tower's SigLIP checkpoint)",
    Need.PAIRED_TEXT_TOWER: "siglip_head is the pooling head of the tower's own SigLIP checkpoint (the release's "
    "OneVision variant); leave it unset on Qwen-VL",
}


class _QKRecorder:
    """Recorder (``ModuleAttentionHooks.recorders``) of a block's queries and keys, pooled per merge unit."""

    def __init__(self, unit: int) -> None:
        self.unit = unit
        self.q: list[torch.Tensor] = []  # per call [U_c, H, D]
        self.k: list[torch.Tensor] = []

    def __call__(self, module, query, key, attention_mask, scaling) -> None:
        # query / key [B, H, L, D] after RoPE; one chunk (window or frame: whole merge units) per call
        for x, out in ((query, self.q), (key, self.k)):
            b, h, length, dim = x.shape
            pooled = x.float().reshape(b, h, length // self.unit, self.unit, dim).mean(3)  # [B, H, U, D]
            out.extend(pooled.permute(0, 2, 1, 3).unbind(0))

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.q:
            raise RuntimeError("fastvid: the tower's last block recorded no attention")
        out = torch.cat(self.q), torch.cat(self.k)  # [S / unit, H, D] each, tower order
        self.q, self.k = [], []
        return out


@PRUNERS.register("fastvid", description="FastVID: dynamic segmentation + density-based spatiotemporal video pruning")
class FastVID(Pruner):
    """FastVID."""

    hook_points = frozenset({"attention_probe", "vision_features"})

    family_params: ClassVar[dict[str, Any]] = {"siglip_head": "<the tower's SigLIP checkpoint>"}

    @classmethod
    def capabilities(cls, params) -> Capabilities:
        head = params is not None and params.siglip_head is not None  # the release's OneVision variant
        needs = frozenset({Need.VIDEO, Need.VIDEO_ONE_ITEM, Need.PAIRED_TEXT_TOWER if head else Need.DYNAMIC_GRID})
        return Capabilities(
            needs=needs,
            why={n: WHY[n] for n in needs},
            edits_features=True,
            needs_full_grid=True,  # whole frames, each token at its grid cell
            videos_only="it segments a video's frames and prunes their tokens",
            video_join=True,  # its frame attention is per frame group (observe_tower), the rest a feature stage
        )

    budget_knobs = ("retention_ratio",)

    @dataclass(frozen=True)
    class Config:
        retention_ratio: float = opt(0.27, lo=0.0, hi=1.0, doc="fraction of a frame's tokens kept (release 0.27)")
        c: int = opt(8, lo=1, doc="DySeg: the c - 1 least similar adjacent frame pairs are cuts (DySeg_c)")
        tau: float = opt(0.84, lo=-1.0, hi=2.0, doc="DySeg: adjacent frames with cosine < tau are cut (DySeg_tau)")
        ignore: float = opt(0.95, lo=-1.0, hi=2.0, doc="sub-segments end where cosine < ignore (DySeg_ignore)")
        d: float = opt(0.4, lo=0.0, hi=1.0, doc="STPrune: context fraction of a segment's kept tokens (STPrune_d)")
        p: int = opt(4, lo=1, doc="DTM: one anchor per p sub-segments (DTM_p)")
        beta: float = opt(0.6, lo=0.0, hi=1.0, doc="DTM: least weight of an anchor's own token (DTM_beta)")
        seed: int = opt(0, doc="seed of the density tie-break noise, per video (the release: global RNG)")
        siglip_head: str | None = opt(
            None, doc="OneVision: local path of the tower's SigLIP checkpoint with its pooling head (release: so400m)"
        )

    @classmethod
    def noop_params(cls, adapter):
        return {"retention_ratio": 1.0, "tau": 2.0, "beta": 1.0}

    @classmethod
    def test_params(cls, adapter):
        return {"retention_ratio": 0.5}

    @classmethod
    def budget_params(cls, tokens, n, adapter, config, path):
        """retention_ratio = B / N of the video, one ulp up: a frame's int(n B / N) is then the whole count
        real arithmetic gives (B / N alone can land below it: int(49 x (2 / 98)) = 0)."""
        return {"retention_ratio": min(1.0, math.nextafter(tokens / n, 2.0))}

    def params(self, cfg) -> FastVIDParams:
        return FastVIDParams(cfg.retention_ratio, cfg.c, cfg.tau, cfg.ignore, cfg.d, cfg.p, cfg.beta)

    def _checked(self, cfg, n: int, n_frames: int) -> FastVIDParams:
        """The params of a video of ``n_frames`` frames of ``n`` tokens, refused (ConfigError) where a frame
        keeps int(n r) = 0 tokens: the release's counts then go negative and every segment keeps one context
        token (more than a budget below the frame count; OneVision: no token at all)."""
        if int(n * cfg.retention_ratio) > 0:
            return self.params(cfg)
        if self.budget_rule is not None:
            fix = f"ask for at least {n_frames} tokens (one per frame)"
        else:
            fix = f"give at least 1 / {n} (one token per frame)"
        raise ConfigError(
            self.setting_path("retention_ratio"),
            f"a frame of this video keeps int({n} x {cfg.retention_ratio:.4g}) = 0 of its {n} tokens "
            f"({n_frames} frames), and FastVID's per-segment counts need at least one; {fix}",
        )

    def install(self) -> None:
        self._rec = self._head = None
        if self.config.siglip_head is not None:
            self._head = load_siglip_head(self.config.siglip_head, self.adapter.vision_config, self.ctx)
            return
        self._rec = _QKRecorder(self.adapter.merge**2)
        attach(self.ctx.hooks, self.adapter.vision_layers[-1].attn).recorders.append(self._rec)

    def observe_tower(self, vision) -> None:
        """The last block's queries / keys -> each video's frame attention A [F, n] (raster order)."""
        if self._rec is None:
            return
        q, k = self._rec.take()
        order = _received.window_order(self.adapter.vision_tower, vision.extras["grid_thw"], self.adapter.merge)
        if order is not None:
            back = torch.argsort(order.to(q.device))
            q, k = q[back], k[back]
        counts = vision.counts()
        if q.shape[0] != sum(counts):
            raise RuntimeError("fastvid: the tower's last block did not run on every patch of the inputs")
        videos = vision.tags.get(VIDEO)
        out: list[torch.Tensor | None] = []
        for i, (qi, ki) in enumerate(zip(torch.split(q, counts), torch.split(k, counts))):
            if videos is None or not bool((videos[i] > 0).any()):
                out.append(None)
                continue
            t, h, w = vision.extras["grid_thw"][i]
            per_frame = [x.reshape(t, h * w, *x.shape[1:]).permute(2, 0, 1, 3) for x in (qi, ki)]  # [H, F, n, D]
            out.append(frame_attention(*per_frame))
        vision.extras[ATTN_EXTRA] = out

    def prune_vision(self, vision, batch):
        if self._head is not None:
            return self._prune_ov(vision, batch)
        attn = vision.extras.pop(ATTN_EXTRA)
        projected = self.adapter.project(vision)  # [N_i, d] each: the LLM input embeddings the release prunes
        for i, a in enumerate(attn):
            if a is None:
                continue
            t, h, w = vision.extras["grid_thw"][i]
            if vision.counts()[i] != t * h * w or not torch.equal(vision.patch_ids[i].cpu(), torch.arange(t * h * w)):
                raise ValueError("fastvid needs every video's full merged grid; put it first among the feature stages")
            emb = projected[i].reshape(t, h * w, -1)  # [F, n, d]
            gen = torch.Generator(device=emb.device).manual_seed(self.config.seed)
            prm = self._checked(self.config_for(t * h * w), h * w, t)
            kept, rows = select_video(emb, a.to(emb.device), emb.float().mean(1), prm, gen)
            vision.projected[i] = projected[i]
            select_image_rows(vision, i, kept)
            vision.projected[i] = rows.to(projected[i].dtype)
        vision.stats[self.name] = {"per_sample_kept": per_sample(vision.counts(), batch.image_owner, batch.batch_size)}
        return vision

    def _prune_ov(self, vision, batch):
        """The release's OneVision variant: A and G from SigLIP's pooling head on each frame's tower features."""
        videos = vision.tags.get(VIDEO)
        rows_, cols_ = self.adapter.grid
        for i in range(vision.n_images):
            if videos is None or not bool((videos[i] > 0).any()):
                continue
            tokens = vision.projected[i]  # [F T + 1, d]: the pooled frames, then the closing newline
            n_frames = int(vision.extras["n_tiles"][i])
            n = (tokens.shape[0] - 1) // n_frames
            if not torch.equal(vision.patch_ids[i][:-1].cpu(), torch.arange(n_frames * n)):
                raise ValueError("fastvid needs every video's full frames; put it first among the feature stages")
            feats = vision.features[i].reshape(n_frames, rows_ * cols_, -1)  # [F, N, Dv] the tower's output
            glob, weights = self._head(feats)  # [F, Dv], [F, N]
            attn = pooled_attention(weights.float(), rows_, cols_)  # [F, T]
            gen = torch.Generator(device=tokens.device).manual_seed(self.config.seed)
            prm = self._checked(self.config_for(tokens.shape[0]), n, n_frames)
            kept, rows = select_video_ov(tokens[:-1].reshape(n_frames, n, -1), attn.to(tokens.device), glob, prm, gen)
            select_image_rows(vision, i, torch.cat([kept, kept.new_tensor([n_frames * n])]))
            vision.projected[i] = torch.cat([rows.to(tokens.dtype), tokens[-1:]])
        vision.stats[self.name] = {"per_sample_kept": per_sample(vision.counts(), batch.image_owner, batch.batch_size)}
        return vision


class _SiglipHead(torch.nn.Module):
    """SigLIP's ``post_layernorm`` + attention-pooling head on a tower's output, as the release's
    ``SigLipVisionAbstract``: (pooled [F, D], attention [F, N], head mean)."""

    def __init__(self, vision_model) -> None:
        super().__init__()
        self.post_layernorm, self.head = vision_model.post_layernorm, vision_model.head

    @torch.no_grad()
    def forward(self, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.post_layernorm.weight
        x = self.post_layernorm(feats.to(device=w.device, dtype=w.dtype))  # [F, N, D]
        probe = self.head.probe.repeat(x.shape[0], 1, 1)
        out, weights = self.head.attention(probe, x, x)  # [F, 1, D], [F, 1, N] (head mean)
        out = out + self.head.mlp(self.head.layernorm(out))
        return out[:, 0], weights[:, 0]


def load_siglip_head(path: str, tower_config, ctx) -> _SiglipHead:
    """The pooling head of the SigLIP checkpoint at ``path`` (a local directory of safetensors weights;
    nothing is downloaded, nothing unpickled)."""
    try:
        model = SiglipVisionModel.from_pretrained(path, local_files_only=True, use_safetensors=True, dtype=ctx.dtype)
    except (OSError, ValueError) as exc:
        raise ConfigError("siglip_head", f"cannot load a SigLIP vision model from {path!r}: {exc}") from None
    vm = getattr(model, "vision_model", model)  # transformers 5: the parts sit on the model itself
    if not getattr(model.config, "vision_use_head", True) or getattr(vm, "head", None) is None:
        raise ConfigError("siglip_head", f"{path!r} has no attention-pooling head (vision_use_head is false)")
    if int(model.config.hidden_size) != int(tower_config.hidden_size):
        raise ConfigError(
            "siglip_head",
            f"{path!r} has width {model.config.hidden_size}, the model's tower {tower_config.hidden_size}: "
            "give the tower's own SigLIP checkpoint",
        )
    return _SiglipHead(vm).to(ctx.device).eval()
