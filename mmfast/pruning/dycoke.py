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
speculative drafting is refused unless ``p: 0``; (f) F = 1 keeps the video whole, step b is skipped when
F <= 4 (the release raises on both: ``torch.stack`` of an empty list); an odd F drops the last frame as the
release does;
(g) ``k: 0`` leaves the tokens in place (the release would still reorder pruned frames by similarity);
(h) stacked after an in-LLM pruner that drops tokens before layer l - 1 (PyramidDrop, SparseVLM, ...),
the candidates are the ones layer l - 1 still attends (its own cache layout).
No-op: ``k: 0`` and ``p: 0``. DyCoke needs a video: a batch without one is refused before compute.
Budget: none (the release's own ``k`` / ``p``).

Captured steps: DP's step (:func:`dp_step`) is tensor work in fixed shapes, no host read: the candidates'
attention, the similarity to the previous step's, the top ``int(n (1 - p))`` by rank (a sort, where the release
takes ``topk``: the same set but for exact ties at the cut) and the mask of layers >= l, applied to the step's own
mask. On a static cache its inputs (candidates, slot maps, the kept counts, the previous attention) are staged before
each step in fixed memory padded to the buffers (``Carried.before_step``), so ``model.compile: auto`` captures the
decode step with DP inside; the new attention and whether the step pruned are carried out of it and recorded after
the step (the pruned-step counts stay on the device until the call's stats are read).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import compat
from ..capabilities import Capabilities, Need
from ..config import opt
from ..hooks.attention import Carried, last_row, replayable, staged_copy
from ..models.base import FRAME, VIDEO
from ..registry import PRUNERS
from ..runtime import SlotEdit
from ._common import LayerMapping, map_layers
from ._grid import per_sample
from .base import Pruner
from .divprune import select_image_rows

ATTN_TAG = "dycoke.attention"  # LMInputs tag: the previous decode step's attention on each candidate slot
CANDIDATE_TAG = "dycoke.candidate"  # LMInputs tag: DP candidates (a video's tokens after TTM but its last)
_RESULT = "dycoke.step"  # LMState.extras: a decode step's DPResult, from the step (or its graph) to its end
_STAGED = "dycoke.staged"  # LMState.extras: a static step's DPInputs in fixed memory, staged before the step

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


@dataclass(frozen=True)
class DPInputs:
    """What a DP step reads besides the attention row, laid out on layer l - 1's S0 slots and layer l's S slots."""

    cand: torch.Tensor  # [B, S0] bool: the slot holds a candidate
    src: torch.Tensor  # [B, S0] long: its prompt slot (0 where none)
    dst: torch.Tensor  # [B, S] long: the prompt slot of each of layer l's slots (-1: none)
    k: torch.Tensor  # [B, 1] long: the candidates a re-selecting step keeps, int(n (1 - p))
    prev: torch.Tensor  # [B, P] float32: the previous step's attention at each prompt slot (0: none); P >= L
    has_prev: torch.Tensor  # [B, 1] bool: there was a previous step


@dataclass(frozen=True)
class DPResult:
    attention: torch.Tensor  # [B, P] float32: this step's attention at the candidates' prompt slots (0 elsewhere)
    pruned: torch.Tensor  # [B] bool: the step re-selected (layers >= l attend the kept candidates only)


def dp_step(probs: torch.Tensor, dp: DPInputs, threshold: float) -> tuple[torch.Tensor, DPResult]:
    """The release's per-step rule for every row at once in fixed shapes (no host read): a row whose candidates'
    attention (``probs`` [B, S0], the new token's head-mean attention over layer l - 1's slots) has a cosine
    similarity below ``threshold`` with the previous step's (none: 0) keeps its top ``int(n (1 - p))`` candidates
    and drops the rest; otherwise it attends everything. Returns which of layer l's slots the step drops ([B, S]
    bool) and its result."""
    bsz, width = dp.prev.shape  # P: the prompt's slots, padded to a capacity on a static cache
    attn = torch.where(dp.cand, probs.float(), torch.zeros_like(probs, dtype=torch.float32))  # [B, S0]
    new = attn.new_zeros(bsz, width).scatter_add(1, dp.src, attn)  # [B, P] (0 outside the candidates)
    prev = dp.prev.gather(1, dp.src) * dp.cand  # [B, S0] the previous step's, at the same candidates
    sim = torch.where(dp.has_prev[:, 0], F.cosine_similarity(attn, prev, dim=1), torch.zeros_like(attn[:, 0]))
    pruned = (sim < threshold) & dp.cand.any(1)  # [B]
    order = torch.where(dp.cand, attn, torch.full_like(attn, -1.0)).argsort(dim=1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(
        1, order, torch.arange(order.shape[1], device=order.device).expand_as(order)
    )
    drop = dp.cand & (rank >= dp.k) & pruned[:, None]  # [B, S0] candidates left out at this step
    drop_prompt = torch.zeros_like(new).scatter_add(1, dp.src, drop.float()) > 0  # [B, P]
    out = drop_prompt.gather(1, dp.dst.clamp(min=0)) & (dp.dst >= 0)  # [B, S]
    return out, DPResult(new, pruned)


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
    @classmethod
    def check_facts(cls, config, facts) -> None:
        """DP's layer l must exist in this LLM (checked from the config, before weights load; p = 0: no DP)."""
        if config.p > 0:
            map_layers([config.l], facts.llm_layers, config.layer_mapping, param="l")

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
            decode_replayable=True,  # a captured decode step replays it
        )
        runner = self.ctx.runner
        runner.prune_at(layer, self._split)
        # tensor work only (a captured step replays it): its result carried out of the step, recorded after it
        self._memory: dict[tuple, torch.Tensor] = {}  # a static step's staged inputs (fixed memory)
        active = lambda: runner.active  # noqa: E731
        carried = Carried(
            lambda: active().extras.get(_RESULT),
            lambda result: active().extras.__setitem__(_RESULT, result),
            before_step=self._stage,
        )
        runner.on_decode(layer, replayable(self._decode_step, carried))
        runner.step_hooks.append(self._record)

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

    def _inputs(self, state, s0: int, s: int, width: int) -> DPInputs:
        """:class:`DPInputs` of ``state`` with layer l - 1's slots padded to ``s0``, layer l's to ``s`` and the prompt's
        to ``width`` (>= L)."""
        grp0 = state.groups[state.group_of(self.layer - 1)]  # an earlier stage may have dropped slots there
        grp = state.groups[state.group_of(self.layer)]
        pad = torch.nn.functional.pad
        src0 = pad(grp0.source, (0, s0 - grp0.length), value=-1)  # [B, S0]
        valid0 = pad(grp0.key_mask, (0, s0 - grp0.length), value=False)
        tags = state.inputs.tags
        cand = tags[CANDIDATE_TAG].gather(1, src0.clamp(min=0)) & (src0 >= 0) & valid0  # [B, S0]
        # int(n (1 - p)) as the host computes it: a double product, truncated
        k = (cand.sum(1, keepdim=True).double() * (1 - self.config.p)).long()  # [B, 1]
        prev = tags.get(ATTN_TAG)
        has = torch.full((cand.shape[0], 1), prev is not None, device=cand.device)
        n_prompt = tags[CANDIDATE_TAG].shape[1]
        prev = torch.zeros(cand.shape[0], n_prompt, device=cand.device) if prev is None else prev.float()  # [B, L]
        prev = pad(prev, (0, width - n_prompt))  # [B, P]
        dst = pad(grp.source, (0, s - grp.length), value=-1)  # [B, S]
        return DPInputs(cand, src0.clamp(min=0), dst, k, prev, has)

    def _stage(self, state) -> tuple:
        """``Carried.before_step``: a static step's inputs copied into fixed memory (padded to the buffers)."""
        if CANDIDATE_TAG not in state.inputs.tags:  # no prefill through layer l: the step does nothing here
            return ("dycoke", None)
        s0 = compat.static_capacity(state.cache, state.groups[state.group_of(self.layer - 1)].start)
        s = compat.static_capacity(state.cache, state.groups[state.group_of(self.layer)].start)
        # the prompt's slots padded to group 0's capacity (>= L): a graph replayed for a longer prompt on the
        # same buffers reads the memory it was captured on
        fresh = self._inputs(state, s0, s, compat.static_capacity(state.cache, 0))
        staged = {
            name: staged_copy(self._memory, (name, *t.shape, t.device), t, t.device) for name, t in vars(fresh).items()
        }
        state.extras[_STAGED] = DPInputs(**staged)  # what the step reads (a captured one: this memory)
        return ("dycoke",)

    def _decode_step(self, layer: int, hidden: torch.Tensor, state) -> None:
        """At layer l in a one-token step: which video tokens layers >= l attend (:func:`dp_step`), as their group's
        mask for this step. Tensor work only; on a static cache it reads the inputs staged before the step."""
        if hidden.shape[1] != 1 or CANDIDATE_TAG not in state.inputs.tags:
            return
        probs = self.ctx.probe[self.probe_name].probs[:, 0]  # [B, S0] head-mean, fp32
        grp = state.groups[state.group_of(self.layer)]
        if compat.is_static(state.cache):
            dp = state.extras[_STAGED]
        else:
            dp = self._inputs(state, probs.shape[-1], grp.fwd_mask.shape[-1], state.inputs.input_ids.shape[1])
        drop, result = dp_step(probs, dp, self.config.threshold)
        impl = self.adapter.text_config._attn_implementation
        grp.fwd_mask = compat.mask_out(grp.fwd_mask, drop[:, None, None, :], impl)  # [B, 1, 1, S]
        state.extras[_RESULT] = result

    def _record(self, state) -> None:
        """After a step: its attention becomes the next step's previous one; a re-selecting step is counted (on the
        device, read with the call's stats; beams and branches, whose rows are not samples, are not counted)."""
        result = state.extras.pop(_RESULT, None)
        if result is None:
            return
        attention = result.attention[:, : state.inputs.input_ids.shape[1]]  # [B, L]: a per-token tag
        state.inputs = dataclasses.replace(state.inputs, tags={**state.inputs.tags, ATTN_TAG: attention})
        mine = state.stats.get(self.name, {})
        pruned = mine.get("per_sample_pruned_steps")
        if pruned is not None and len(pruned) == result.pruned.shape[0]:
            mine["per_sample_pruned_steps"] = torch.as_tensor(pruned, device=result.pruned.device) + result.pruned
