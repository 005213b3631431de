"""FastV (Chen et al., "An Image is Worth 1/2 Tokens After Layer 2", ECCV 2024, arXiv 2403.06764).

Algorithm: at the input of LLM layer K (default 2), rank every image token by the attention the
*last* prompt token pays to it in layer K-1 (mean over heads; the released code uses the last token,
not the average attention the paper's text describes, FastV issue #14), keep the top ``keep`` (or
``(1-R) * N``, R = 50% by default) and drop the rest from the sequence for layers >= K.

Positions: the in-place variant keeps each kept token's original position id. KV cache: layers >= K
cache only the kept tokens; pruning is static after prefill (as the released KV-cache variant).
Hook points: attention probe on layer K-1 (last query row only, O(keys)); layer pre-hooks >= K.
Limits: none on batch size (per-sample top-k with left padding); needs no eager attention.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..capabilities import Capabilities
from ..config import opt
from ..hooks import last_row
from ..registry import PRUNERS
from ._common import LayerMapping, keep_only, map_layers, topk_keep
from .base import Pruner


@PRUNERS.register("fastv", description="FastV: drop image tokens least attended by the last token after layer K")
class FastV(Pruner):
    """FastV."""

    hook_points = frozenset({"attention_probe", "llm_layer"})
    caps = Capabilities(families=frozenset({"llava", "llava_next"}))  # acts on the spliced sequence, any vision layout

    @dataclass(frozen=True)
    class Config:
        k: int = opt(2, lo=1, doc="prune at the input of layer K (index on a 32-layer LLM, see layer_mapping)")
        ratio: float = opt(0.5, lo=0.0, hi=1.0, doc="R: fraction of image tokens dropped (paper: 50%)")
        keep: int | None = opt(None, lo=0, doc="image tokens kept per sample (overrides ratio)")
        layer_mapping: LayerMapping = opt("absolute", doc="absolute, or proportional to the LLM depth")

    @classmethod
    def noop_params(cls, adapter):
        return {"ratio": 0.0}

    @classmethod
    def test_params(cls, adapter):
        return {"keep": 5}

    def install(self) -> None:
        cfg = self.config
        (layer, paper), = map_layers([cfg.k], len(self.adapter.layers), cfg.layer_mapping, param="k")
        self.layer = layer
        self.probe_key = f"fastv.{layer - 1}"
        attn = self.adapter.layers[layer - 1].self_attn
        self.ctx.probe.watch(self.probe_key, attn, rows=last_row, when=lambda q, k: q > 1, reduce="mean")
        self.ctx.runner.prune_at(layer, self.select, ref_layer=paper)

    def select(self, view):
        rec = self.ctx.probe[self.probe_key]
        scores = rec.probs[:, 0]  # [B, T] attention of the last token to every slot, head mean
        n_vis = view.vision.sum(1)  # [B]
        keep = (n_vis.float() * (1 - self.config.ratio)).round().long() if self.config.keep is None else n_vis.clamp(max=self.config.keep)
        kept = topk_keep(scores, view.vision, keep)
        view.state.stats[self.name] = {"per_sample_kept": kept.sum(1).tolist(), "layer": self.layer}
        return keep_only(view.vision, kept)
