"""DART (Wen et al., "Stop Looking for Important Tokens in Multimodal Language Models: Duplication
Matters More", arXiv 2502.11494; code ZichenWen1/DART, ``llava/model/language_model/modeling_llama_self.py``,
read through its public fork xqy1111111/DART, whose history is the upstream's).

Algorithm (at the input of LLM layer K, K = 2 in the release, per image):

1. Pivots: the ``pivot_image`` image tokens and the ``pivot_text`` tokens after the image (instruction
   and assistant prompt) with the largest L1 norm of their layer K-1 keys (after RoPE, all heads
   concatenated, as the release's sdpa path returns them).
2. Features for duplication: the hidden states entering layer K passed through the LLM's *final*
   RMSNorm (the release applies ``self.norm``, the model's last norm, to layer K-1's output).
3. For each pivot in turn: among the image tokens not chosen yet (image pivots excluded), keep the
   ``t`` tokens *least* cosine-similar to the pivot (the release takes ``topk`` of the negated
   cosine: tokens duplicating a pivot are the ones dropped), then remove them from the candidates.
4. Kept image tokens: the image pivots plus every token picked in 3 (text pivots are text and stay
   anyway); all text is kept. t = M // (pivot_image + pivot_text), so an image keeps
   ``pivot_image + (pivot_image + pivot_text) * t`` tokens.

M is ``truncation`` (the release's ``max_num_trunction``, 128 in its LLaVA-1.5 scripts; for LLaVA-NeXT
its ``retain_token_num_for_llava_next``, 320, capped at N - pivot_image), or N (1 - ``drop_ratio``) (the
release's ``reduction_ratio``, a fraction *dropped*, used when no truncation is given; the old name
``ratio`` is refused with the new spelling).

LLaVA-NeXT: the release counts every image token between the prompt's text parts, the row-separator
``image_newline`` tokens included, as candidates (``image_token_length = len - text_length``); mmfast
does the same (every vision slot of the image is a candidate).

Positions: kept tokens keep their original position ids (the release sets ``position_ids =
keep_indexs``). KV cache: layers >= K cache only the kept tokens (static after prefill).
Cost on a GPU: with ``preset: sequence`` each image's selection (pivots, then each pivot's least duplicated free
tokens) runs in fixed shapes with no host read (:func:`dart_keep`: missing pivots and picks masked out of the
top-k), one captured call per image where the session captures (``MethodContext.captured``); ``preset: release``
orders the pivots with a CPython ``set`` on the host and stays eager.
Hook points: a key recorder on layer K-1's attention (``hooks.attach(...).prefill_recorders``: prefill only, so a static decode step can be captured; the L1 norms
travel in the state's ``extras``; what it computes depends on shapes only, so a captured prefill segment
replays it and puts its result back, ``hooks.Carried``); ``llm_layer`` (``runner.prune_at``).

Pivot order (the order matters: each pivot removes its picks from the later pivots' candidates):
``preset: sequence`` (default) visits the pivots in ascending sequence order; ``preset: release``
visits them as the release does, in the iteration order of ``list(set(image_pivots + text_pivots))``
over their sequence indices (each group in descending key-norm order, the image pivots first; the
index of a token is its index in the sample's unpadded prefill sequence, as in the release's batch of
one), computed with the same CPython ``set``. The two keep different tokens on a part of the samples.

Deviations from the release: (a) with ``preset: sequence``, the pivot order above; with either preset,
ties of the cosine are broken by slot order (the release's candidates are a ``list(set(...))``); (b) every image of every sample
is reduced on its own (the release: batch 1, one image at a fixed offset of 35 tokens); with several
images the text pivots are the tokens after the last image; (c) M is capped at N - pivot_image on
LLaVA-1.5 too (the release caps it only for NeXT; beyond it its ``topk`` would fail); (d) cosine
similarities and the keys' L1 norms in fp32 (the release: the model dtype).
Qwen-VL families (qwen2_vl, qwen2_5_vl, qwen3_vl): supported. The release has Qwen2-VL and
Qwen2.5-VL code (``Qwen2-VL/``, ``Qwen2_5-VL/`` with their lmms-eval wrappers): the same rule at K = 2
with 4 + 4 pivots, but its ``get_retained_image_token`` never reads ``max_num_trunction`` (128 in the
eval scripts): t = int(N (1 - reduction_ratio) / (pivot_image + pivot_text)), ``reduction_ratio`` 0.778 by
its wrappers' default; its candidates are an image's ``<|image_pad|>`` span (from the first pad to
``<|vision_end|>``), batch 1. mmfast's default there is M = N_i (1 - 0.778) per image (Qwen3-VL: no
release; the Qwen2/2.5 value), capped at N_i - pivot_image; kept tokens keep
their original (t, h, w) ids, as FastV under M-RoPE; Qwen3-VL's deepstack features follow the kept
slots (runtime). The release's Qwen key norms are of the keys after M-RoPE (its attention classes
return them so), as mmfast's (Qwen2-VL's after ``repeat_kv``, Qwen2.5-VL's before: a constant factor).
LLaVA-OneVision: supported (not in the release). Every slot of an image's packed span (base view,
mosaic, newlines) is a candidate, as on LLaVA-NeXT. The release has no M for it; mmfast's default
is LLaVA-1.5's 128 of 576 as a fraction of each image: M_i = N_i x 128 / 576 (capped at
N_i - pivot_image); a budget is mapped per image (below).

No-op: ``drop_ratio`` 0 with no ``truncation`` drops nothing (the release's run without ``--sparse``).

Budget (``budget: {tokens: B}`` or ``{ratio: r}``, layer-averaged vision tokens per image, as FastV):
with K of an L-layer LLM and an image of N vision tokens (its own count, on every family),
keep = round((L B - K N) / (L - K)) (refused below ceil(K N / L)), then
t = max(0, round((keep - pivot_image) / (pivot_image + pivot_text))) and ``truncation`` =
t (pivot_image + pivot_text): the kept count is within (pivot_image + pivot_text) / 2 of keep (when
keep >= pivot_image); keep = N maps to the no-op (``drop_ratio`` 0: every token kept). Where images
have different counts (LLaVA-NeXT, OneVision, Qwen-VL) this is computed per image from its N
(``_budget.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Literal

import torch

from ..capabilities import Capabilities
from ..config import opt
from ..hooks import Carried, attach
from ..models.captured_tower import eager_call
from ..registry import PRUNERS
from ._budget import in_llm_keep_at
from ._common import LayerMapping, image_counts, keep_only, map_layers
from .base import Pruner

#: the release's M per tile packing (``ModelFeatures.tiles``): max_num_trunction for untiled images
#: (LLaVA-1.5; not Qwen-VL, whose release code reads reduction_ratio instead: ``RELEASE_QWEN_DROP``),
#: retain_token_num_for_llava_next for anyres tiles; anyres-max (OneVision): none (``per_pivot``)
RELEASE_TRUNCATION = {"none": 128, "anyres": 320}
#: the release's Qwen2-VL / Qwen2.5-VL default reduction_ratio (its lmms-eval wrappers; M = N (1 - it))
RELEASE_QWEN_DROP = 0.778


def release_pivot_order(pivots: torch.Tensor, seq_index: torch.Tensor) -> torch.Tensor:
    """``pivots`` [P] slots (image pivots, then text pivots, each by descending key norm) in the order
    the release visits them: CPython's iteration order of the ``set`` of their sequence indices
    (``seq_index`` [T], each slot's index in the unpadded sequence)."""
    seq = seq_index[pivots].tolist()
    slot_of = dict(zip(seq, pivots.tolist()))
    return torch.tensor([slot_of[i] for i in set(seq)], dtype=pivots.dtype, device=pivots.device)


def dart_keep(
    features: torch.Tensor,
    key_l1: torch.Tensor,
    image: torch.Tensor,
    text: torch.Tensor,
    pivot_image: int,
    pivot_text: int,
    per_pivot: int,
    seq_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """DART's rule on one image of one sample: ``features`` [T, d] (final-normed hidden states), ``key_l1`` [T],
    ``image`` / ``text`` [T] bool the image's slots and the text pivots' candidates. Pivots are visited in
    ascending slot order, or in the release's order when ``seq_index`` [T] (each slot's sequence index) is given.
    Returns the kept image slots, a [T] bool mask. In slot order it runs in fixed shapes with no host read (a
    captured selection's): fewer candidates than a count (pivots, picks) are masked out of the top-k (-inf)
    instead of shrinking it; the release's order is a CPython ``set``'s, read on the host (eager only)."""
    t_len = features.shape[0]
    neg = float("-inf")
    img_val, img_piv = key_l1.masked_fill(~image, neg).topk(min(pivot_image, t_len))  # [Pi]
    txt_val, txt_piv = key_l1.masked_fill(~text, neg).topk(min(pivot_text, t_len))  # [Pt]
    pivots, ok = torch.cat([img_piv, txt_piv]), torch.cat([img_val, txt_val]) > neg  # [P] each
    if seq_index is None:
        slot = torch.where(ok, pivots, t_len + torch.arange(pivots.numel(), device=pivots.device))
        order = slot.argsort()  # valid pivots in ascending slot order, the missing ones after them
        pivots, ok = pivots[order], ok[order]
    else:
        pivots = release_pivot_order(pivots[ok], seq_index)
        ok = torch.ones_like(pivots, dtype=torch.bool)
    feats = features.float()
    kept = torch.zeros(t_len, dtype=torch.bool, device=features.device).scatter(0, img_piv, img_val > neg)
    free = ~kept  # image pivots are kept, never picked
    n_pick = min(per_pivot, t_len)
    for i in range(pivots.numel() if n_pick else 0):
        pivot = feats.index_select(0, pivots[i : i + 1])  # [1, d] (no host read of the slot)
        sim = torch.nn.functional.cosine_similarity(pivot, feats, dim=-1)  # [T]
        vals, picked = (-sim).masked_fill(~(image & free), neg).topk(n_pick)  # least duplicated of the free
        mark = torch.zeros_like(kept).scatter(0, picked, (vals > neg) & ok[i])  # [T]
        kept, free = kept | mark, free & ~mark
    return kept


@PRUNERS.register("dart", description="DART: keep image tokens least duplicated of key-norm pivots at LLM layer K")
class DART(Pruner):
    """DART."""

    hook_points = frozenset({"llm_layer"})
    # vision slots of the spliced sequence; M-RoPE: kept tokens keep their (t, h, w) ids
    caps = Capabilities()

    @dataclass(frozen=True)
    class Config:
        k: int = opt(2, lo=1, doc="prune at the input of layer K (index on a 32-layer LLM, see layer_mapping)")
        pivot_image: int = opt(4, lo=0, doc="image pivot tokens (largest key L1 norm), kept")
        pivot_text: int = opt(4, lo=0, doc="text pivot tokens after the image (largest key L1 norm)")
        truncation: int | None = opt(
            None,
            lo=0,
            doc="M: tokens picked for all pivots together (None: release default per family, unless drop_ratio)",
        )
        drop_ratio: float | None = opt(
            None,
            lo=0.0,
            hi=1.0,
            doc="the release's reduction_ratio (fraction DROPPED): M = N (1 - drop_ratio) when truncation is not set",
        )
        layer_mapping: LayerMapping = opt("absolute", doc="absolute, or proportional to the LLM depth")
        preset: Literal["sequence", "release"] = opt(
            "sequence",
            doc="pivot order: sequence (ascending); release: the release's set iteration order of their sequence indices",
        )

        def __post_init__(self) -> None:
            if self.pivot_image + self.pivot_text == 0:
                raise ValueError(
                    "pivot_image + pivot_text is 0: M is split among the pivots, so every image token would be "
                    "dropped at layer K; give at least one pivot (the release: 4 + 4)"
                )

        _renamed = (
            (
                "ratio",
                "DART's 'ratio' was the release's reduction_ratio, the fraction DROPPED; write drop_ratio: R, "
                "truncation: M, or a budget: {ratio: r} for the fraction KEPT",
            ),
        )

    budget_knobs = ("truncation", "drop_ratio")

    @classmethod
    def noop_params(cls, adapter):
        return {"drop_ratio": 0.0}

    @classmethod
    def budget_params(cls, tokens, n, adapter, config, path):
        """truncation = t (pivot_image + pivot_text), t from keep for an image of n tokens (module docstring)."""
        keep = in_llm_keep_at(tokens, n, adapter, config.k, config.layer_mapping, path)
        if keep >= n:  # every token: the no-op (pivots plus whole multiples of them can fall short of n)
            return {"truncation": None, "drop_ratio": 0.0}
        pivots = config.pivot_image + config.pivot_text
        per_pivot = max(0, round((keep - config.pivot_image) / pivots)) if pivots else 0
        return {"truncation": per_pivot * pivots}

    @classmethod
    def test_params(cls, adapter):
        return {"pivot_image": 2, "pivot_text": 2, "truncation": 4}

    @classmethod
    def check_facts(cls, config, facts) -> None:
        map_layers([config.k], facts.llm_layers, config.layer_mapping, param="k")

    def is_noop(self) -> bool:
        return self.budget_rule is None and self.config.truncation is None and self.config.drop_ratio == 0.0

    def install(self) -> None:
        cfg = self.config
        if self.is_noop():
            return
        ((layer, paper),) = map_layers([cfg.k], len(self.adapter.layers), cfg.layer_mapping, param="k")
        self.layer = layer
        runner, slot = self.ctx.runner, f"key_l1.{layer - 1}"

        def record(module, query, key, attention_mask, scaling) -> None:
            self._record_keys(module, query, key, attention_mask, scaling)

        # shapes decide what it computes: a captured prefill segment replays it and puts its result back
        record.mmfast_replayable = Carried(  # type: ignore[attr-defined]
            lambda: runner.active.extras.get(self.name, {}).get(slot),
            lambda keys: runner.active.extras.setdefault(self.name, {}).__setitem__(slot, keys),
        )
        attach(self.ctx.hooks, self.adapter.layers[layer - 1].self_attn).prefill_recorders.append(record)
        runner.prune_at(layer, self.select, ref_layer=paper)

    def _record_keys(self, module, query, key, attention_mask, scaling) -> None:
        state = self.ctx.runner.active
        if state is None or query.shape[2] != key.shape[2] or query.shape[2] < 2:
            return  # prefill only (no cache before it): decode and verify steps are not pruned
        groups = (
            query.shape[1] // key.shape[1]
        )  # the release's keys are repeat_kv'd: each KV head counts `groups` times
        state.extras.setdefault(self.name, {})[f"key_l1.{self.layer - 1}"] = (
            key.float().abs().sum((1, 3)) * groups
        )  # [B, T]

    def keeps_all(self, n: int) -> bool:
        """Whether an image of ``n`` tokens keeps all of them: ``drop_ratio`` 0 with no ``truncation`` (the
        no-op; a budget of every token maps there)."""
        cfg = self.config_for(n)
        return cfg.truncation is None and cfg.drop_ratio == 0.0

    def per_pivot(self, n: int) -> int:
        cfg = self.config_for(n)  # a budget's truncation for this image's own count
        pivots = cfg.pivot_image + cfg.pivot_text
        if cfg.truncation is not None:
            m = cfg.truncation
        elif cfg.drop_ratio is not None:
            m = n * (1 - cfg.drop_ratio)
        elif self.adapter.features.patch_grid == "dynamic":  # Qwen-VL: the release's reduction_ratio (docstring)
            m = n * (1 - RELEASE_QWEN_DROP)
        elif self.adapter.features.tiles in RELEASE_TRUNCATION:
            m = RELEASE_TRUNCATION[self.adapter.features.tiles]
        else:  # OneVision: no release value; LLaVA-1.5's 128 of 576 as a fraction of each image (docstring)
            m = n * RELEASE_TRUNCATION["none"] / 576
        m = min(m, n - min(cfg.pivot_image, n))
        return int(m // pivots) if pivots else 0

    def select(self, view):
        cfg = self.config
        key_l1 = view.state.extras.get(self.name, {}).get(f"key_l1.{self.layer - 1}")
        if key_l1 is None or key_l1.shape[1] != view.hidden.shape[1]:
            raise RuntimeError(f"dart: layer {self.layer - 1}'s keys were not recorded for this prefill")
        feats = self.adapter.language_model.norm(view.hidden)  # [B, T, d] the release's self.norm(...)
        src = view.group.source
        image = view.images  # [B, T] image of each vision slot, -1 elsewhere
        seq_index = None
        if cfg.preset == "release":  # each slot's index in its sample's unpadded prefill sequence
            seq_index = (view.state.inputs.attention_mask.long().cumsum(1) - 1).gather(1, src.clamp(min=0))  # [B, T]
        kept = torch.zeros_like(view.vision)
        # each image's selection: a captured call where the session captures (the release's set order: eager)
        run = self.ctx.captured if seq_index is None else eager_call
        # [B][J], one read (no image: a branch's image-free prompt, nothing to select)
        for b, row in enumerate(image_counts(image)):
            for j, n in enumerate(row):
                if n == 0:
                    continue
                if self.keeps_all(n):
                    kept[b] |= image[b] == j
                    continue
                t = self.per_pivot(n)
                fn = partial(
                    dart_keep,
                    pivot_image=cfg.pivot_image,
                    pivot_text=cfg.pivot_text,
                    per_pivot=t,
                    seq_index=None if seq_index is None else seq_index[b],
                )
                static = ("dart", cfg.pivot_image, cfg.pivot_text, t)
                kept[b] |= run(static, fn, feats[b], key_l1[b], image[b] == j, view.text_after[b])
        view.state.stats[self.name] = {"per_sample_kept": kept.sum(1).tolist(), "layer": self.layer}
        return keep_only(view.vision, kept)
