"""PyramidDrop (Xing et al., "PyramidDrop: Accelerating Your Large Vision-Language Models via Pyramid
Visual Redundancy Reduction", CVPR 2025, arXiv 2410.17247; code Cooperx521/PyramidDrop, read at 6444f30, ``modeling_llama_pdrop.py``).

Algorithm (inference): the LLM is split into stages by the layers ``[8, 16, 24]`` (32-layer indices);
at the input of each stage layer l_s the image tokens still present are ranked and only
``int(N * r_s)`` of each image survive, with r_s = lambda^s (lambda = 0.5: 50%, 25%, 12.5% of the N
tokens the image entered the LLM with; the release's ``image_token_ratio_list``, which may also be
given explicitly as ``ratios``). Rank = attention of the *last instruction token* (the last prompt
token) to every image token in layer l_s, recomputed from the hidden states entering l_s with that
layer's ``input_layernorm``, ``q_proj`` / ``k_proj`` and RoPE (softmax over all valid keys with the
causal mask, mean over heads); the top-k are kept in their original order. Text is never dropped.

Positions (as the release, 1-D RoPE families): after each drop the survivors are renumbered 0..L'-1
(``compact``); in decode the positions of layers >= l_s continue from their own (shorter) length, which is the
release's "shift the decode position down by the tokens dropped" rule. Nothing is pruned in decode.

Budget (``budget: {tokens: B}`` or ``{ratio: r}``, layer-averaged vision tokens per image, sets
``ratio`` (lambda, a fraction KEPT per stage); ``ratio`` / ``ratios`` must not be given): with the
mapped stage layers l_1 < l_2 < l_3 of an L-layer LLM and an image of N vision tokens (its own count;
where images have different counts, lambda is fitted per image count, ``_budget.py``), avg(lambda) = (l_1 N + sum_s (l_{s+1} - l_s) int(N lambda^s)) / L
(l_4 = L), a step function of lambda; ``budget_params`` evaluates it between every pair of steps
(lambda = (j / N)^(1/s)) and takes the lambda whose average is nearest B (it lands within the step
size of B). A budget below the lambda = 0 average ceil(l_1 N / L) or above N is refused. On
LLaVA-1.5 (N = 576, 32 layers) the paper's lambda = 0.5 is 270 layer-averaged tokens, B = 192 gives
lambda = 0.254 (146 / 37 / 9 kept), and 128 and 64 are below the floor of 144 of stages [8, 16, 24]:
they need earlier stage layers (``layers``). ``ref_layer`` = the 32-layer stage index,
so FLOPs project onto the paper's depth (as FastV).

Hook points: ``runner.prune_at(l_s, compact=True)`` (Qwen-VL: ``compact=False``, below); the scoring reads the layer's own modules (no
eager attention, no probe hook: the attention row is computed before the layer runs, on the tokens
the layer would have seen, then the layer runs on the survivors).
Capabilities: all six families. On LLaVA-NeXT every token of an image's packed span is ranked,
the ``image_newline`` tokens included (the release counts the whole packed feature as image tokens).

Deviations from the release: (1) decisions are per sample and per image with left padding (the
release ranks one image per sample; a multi-image sample here keeps int(N_i r_s) of every image i,
each ranked on its own), so results never depend on the batch; (2) the attention row is computed in
fp32 (the release casts the softmax back to fp16 before the head mean); (3) top-k ties break toward
the earlier token; (4) stage layers that map onto one layer of a shallow LLM are refused
(``layers``), rather than silently merged.
Families: llava, llava_next, llava_onevision. OneVision (Qwen2 LLM, 1-D RoPE): every slot of an
image's packed span (base view, mosaic, newlines) is ranked, as on LLaVA-NeXT, and each image keeps
int(N_i r_s) of its own N_i tokens; a budget's lambda is fitted at each image's N_i. Not in the
release (LLaVA only).
Qwen-VL families (not in the release, which is LLaVA-only; LightCompress, ModelTC/LightCompress @9701d03,
``llmc/compression/token_reduction/pyramiddrop.py``, has LLaVA code only too): the ranking recomputes
the stage layer's attention row with the layer's own RoPE on the group's 3-D ids (``lm_position_ids``;
Qwen3-VL: its q/k norms first); the survivors keep their original (t, h, w) M-RoPE ids (no
``compact``), the rule of the only published in-LLM Qwen code for a staged drop, LightCompress's
Qwen2.5-VL SparseVLM (``sparsevlm.py``: it index-selects the layer's ``position_embeddings`` by the
kept slots), and decode continues from the largest kept id + 1, which is the last prompt token's, as
HF's ``rope_deltas`` numbers it. Compact renumbering would move every text token after the image
(``max(h, w)`` ids per image are reserved by HF's numbering) and mix up the 2-D offsets of M-RoPE,
for which the release gives no rule. Each image keeps int(N_i r_s), a budget's lambda fitted at its N_i.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from ..capabilities import Capabilities
from ..config import opt
from ..errors import ConfigError
from ..hooks.attention import row_attention
from ..registry import PRUNERS
from ._common import LayerMapping, keep_only, map_layers, topk_keep
from .base import Pruner


def stage_ratios(config) -> list[float]:
    """Cumulative kept fractions r_1..r_S of each stage (``ratios``, else lambda^s)."""
    if config.ratios is not None:
        return list(config.ratios)
    return [config.ratio ** (s + 1) for s in range(len(config.layers))]


def layer_average(n: int, starts: list[int], ratios: list[float], n_layers: int) -> float:
    """Layer-averaged vision tokens of one image of ``n`` tokens under the stage schedule."""
    counts = [n] + [int(n * r) for r in ratios]
    bounds = [0, *starts, n_layers]
    return sum(c * (bounds[i + 1] - bounds[i]) for i, c in enumerate(counts)) / n_layers


def last_token_attention(
    layer_module, rotary, hidden: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor
) -> torch.Tensor:
    """[B, T] head-mean attention of the last slot to every slot, as ``layer_module`` would compute it
    on ``hidden`` ([B, T, d]) with the LM's RoPE ``positions`` ([B, T]; M-RoPE: [3, B, T], the adapter's
    ``lm_position_ids``) and valid keys ``valid`` ([B, T] bool). Per-head q/k norms (Qwen3) are applied
    where the layer has them, and RoPE is the layer's own module's ``apply_rotary_pos_emb``."""
    import sys

    attn = layer_module.self_attn
    apply_rotary_pos_emb = sys.modules[type(attn).__module__].apply_rotary_pos_emb
    h = layer_module.input_layernorm(hidden)  # [B, T, d]
    bsz, t, _ = h.shape
    hd = attn.head_dim
    q = attn.q_proj(h[:, -1:]).view(bsz, 1, -1, hd)  # [B, 1, H, D]
    k = attn.k_proj(h).view(bsz, t, -1, hd)  # [B, T, Hkv, D]
    if hasattr(attn, "q_norm"):  # Qwen3-style per-head norms before RoPE
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, H, 1, D], [B, Hkv, T, D]
    cos, sin = rotary(h, position_ids=positions)  # [B, T, D] (M-RoPE: sections merged by the rotary module)
    q, _ = apply_rotary_pos_emb(q, q, cos[:, -1:], sin[:, -1:])
    k, _ = apply_rotary_pos_emb(k, k, cos, sin)
    rows = torch.zeros(1, dtype=torch.long, device=h.device)
    probs = row_attention(q, k, valid[:, None, None, :], attn.scaling, rows, True)  # [B, H, 1, T]
    return probs.mean(1)[:, 0]  # [B, T]


@PRUNERS.register(
    "pyramiddrop", description="PyramidDrop: staged drops of image tokens ranked by the last instruction token"
)
class PyramidDrop(Pruner):
    """PyramidDrop."""

    hook_points = frozenset({"llm_layer"})
    # acts on the spliced sequence; the scoring recomputes the layer's RoPE (M-RoPE: the adapter's 3-D ids,
    # kept as they are by the drops)
    caps = Capabilities()

    @dataclass(frozen=True)
    class Config:
        layers: tuple[int, ...] = opt(
            (8, 16, 24), lo=1, doc="stage ends: drop at the input of these layers (32-layer indices)"
        )
        ratio: float = opt(
            0.5, lo=0.0, hi=1.0, doc="lambda: each stage keeps this fraction of the previous stage's image tokens"
        )
        ratios: tuple[float, ...] | None = opt(
            None, lo=0.0, hi=1.0, doc="kept fraction of N after each stage (overrides ratio)"
        )
        layer_mapping: LayerMapping = opt("absolute", doc="absolute, or proportional to the LLM depth")

    budget_knobs = ("ratio", "ratios")

    @classmethod
    def _fit(cls, adapter) -> dict:
        return {"layer_mapping": "proportional"} if len(adapter.layers) <= 24 else {}

    @classmethod
    def noop_params(cls, adapter):
        return {**cls._fit(adapter), "ratio": 1.0}

    @classmethod
    def test_params(cls, adapter):
        return {**cls._fit(adapter), "ratio": 0.5}

    @classmethod
    def check_facts(cls, config, facts) -> list[tuple[int, int]]:
        """Stage layers exist, are distinct after mapping, and ``ratios`` has one non-increasing entry per stage."""
        if not config.layers:
            raise ConfigError(
                "layers", "no stage layers: PyramidDrop would drop nothing; give at least one (release: [8, 16, 24])"
            )
        if config.ratios is not None and len(config.ratios) != len(config.layers):
            raise ConfigError(
                "ratios", f"{len(config.ratios)} ratios for {len(config.layers)} stage layers; give one per stage"
            )
        if config.ratios is not None and any(b > a for a, b in zip(config.ratios, config.ratios[1:])):
            raise ConfigError(
                "ratios",
                f"{list(config.ratios)}: each stage keeps a fraction of the image's N tokens, and a stage cannot "
                "keep more than the previous one left; give non-increasing ratios",
            )
        if list(config.layers) != sorted(set(config.layers)):
            raise ConfigError("layers", f"{list(config.layers)}: stage layers must be strictly increasing")
        stages = map_layers(config.layers, facts.llm_layers, config.layer_mapping)
        if len(stages) != len(config.layers):
            raise ConfigError(
                "layers",
                f"{list(config.layers)} map onto only {len(stages)} distinct layers of this "
                f"{facts.llm_layers}-layer LLM; use fewer stages or absolute layers",
            )
        return stages

    @classmethod
    def budget_params(cls, tokens, n, adapter, config, path):
        """lambda whose layer average for an image of n tokens is nearest ``tokens`` (module docstring)."""
        from ..capabilities import ModelFacts

        n_layers = len(adapter.layers)
        starts = [layer for layer, _ in cls.check_facts(config, ModelFacts.of_adapter(adapter))]
        s_count = len(starts)
        lo = layer_average(n, starts, [0.0] * s_count, n_layers)
        if tokens > n or tokens < lo - 1e-9:
            raise ConfigError(
                f"{path}.tokens",
                f"{tokens} layer-averaged tokens is infeasible for PyramidDrop with stages at "
                f"layers {starts} of {n_layers} and {n} vision tokens in this image: the smallest "
                f"feasible budget is {int(-(-lo // 1))}, the largest {n}",
            )
        steps = sorted({0.0, 1.0, *((j / n) ** (1 / s) for s in range(1, s_count + 1) for j in range(n + 1))})
        cands = [1.0] + [(a + b) / 2 for a, b in zip(steps, steps[1:])]  # one lambda inside every step
        best = min(
            cands,
            key=lambda lam: (
                abs(layer_average(n, starts, [lam ** (s + 1) for s in range(s_count)], n_layers) - tokens),
                lam,
            ),
        )
        return {"ratio": best}

    def install(self) -> None:
        from ..capabilities import ModelFacts

        self.stages = self.check_facts(self.config, ModelFacts.of_adapter(self.adapter))  # [(layer, paper layer)]
        self.ratios = stage_ratios(self.config)
        compact = self.adapter.features.rope == "1d"  # M-RoPE: original ids (module docstring)
        for s, (layer, paper) in enumerate(self.stages):
            self.ctx.runner.prune_at(layer, self._make_select(s, layer), compact=compact, ref_layer=paper)

    def _make_select(self, stage: int, layer: int):
        score = partial(last_token_attention, self.adapter.layers[layer], self.adapter.language_model.rotary_emb)

        def select(view) -> torch.Tensor:
            state = view.state
            positions = self.adapter.lm_position_ids(view.group.positions)
            # one captured graph per stage and shape where the session captures (~90 ops launched one by one)
            scores = self.ctx.captured(("pyramiddrop", layer), score, view.hidden, positions, view.group.key_mask)
            image = view.images  # [B, T] image of each vision slot, -1 elsewhere
            n_in = state.inputs.image_index  # [B, L] image of each prefill token (N_i counted there)
            kept = torch.zeros_like(view.vision)
            for j in range(int(image.max()) + 1):
                cand = image == j
                n_j = ((n_in == j) & state.inputs.image_mask).sum(1)  # [B] tokens image j entered the LLM with
                if self.maps_per_image:  # a budget's lambda fitted at each image's own count
                    r = [stage_ratios(self.config_for(int(c)))[stage] if c else 0.0 for c in n_j.tolist()]
                    r_s = torch.tensor(r, dtype=torch.float64, device=n_j.device)
                else:
                    r_s = torch.full_like(n_j, self.ratios[stage], dtype=torch.float64)
                keep = (n_j.double() * r_s).floor().long().clamp(max=cand.sum(1))  # int(N * r_s)
                kept |= topk_keep(scores, cand, keep)
            ratios = "per image" if self.maps_per_image else self.ratios  # a budget: lambda fitted per image count
            stats = state.stats.setdefault(self.name, {"stage_layers": [x for x, _ in self.stages], "ratios": ratios})
            stats.setdefault("per_sample_kept", [[] for _ in range(kept.shape[0])])
            for b, c in enumerate(kept.sum(1).tolist()):
                stats["per_sample_kept"][b].append(c)
            return keep_only(view.vision, kept)

        return select
