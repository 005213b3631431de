"""DyCoke (Tao et al., "DyCoke: Dynamic Compression of Tokens for Fast Video Large Language Models",
CVPR 2025, arXiv 2411.15024; code KD-TAO/DyCoke @dd74634, built on LLaVA-OneVision:
``llava/model/llava_arch.py`` ``dycole_ttm`` and ``llava/model/language_model/modeling_qwen2.py``
``PrunableDynamicCache``; defaults from ``lmms_eval/models/llava_onevision.py``, which ``eval.sh`` runs).

Algorithm (one video, its LLM-input tokens: after the projector and OneVision's 2x2 pooling):

1. TTM, temporal token merging before the LLM (``dycole_ttm``). The video's frame tokens form F frames
   of T tokens; k = ``dycoke_k`` (0.7), each pruned frame keeps int((1 - k) T) tokens.
   a. pairs (0, 1), (2, 3), ...: frame 2j+1 keeps its tokens least cosine-similar to the same grid cell of
      frame 2j (``topk(largest=False)``, in that ascending-similarity order); frame 2j is kept whole.
   b. windows of 4 frames, i = 0, 4, ..., < F - 4: frame i+2 keeps its tokens least similar to frame i
      (both the *unpruned* features), replacing step a's whole frame i+2; frame i+3 stays as step a left it.
   So a window of 4 keeps frame i whole and prunes frames i+1 (vs i), i+2 (vs i), i+3 (vs i+2).
2. DP, dynamic pruning during decoding (``PrunableDynamicCache``): the full cache is kept. At each decode
   step (one new token), A = the new token's attention at layer l - 1 (``dycoke_l`` = 3), head mean,
   over the video's candidate tokens (the TTM output except its last token: the release's
   ``image_token_length = len - 1``); s = cos(A, A of the previous step) (0 at the first step). If
   s < 0.9 the layers >= l attend, at this step, only the top int(n (1 - p)) candidates by A
   (p = ``dycoke_p`` = 0.8) with every non-candidate slot; otherwise (s >= 0.9) they attend the whole
   cache at this step (the release resets its index list at every layer < l, so a step whose attention
   is similar to the previous one prunes nothing). A pruned token comes back whenever a later step selects it.

Hook points: ``vision_features`` (TTM on ``VisionBatch.projected``, the adapter's ``project`` as splicing
computes it); ``attention_probe`` on layer l - 1 (the new token's row, decode only, head mean);
``llm_layer``: a layer group starting at l with the prefill layout unchanged (``SlotEdit`` with the
identity order, so layers >= l get their own mask), and ``runner.on_decode(l)`` sets that group's mask for
the step. The previous step's attention travels as the ``dycoke.attention`` tag of the state's inputs, so
beams, branches and batches carry their own.

Families: LLaVA-OneVision (the release's model: pooled frames + one closing newline, the newline is no
frame token and is never pruned) and Qwen2-VL / Qwen2.5-VL (a "frame" is a temporal patch group of 2
frames, the ``frame`` tag; kept tokens keep their (t, h, w) ids). Qwen3-VL: each frame group is its own
vision item (its own timestamp span); ``video_join`` has the session join a video's items into one for
TTM (:mod:`mmfast.pruning._video_items`) and split the kept rows back, each into its own frame group's
span with its own (t, h, w) ids (a dropped odd last group keeps an empty span); DP's "last token of the
video" is then the last kept token of its last non-empty frame group, as on one item. Refused:
LLaVA-1.5 / NeXT (no video input).

Limits and deviations: (a) T and the video's slot span come from the layout (the release hard-codes 196
tokens per frame and the video's start at slot 14); (b) per sample, per video, at any batch size (the
release is batch 1 and prunes one video); images in the same prompt are never candidates; (c) attention
in fp32 from mmfast's probe (the release computes it in the model dtype, from eager-style weights);
(d) the previous step's attention is per generation (the release's ``attention_score`` persists across
samples, so its first step compares with the last sample's last step); (e) DP acts on single-token
steps only, as the release (``position_ids.shape[1] == 1``): it declares a per-step KV edit, so
speculative drafting is refused unless ``p: 0``; the static-cache step is not used (per-step Python
decision); (f) F = 1 keeps the video whole, step b is skipped when F <= 4 (the release raises on both:
``torch.stack`` of an empty list); an odd F drops the last frame as the release does;
(g) ``k: 0`` leaves the tokens in place (the release would still reorder pruned frames by similarity);
(h) stacked after an in-LLM pruner that drops tokens before layer l - 1 (PyramidDrop, SparseVLM, ...),
the candidates are the ones layer l - 1 still attends (its own cache layout).
No-op: ``k: 0`` and ``p: 0``. DyCoke needs a video: a batch without one is refused before compute.
Budget: none (the release's own ``k`` / ``p``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import compat
from ..capabilities import Capabilities, Need
from ..config import opt
from ..hooks.attention import last_row
from ..models.base import FRAME, VIDEO
from ..registry import PRUNERS
from ..runtime import SlotEdit
from ._common import LayerMapping, map_layers
from ._grid import per_sample
from .base import Pruner
from .divprune import select_image_rows

ATTN_TAG = "dycoke.attention"  # LMInputs tag: the previous decode step's attention on each candidate slot
CANDIDATE_TAG = "dycoke.candidate"  # LMInputs tag: DP candidates (a video's tokens after TTM but its last)

WHY = {
    Need.VIDEO: "TTM merges a video's frames and DP prunes its tokens; use an image pruner on images",
    Need.VIDEO_ONE_ITEM: "TTM's 4-frame windows compare the same grid cell across the frames of one item",
}


def ttm_keep(frames: torch.Tensor, k: float) -> list[torch.Tensor]:
    """The release's ``dycole_ttm`` on one video's frames [F, T, D]: per frame, the kept token indices
    ([T_f] long, in the order the release concatenates them; empty for a dropped odd last frame)."""
    n_frames, n_tok = frames.shape[0], frames.shape[1]
    full = torch.arange(n_tok, device=frames.device)
    if n_frames < 2:
        return [full] * n_frames
    n_keep = int((1 - k) * n_tok)
    out = [full[:0]] * n_frames  # an odd last frame is not appended by the release
    for i in range(0, n_frames - 1, 2):  # a: frame i+1 against frame i
        a, b = F.normalize(frames[i], p=2, dim=1), F.normalize(frames[i + 1], p=2, dim=1)
        sim = F.cosine_similarity(a, b, dim=1)  # [T]
        out[i], out[i + 1] = full, sim.topk(n_keep, largest=False).indices
    for i in range(0, n_frames - 4, 4):  # b: frame i+2 against frame i (unpruned features)
        sim = F.cosine_similarity(frames[i], frames[i + 2], dim=1)  # [T]
        out[i], out[i + 2] = full, sim.topk(n_keep, largest=False).indices
    return out


def dp_select(attn: torch.Tensor, prev: torch.Tensor | None, p: float, threshold: float) -> torch.Tensor | None:
    """The release's per-step rule on one sample's candidate attention ``attn`` [n] (``prev``: the previous
    step's, or None): the kept candidate indices [int(n (1 - p))], or None (this step attends everything)."""
    sim = F.cosine_similarity(attn, prev, dim=0) if prev is not None else 0.0
    if not sim < threshold:  # the release updates its index list only when ``similarity < 0.9``
        return None
    return torch.topk(attn, int(attn.shape[0] * (1 - p)), sorted=False).indices


@PRUNERS.register("dycoke", description="DyCoke: temporal token merging of video frames + dynamic KV pruning per step")
class DyCoke(Pruner):
    """DyCoke."""

    hook_points = frozenset({"vision_features", "attention_probe", "llm_layer", "kv_cache"})

    @classmethod
    def capabilities(cls, params) -> Capabilities:
        dp = params is None or params.p > 0
        return Capabilities(
            needs=frozenset({Need.VIDEO, Need.VIDEO_ONE_ITEM}),
            why=WHY,
            edits_features=True,
            needs_full_grid=True,  # TTM compares the same grid cell across frames
            kv_edit_decode=dp,
            decode_free_setting="p: 0",
            dynamic_decode="DyCoke's DP chooses the attended video tokens at every step" if dp else "",
            videos_only="TTM merges a video's frames and DP prunes its tokens",
            video_join=True,  # TTM reads the video's frames in the feature stage; DP reads LLM-input tags
        )

    @dataclass(frozen=True)
    class Config:
        k: float = opt(0.7, lo=0.0, hi=1.0, doc="TTM: fraction of a pruned frame's tokens dropped (release dycoke_k)")
        l: int = opt(3, lo=1, doc="DP: layers >= l attend the selected tokens; attention from layer l - 1 (dycoke_l)")  # noqa: E741
        p: float = opt(0.8, lo=0.0, hi=1.0, doc="DP: fraction of the video's tokens pruned per step (dycoke_p)")
        threshold: float = opt(0.9, lo=-1.0, hi=2.0, doc="DP: re-select only when cos(A_t, A_t-1) < this (release 0.9)")
        layer_mapping: LayerMapping = opt("absolute", doc="absolute (release: 3 of Qwen2-7B's 28), or proportional")

    @classmethod
    def noop_params(cls, adapter):
        return {"k": 0.0, "p": 0.0}

    @classmethod
    def test_params(cls, adapter):
        return {"l": 2}

    # -- TTM ------------------------------------------------------------------------------------------
    def prune_vision(self, vision, batch):
        counts_before = vision.counts()
        videos = vision.tags.get(VIDEO)
        if videos is not None and self.config.k > 0:
            projected = self.adapter.project(vision)  # [N_i, d] each, as splicing would compute them
            for i, vid in enumerate(videos):
                if bool((vid > 0).any()):
                    vision.projected[i] = projected[i]
                    select_image_rows(vision, i, self._ttm_rows(vision, i))
        kept = per_sample(vision.counts(), batch.image_owner, batch.batch_size)
        before = per_sample(counts_before, batch.image_owner, batch.batch_size)
        vision.stats[self.name] = {"per_sample_before_ttm": before, "per_sample_kept": kept}
        return vision

    def _ttm_rows(self, vision, i: int) -> torch.Tensor:
        """Rows of item i (a whole video) that TTM keeps: its frame tokens in the release's order, then
        its non-frame tokens (OneVision's closing newline, patch id -1) where they were."""
        pid = vision.patch_ids[i].to(vision.projected[i].device)
        frame = vision.tags[FRAME][i].to(pid.device)
        real = (pid >= 0).nonzero().squeeze(1)  # [M] frame tokens, frame-major
        _, per = frame[real].unique_consecutive(return_counts=True)  # tokens of each frame, in order
        n_tok, n_frames = int(per[0]), per.numel()
        if bool((per != n_tok).any()):  # needs_full_grid keeps earlier token edits out
            raise RuntimeError(f"dycoke: the video's frames hold {per.tolist()} tokens; TTM needs whole frames")
        feats = vision.projected[i][real].reshape(n_frames, n_tok, -1)  # [F, T, d]
        per_frame = ttm_keep(feats, self.config.k)
        rows = torch.cat([real[f * n_tok + idx] for f, idx in enumerate(per_frame)])
        return torch.cat([rows, (pid < 0).nonzero().squeeze(1)])  # the newline closes the video

    # -- DP -------------------------------------------------------------------------------------------
    def install(self) -> None:
        cfg = self.config
        if cfg.p <= 0:
            return
        ((layer, _),) = map_layers([cfg.l], len(self.adapter.layers), cfg.layer_mapping, param="l")
        self.layer = layer
        self.probe_name = f"dycoke.{layer - 1}"
        self.ctx.probe.watch(
            self.probe_name,
            self.adapter.layers[layer - 1].self_attn,
            rows=last_row,
            when=lambda q, k: q == 1,
            reduce="mean",
        )
        self.ctx.runner.prune_at(layer, self._split)
        self.ctx.runner.on_decode(layer, self._decode_step)

    def _split(self, view) -> SlotEdit:
        """A layer group at l with the prefill layout unchanged (its mask is set per decode step), and
        the DP candidates tagged on the state's inputs."""
        state = view.state
        inputs = state.inputs
        video = inputs.tags.get(VIDEO, torch.zeros_like(inputs.patch_ids))
        cand = (video > 0) & inputs.image_mask & (inputs.patch_ids >= 0)  # [B, L] frame tokens
        pos = torch.arange(cand.shape[1], device=cand.device).expand_as(cand)
        last = torch.where(cand, pos, -1).max(1, keepdim=True).values  # [B, 1] the video's last token
        cand &= pos != last  # the release's image_token_length = len - 1
        state.inputs = dataclasses.replace(inputs, tags={**inputs.tags, CANDIDATE_TAG: cand})
        n = cand.sum(1).tolist()
        state.stats[self.name] = {
            "layer": self.layer,
            "per_sample_candidates": n,
            "per_sample_dp_kept": [int(c * (1 - self.config.p)) for c in n],
            "per_sample_pruned_steps": [0] * len(n),
        }
        order = torch.arange(view.vision.shape[1], device=cand.device, dtype=torch.float64).expand(cand.shape[0], -1)
        return SlotEdit(keep=torch.ones_like(view.vision), order=order)

    def _decode_step(self, layer: int, hidden: torch.Tensor, state) -> None:
        if hidden.shape[1] != 1 or CANDIDATE_TAG not in state.inputs.tags:
            return
        cfg = self.config
        # the layout layer l - 1 attends: an earlier stage (PyramidDrop, SparseVLM) may have dropped slots
        grp0 = state.groups[state.group_of(self.layer - 1)]
        probs = self.ctx.probe[self.probe_name].probs[:, 0, : grp0.length]  # [B, T0] head-mean, fp32
        inputs = state.inputs
        src0 = grp0.source.clamp(min=0)  # [B, T0] prompt slot of each cache slot
        cand0 = inputs.tags[CANDIDATE_TAG].gather(1, src0) & (grp0.source >= 0) & grp0.key_mask  # [B, T0]
        prev = inputs.tags.get(ATTN_TAG)  # [B, L] or None at the first step
        new = torch.zeros(inputs.image_mask.shape, dtype=torch.float32, device=probs.device)  # [B, L]
        drop = torch.zeros_like(inputs.image_mask)  # [B, L] candidates not attended at this step
        pruned = state.stats.get(self.name, {}).get("per_sample_pruned_steps")
        if pruned is not None and len(pruned) != probs.shape[0]:  # beams / branches: rows are not samples
            pruned = None
        for b in range(probs.shape[0]):
            slots = src0[b][cand0[b]]  # [n] prompt slots, in order
            if slots.numel() == 0:
                continue
            attn = probs[b][cand0[b]]  # [n]
            new[b, slots] = attn
            keep = dp_select(attn, None if prev is None else prev[b, slots].float(), cfg.p, cfg.threshold)
            if keep is not None:
                drop[b, slots] = True
                drop[b, slots[keep]] = False
                if pruned is not None:
                    pruned[b] += 1
        state.inputs = dataclasses.replace(inputs, tags={**inputs.tags, ATTN_TAG: new})
        grp = state.groups[state.group_of(self.layer)]
        src = grp.source.clamp(min=0)
        attend = grp.key_mask & ~(drop.gather(1, src) & (grp.source >= 0))  # [B, T_g]
        impl = self.adapter.text_config._attn_implementation
        grp.fwd_mask = compat.format_mask(attend[:, None, None, :], impl, hidden.dtype)  # [B, 1, 1, T_g]
