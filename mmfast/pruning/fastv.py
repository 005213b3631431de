"""FastV (Chen et al., "An Image is Worth 1/2 Tokens After Layer 2", ECCV 2024, arXiv 2403.06764).

Algorithm: at the input of LLM layer K (default 2), rank every image token by the attention the
*last* prompt token pays to it in layer K-1 (mean over heads; the released code uses the last token,
not the average attention the paper's text describes, FastV issue #14), keep the top ``keep`` of each
image (or ``(1-R) * N`` of each image, R = 50% by default) and drop the rest from the sequence for
layers >= K. ``keep`` is per image (a multi-image prompt keeps ``keep`` tokens of every image, each
image ranked on its own; with one image this is the released per-sample top-k).

Budget (``budget: {tokens: B}``, layer-averaged equivalent vision tokens per image; sets ``keep``,
``ratio`` must not be given): with the mapped layer K of an L-layer LLM and N vision tokens per image,
B = (K * N + (L - K) * keep) / L, so keep = round((L * B - K * N) / (L - K)); the average lands within
(L - K) / (2 L) tokens of B. B < ceil(K * N / L) (keep < 0) is refused, naming that smallest budget.
On families whose images have different token counts and whose adapter sets
``budget_scales_with_tokens`` (LLaVA-OneVision), N is the base view's count N0 and the budget maps to
``ratio = 1 - keep / N0`` instead, so an image of N_i tokens keeps round(N_i * keep / N0) and its
layer-averaged budget is B * N_i / N0.

Dynamic resolution (Qwen-VL): a budget B keeps ratio = 1 - keep_ref / 576 of each image, keep_ref
the formula above at N = 576 (``_budget.py``); ``keep`` stays an absolute per-image count.

Positions: the in-place variant keeps each kept token's original position id (under M-RoPE its
original (t, h, w) ids, the in-place rule applied per axis; no official Qwen-VL FastV code was
checked). KV cache: layers >= K cache only the kept tokens; pruning is static after prefill (as the
released KV-cache variant).
Hook points: attention probe on layer K-1 (last query row only, O(keys)); layer pre-hooks >= K.
Limits: none on batch size (per-sample top-k with left padding); needs no eager attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..capabilities import Capabilities
from ..config import opt
from ..hooks import last_row
from ..registry import PRUNERS
from ._budget import budget_fraction, in_llm_keep_at
from ._common import LayerMapping, keep_only, map_layers, topk_keep
from .base import Pruner


@PRUNERS.register("fastv", description="FastV: drop image tokens least attended by the last token after layer K")
class FastV(Pruner):
    """FastV."""

    hook_points = frozenset({"attention_probe", "llm_layer"})
    caps = Capabilities()  # acts on the spliced sequence, any vision layout; M-RoPE: kept ids

    @dataclass(frozen=True)
    class Config:
        k: int = opt(2, lo=1, doc="prune at the input of layer K (index on a 32-layer LLM, see layer_mapping)")
        ratio: float = opt(0.5, lo=0.0, hi=1.0, doc="R: fraction of image tokens dropped (paper: 50%)")
        keep: int | None = opt(None, lo=0, doc="vision tokens kept per image (overrides ratio)")
        layer_mapping: LayerMapping = opt("absolute", doc="absolute, or proportional to the LLM depth")

    budget_knobs = ("keep", "ratio")

    @classmethod
    def noop_params(cls, adapter):
        return {"ratio": 0.0}

    @classmethod
    def budget_params(cls, tokens, adapter, config, path):
        """keep = round((L * B - K * N) / (L - K)) (module docstring)."""
        keep, n_ref = in_llm_keep_at(tokens, adapter, config.k, config.layer_mapping, path)
        if budget_fraction(adapter):
            # dynamic resolution (Qwen-VL) or anyres-max (OneVision): B is the budget of a reference-sized
            # image (576 tokens / OneVision's base view N0); every image keeps the same fraction
            return {"keep": None, "ratio": 1.0 - keep / n_ref}
        return {"keep": keep}

    @classmethod
    def test_params(cls, adapter):
        return {"keep": 5}

    @classmethod
    def check_facts(cls, config, facts) -> None:
        """K must be a layer of this LLM (checked from the config, before weights load)."""
        map_layers([config.k], facts.llm_layers, config.layer_mapping, param="k")

    def install(self) -> None:
        cfg = self.config
        ((layer, paper),) = map_layers([cfg.k], len(self.adapter.layers), cfg.layer_mapping, param="k")
        self.layer = layer
        self.probe_key = f"fastv.{layer - 1}"
        attn = self.adapter.layers[layer - 1].self_attn
        self.ctx.probe.watch(self.probe_key, attn, rows=last_row, when=lambda q, k: q > 1, reduce="mean")
        self.ctx.runner.prune_at(layer, self.select, ref_layer=paper)

    def select(self, view):
        rec = self.ctx.probe[self.probe_key]
        scores = rec.probs[:, 0]  # [B, T] attention of the last token to every slot, head mean
        src = view.group.source
        image = view.state.inputs.image_index.gather(1, src.clamp(min=0)).masked_fill(src < 0, -1)
        image = image.masked_fill(~view.vision, -1)  # [B, T] image of each vision slot, -1 elsewhere
        kept = torch.zeros_like(view.vision)
        for j in range(int(image.max()) + 1):  # per image: keep tokens of every image of a sample
            cand = image == j
            n_vis = cand.sum(1)  # [B]
            if self.config.keep is None:
                keep = (n_vis.float() * (1 - self.config.ratio)).round().long()
            else:
                keep = n_vis.clamp(max=self.config.keep)
            kept |= topk_keep(scores, cand, keep)
        view.state.stats[self.name] = {"per_sample_kept": kept.sum(1).tolist(), "layer": self.layer}
        return keep_only(view.vision, kept)
