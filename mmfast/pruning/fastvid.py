"""FastVID (Shen et al., "FastVID: Dynamic Density Pruning for Fast Video Large Language Models",
arXiv 2503.11187; code LunarShen/FastVID @a40a109, ``fastvid_qwen25vl/``: ``lmms-eval/lmms_eval/models/
qwenvlutils/modeling_qwen2_5_vl.py`` (``Qwen2_5_VLVisionFlashAttention2.forward``,
``Qwen2_5_VLForConditionalGeneration.forward``); defaults from ``fastvid_qwen25vl/scripts/eval.sh``).
The functions are in :mod:`mmfast.pruning._fastvid_ops`.

Algorithm (one video of F frames of n merged tokens, before the LLM):

1. Frame signals. A = the tower's last block, per head: the frame's mean query (after the vision RoPE)
   against each 2x2 merge unit's mean key, softmax over the frame's n units, mean over heads ([F, n]).
   G = the frame's mean LLM-input embedding (the merger's output), L2-normalised ([F, d]).
2. DySeg: s_f = cos(G_f, G_f+1); cuts after the c - 1 least similar pairs (``DySeg_c`` = 8) and after
   every pair with s_f < tau (``DySeg_tau`` = 0.84): segments of consecutive frames.
3. STPrune per segment of L frames: R = int(n r) L kept (r = ``retention_ratio`` = 0.27), of them
   C = max(int(R d), 1) context (``STPrune_d`` = 0.4) and R - C salient. A segment of one frame keeps R - C
   salient and C context tokens there. A longer one is cut again where s_f < ``DySeg_ignore`` (0.95) into
   V sub-segments, and only the *last* frame of each keeps tokens: the salient count split evenly over
   the V frames, the context count evenly over ceil(V / p) anchors (``DTM_p`` = 4: every p-th
   sub-segment counted from the end), an anchor's context capped at n // 2 and its salient at n minus it.
   Salient: the frame's top tokens by A. Context: of the frame's other tokens, the density peaks
   (DPC-KNN: density exp(-mean squared distance to the 4 nearest), times the distance to the nearest
   denser token; distances / sqrt(d); density + uniform noise x 1e-6 as tie-breaker).
4. DTM: for each anchor, every token of the segment that is neither salient nor one of *this anchor's*
   context tokens goes to its most cosine-similar context token; a context token becomes
   w x + (1 - w) mean(assigned), w = max(1 / (count + 1), ``DTM_beta`` = 0.6).
5. The kept tokens in their original order, each (merged or not) at its own (t, h, w) ids.

Hook points: a recorder on the tower's last block's attention through the probe wrapper
(``hooks.attach``: that block runs transformers' per-chunk attention instead of mmfast's fused one;
the release patches it to eager math); ``observe_tower`` (A per item into ``VisionBatch.extras``);
``vision_features`` (the selection and merge on ``VisionBatch.projected``, the merger's output).

Families: Qwen2-VL / Qwen2.5-VL (the release's Qwen2.5-VL code; a "frame" is a temporal patch group
of 2 frames; Qwen2-VL has no windows and the same rule applies). Refused: LLaVA-1.5 / NeXT (no video
input); LLaVA-OneVision: the release's OneVision code (``fastvid_llavaonevision/``) takes A and G from
SigLIP's attention-pooling head (a separate ``google/siglip-so400m-patch14-384`` load), which OneVision
checkpoints do not ship; Qwen3-VL: each frame group is its own vision item (DySeg spans the video).

Deviations: (a) per sample, per video, at any batch size (the release: batch 1, the first video's
``video_grid_thw`` and the slots between the prompt's start and end); images of the batch are never
touched; (b) A, the density and the merge in fp32 (the release: the model dtype; A from its
flash-attention tower patch); (c) the noise is drawn from a generator seeded with ``seed`` per video
(the release: the global RNG), so decisions do not depend on the batch or on earlier samples;
(d) DySeg takes min(c - 1, F - 1) pairs and a one-frame video is one segment (the release's ``topk``
raises when F < c); (e) the 4 nearest neighbours are min(4, candidates) (the release raises below 4).
No-op: ``retention_ratio: 1.0, tau: 2.0`` (every pair a cut: one-frame segments keep all n tokens, a
context token with nothing to absorb stays itself: the release's rule, exactly the input).
Budget (``tokens: B`` / ``ratio: r``, per video of N = F n tokens): retention_ratio = B / N, so each
frame of a one-frame segment keeps int(B / F) and a video keeps at most B (fewer where segments give
their frames to anchors under the n // 2 and n caps, as the release does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..capabilities import Capabilities, Need
from ..config import opt
from ..hooks import attach
from ..models.base import VIDEO
from ..registry import PRUNERS
from . import _received
from ._fastvid_ops import FastVIDParams, frame_attention, select_video
from ._grid import per_sample
from .base import Pruner
from .divprune import select_image_rows

ATTN_EXTRA = "fastvid.attention"  # VisionBatch.extras: per item [F, n] frame attention (None: an image)

WHY = {
    Need.VIDEO: "it segments a video's frames and prunes their tokens; use an image pruner on images",
    Need.VIDEO_ONE_ITEM: "DySeg compares consecutive frames of one video item",
    Need.DYNAMIC_GRID: "its frame attention is the release's Qwen2.5-VL rule on the tower's last block over 2x2 "
    "merge units; the release's OneVision code needs SigLIP's attention-pooling head, which OneVision "
    "checkpoints do not ship",
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
    caps = Capabilities(
        needs=frozenset({Need.VIDEO, Need.VIDEO_ONE_ITEM, Need.DYNAMIC_GRID}),
        why=WHY,
        edits_features=True,
        needs_full_grid=True,  # whole frames, each token at its raster cell
        videos_only="it segments a video's frames and prunes their tokens",
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

    @classmethod
    def noop_params(cls, adapter):
        return {"retention_ratio": 1.0, "tau": 2.0}

    @classmethod
    def test_params(cls, adapter):
        return {"retention_ratio": 0.5}

    @classmethod
    def budget_params(cls, tokens, n, adapter, config, path):
        """retention_ratio = B / N of the video."""
        return {"retention_ratio": min(1.0, tokens / n)}

    def params(self, cfg) -> FastVIDParams:
        return FastVIDParams(cfg.retention_ratio, cfg.c, cfg.tau, cfg.ignore, cfg.d, cfg.p, cfg.beta)

    def install(self) -> None:
        self._rec = _QKRecorder(self.adapter.merge**2)
        attach(self.ctx.hooks, self.adapter.vision_layers[-1].attn).recorders.append(self._rec)

    def observe_tower(self, vision) -> None:
        """The last block's queries / keys -> each video's frame attention A [F, n] (raster order)."""
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
            prm = self.params(self.config_for(t * h * w))
            kept, rows = select_video(emb, a.to(emb.device), emb.float().mean(1), prm, gen)
            vision.projected[i] = projected[i]
            select_image_rows(vision, i, kept)
            vision.projected[i] = rows.to(projected[i].dtype)
        vision.stats[self.name] = {"per_sample_kept": per_sample(vision.counts(), batch.image_owner, batch.batch_size)}
        return vision
