"""FastV (Chen et al., "An Image is Worth 1/2 Tokens After Layer 2", ECCV 2024, arXiv 2403.06764).

Algorithm: at the input of LLM layer K (default 2), rank every image token by the attention the
*last* prompt token pays to it in layer K-1 (mean over heads; the released code uses the last token,
not the average attention the paper's text describes, FastV issue #14), keep the top ``keep`` of each
image (or ``(1 - R) * N`` of each image, R = ``drop_ratio`` = 50% by default: the paper's R is the
fraction *dropped*, hence the name; the old name ``ratio`` is refused with the new spelling) and drop the
rest from the sequence for layers >= K. ``keep`` is per image (a multi-image prompt keeps ``keep`` tokens
of every image, each image ranked on its own; with one image this is the released per-sample top-k).

Budget (``budget: {tokens: B}`` or ``{ratio: r}``, layer-averaged equivalent vision tokens per image;
sets ``keep``, ``drop_ratio`` must not be given): with the mapped layer K of an L-layer LLM and an image
of N vision tokens (its own count, on every family), B = (K * N + (L - K) * keep) / L, so
keep = round((L * B - K * N) / (L - K)); the average lands within (L - K) / (2 L) tokens of B.
B < ceil(K * N / L) (keep < 0) is refused, naming that smallest budget. Where images have different
counts (LLaVA-NeXT, OneVision, Qwen-VL) keep is computed per image from its N (``_budget.py``).

Positions: the in-place variant keeps each kept token's original position id (under M-RoPE its
original (t, h, w) ids, the in-place rule applied per axis; no official Qwen-VL FastV code was
checked). KV cache: layers >= K cache only the kept tokens; pruning is static after prefill (as the
released KV-cache variant).
Hook points: attention probe on layer K-1 (last query row only, O(keys); ``prefill_only``, so a static
decode step can be one captured graph); layer pre-hooks >= K.
Limits: none on batch size (per-sample top-k with left padding); needs no eager attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..capabilities import Capabilities
from ..config import opt
from ..hooks import last_row
from ..registry import PRUNERS
from ._budget import in_llm_keep_at
from ._common import LayerMapping, keep_only, map_layers, topk_keep
from .base import Pruner

RATIO_RENAMED = (
    "FastV's 'ratio' was the fraction of image tokens DROPPED; write drop_ratio: R (e.g. drop_ratio: 0.5), "
    "keep: N, or a budget: {ratio: r} for the fraction KEPT"
)


@PRUNERS.register("fastv", description="FastV: drop image tokens least attended by the last token after layer K")
class FastV(Pruner):
    """FastV."""

    hook_points = frozenset({"attention_probe", "llm_layer"})
    caps = Capabilities()  # acts on the spliced sequence, any vision layout; M-RoPE: kept ids

    @dataclass(frozen=True)
    class Config:
        k: int = opt(2, lo=1, doc="prune at the input of layer K (index on a 32-layer LLM, see layer_mapping)")
        drop_ratio: float = opt(0.5, lo=0.0, hi=1.0, doc="R: fraction of each image's tokens DROPPED (paper: 50%)")
        keep: int | None = opt(None, lo=0, doc="vision tokens kept per image (overrides drop_ratio)")
        layer_mapping: LayerMapping = opt("absolute", doc="absolute, or proportional to the LLM depth")

        _renamed = (("ratio", RATIO_RENAMED),)

    budget_knobs = ("keep", "drop_ratio")

    @classmethod
    def noop_params(cls, adapter):
        return {"drop_ratio": 0.0}

    @classmethod
    def budget_params(cls, tokens, n, adapter, config, path):
        """keep = round((L * B - K * N) / (L - K)) for an image of N tokens (module docstring)."""
        return {"keep": in_llm_keep_at(tokens, n, adapter, config.k, config.layer_mapping, path)}

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
        self.ctx.probe.watch(
            self.probe_key, attn, rows=last_row, when=lambda q, k: q > 1, reduce="mean", prefill_only=True
        )
        self.ctx.runner.prune_at(layer, self.select, ref_layer=paper)

    def select(self, view):
        rec = self.ctx.probe[self.probe_key]
        scores = rec.probs[:, 0]  # [B, T] attention of the last token to every slot, head mean
        image = view.images  # [B, T] image of each vision slot, -1 elsewhere
        kept = torch.zeros_like(view.vision)
        for j in range(int(image.max()) + 1):  # per image: keep tokens of every image of a sample
            cand = image == j
            n_vis = cand.sum(1)  # [B]
            if self.maps_per_image:  # the budget's keep for each image's own count
                per = [self.config_for(int(c)).keep if c else 0 for c in n_vis.tolist()]
                keep = torch.tensor(per, device=n_vis.device).clamp(max=n_vis)
            elif self.config.keep is None:
                # the release's round(N (1 - R)) in Python floats (fp32 moves N (1 - R) across .5; MPS has no fp64)
                per = [round(c * (1 - self.config.drop_ratio)) for c in n_vis.tolist()]
                keep = torch.tensor(per, device=n_vis.device)
            else:
                keep = n_vis.clamp(max=self.config.keep)
            kept |= topk_keep(scores, cand, keep)
        view.state.stats[self.name] = {"per_sample_kept": kept.sum(1).tolist(), "layer": self.layer}
        return keep_only(view.vision, kept)
