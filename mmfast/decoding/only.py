"""ONLY: One-Layer Intervention (Wan et al., ICCV 2025, arXiv 2507.00898; code: github zifuwan/ONLY).

Algorithm (official ``modeling_llama.py`` / ``llava_llama.py`` / ``only_sample.py``), at every forward,
in the same pass as the ordinary logits ``l``:
1. At LLM layer ``layer`` (``enhance_layer_index``, 0): the attention probabilities ``P`` of the last
   query row (softmax of the masked logits). On the *text* keys (every real non-image key except BOS)
   and, separately, on the *image* keys, probabilities above that row's mean + std (unbiased) over
   the class are set to 0. Per head, ``E_text`` / ``E_img`` = the entropy ``-sum p log(p + 1e-6)`` of
   the remaining text / image probabilities renormalised to sum 1 (NaN: 0 for text, inf for image);
   the text-to-visual entropy ratio ``r_h = E_text / E_img``. Heads with ``r_h < mean_h r`` are
   removed (all their probabilities set to 0). The edited, un-renormalised ``P'`` times V, through
   ``o_proj``, gives ``a`` (the layer's attention output without the residual).
2. ``a`` skips the layers in between. At the last layer: ``h = input_layernorm(a) + 0.2 x`` with ``x``
   the hidden state entering that layer, ``h = h + mlp(post_attention_layernorm(h))``; then
   ``l' = lm_head(norm(h) + 0.5 norm(x_final))`` with ``norm(x_final)`` the model's own final hidden state.
3. ``TVD = sum |softmax(l) - softmax(l')|``. If ``TVD < gamma``: ``l + alpha_pos l'`` (the branches
   agree: reinforce), else ``(1 + alpha_neg) l - alpha_neg l'`` (contrast); then the adaptive plausibility
   mask ``l >= log(beta) + max l``, the warpers and multinomial sampling (T = 1, top-p = 1).

Defaults: the official POPE script (``js_gamma 0.2``, ``alpha_pos 3``, ``alpha_neg 1``, ``beta 0.1``,
layer 0, sampling; the CHAIR script uses ``js_gamma 0.25``). Hook points: the probe wrapper's
attention override on ``layer`` (base attention for the model, plus one row recomputed in fp32); a
forward pre-hook on the last decoder layer (its input at the last position); a forward hook on the
final norm (the model's final hidden state). On a static cache (``model.compile``) the override reads the key
classes staged before each decode step (over the layer's whole buffer) and before each captured prefill segment
(``_attn_edit.StagedSlotClasses``), and the three leave their rows in the state's scratch through ``Carried``, so
decode steps and the prefill are captured graphs under ``auto`` (the last layer's second pass, ``lm_head`` on
one row and the fusion run after each, as one more captured call, ``MethodContext.captured``). Cost: one forward per token plus the last layer's MLP and
one ``lm_head`` on one row.

Deviations from the official code:
- TVD, the outlier statistics and the head rule are computed per sample (the official code sums the
  TVD over the batch and indexes heads as if the batch were 1; it runs batch 1);
- the key classes come from the running layout (left padding, pruned or LLaVA-NeXT vision tokens; the
  official code hard-codes 35 system tokens and 576 image tokens) and padding is excluded; ``P`` is
  computed in fp32 (official: fp16 eager attention).
Families: all six (it needs nothing of the model): the key classes come from the running layout, not positions, so
it runs under M-RoPE (Qwen-VL) unchanged; no-op = greedy and batch (mixed image sizes) = per sample are
tested on the Qwen families (``tests/test_family_reasons.py``). The release (zifuwan/ONLY) evaluates
LLaVA-1.5, InstructBLIP and first-generation Qwen-VL (``experiments/Qwen_VL``), not Qwen2-VL or later;
its Qwen-VL code was not compared here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..capabilities import Capabilities
from ..config import opt
from ..errors import ConfigError
from ..hooks.attention import Carried, replayable
from ..registry import DECODERS
from ._attn_edit import (
    StagedSlotClasses,
    attend,
    install_override,
    masked_scores,
    override_caps,
    slot_classes,
    static_step,
)
from .base import DecodeOutput, Decoder, DecodeRequest
from .branches import plausibility_mask
from .loop import autoregressive, sample_from, warpers


def zero_outliers(p: torch.Tensor, cls: torch.Tensor) -> torch.Tensor:
    """``p`` ([B, H, K]) with the entries of class ``cls`` ([B, K]) above mean + std (unbiased, over the
    class of each row) set to 0; entries outside the class are returned unchanged."""
    m = cls[:, None, :].to(p.dtype)  # [B, 1, K]
    n = m.sum(-1, keepdim=True)  # [B, 1, 1]
    mean = (p * m).sum(-1, keepdim=True) / n
    std = (((p - mean) ** 2 * m).sum(-1, keepdim=True) / (n - 1)).sqrt()
    return p.masked_fill(cls[:, None, :] & (p > mean + std), 0.0)


def class_entropy(p: torch.Tensor, cls: torch.Tensor, nan: float) -> torch.Tensor:
    """Entropy ([B, H]) of ``p`` ([B, H, K]) restricted to ``cls`` ([B, K]) and renormalised."""
    q = p * cls[:, None, :]
    q = q / q.sum(-1, keepdim=True)
    return torch.nan_to_num(-(q * torch.log(q + 1e-6)).sum(-1), nan=nan)


def only_attention(probs: torch.Tensor, text: torch.Tensor, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ONLY's edited attention row and its removed heads.

    probs: [B, H, K] attention probabilities of the last query row; text / image: [B, K] key classes.
    Returns (edited probabilities [B, H, K], removed heads [B, H] bool).
    """
    edited = torch.where(text[:, None], zero_outliers(probs, text), probs)
    edited = torch.where(image[:, None], zero_outliers(probs, image), edited)
    ratio = class_entropy(edited, text, 0.0) / class_entropy(edited, image, float("inf"))  # [B, H]
    removed = ratio < ratio.mean(-1, keepdim=True)
    return edited.masked_fill(removed[..., None], 0.0), removed


def only_fuse(l: torch.Tensor, l_cd: torch.Tensor, gamma: float, alpha_pos: float, alpha_neg: float) -> tuple:
    """Fused logits ([B, V]) and whether each row took the additive branch ([B] bool)."""
    tvd = (torch.softmax(l, -1) - torch.softmax(l_cd, -1)).abs().sum(-1)  # [B]
    agree = tvd < gamma
    fused = torch.where(agree[:, None], l + alpha_pos * l_cd, (1 + alpha_neg) * l - alpha_neg * l_cd)
    return fused, agree


@dataclass
class _Scratch:
    """What one forward leaves for the token choice (last position of each row)."""

    attn: torch.Tensor | None = None  # [B, d] the edited attention output of the intervention layer
    resid: torch.Tensor | None = None  # [B, d] hidden state entering the last layer
    final: torch.Tensor | None = None  # [B, d] the model's final-norm hidden state
    removed: torch.Tensor | None = None  # [B, H] heads removed at this forward


@DECODERS.register("only", description="ONLY: one-layer intervention by text-to-visual entropy ratio, single pass")
class ONLY(Decoder):
    """One-Layer Intervention."""

    @dataclass(frozen=True)
    class Config:
        layer: int = opt(0, lo=0, doc="intervention layer (enhance_layer_index, 0-based)")
        gamma: float = opt(
            0.2, lo=0.0, hi=2.0, doc="TVD threshold between additive and contrastive fusion (CHAIR: 0.25)"
        )
        alpha_pos: float = opt(3.0, lo=0.0, hi=20.0, doc="weight of l' when the two agree (TVD < gamma)")
        alpha_neg: float = opt(1.0, lo=0.0, hi=20.0, doc="contrast weight when they disagree")
        beta: float = opt(0.1, lo=0.0, hi=1.0, doc="adaptive plausibility cutoff on l (0 = off)")
        residual_weight: float = opt(0.2, lo=0.0, hi=10.0, doc="weight of the last layer's input in l' (official 0.2)")
        final_weight: float = opt(0.5, lo=0.0, hi=10.0, doc="weight of the final hidden state in l' (official 0.5)")
        sample: bool = opt(True, doc="sample (official) or argmax")
        temperature: float = opt(1.0, lo=1e-4, hi=100.0)
        top_p: float = opt(1.0, lo=0.0, hi=1.0)
        top_k: int = opt(0, lo=0)

    @classmethod
    def capabilities(cls, params) -> Capabilities:
        cfg = params if params is not None else cls.Config()
        return override_caps(cls.active(cfg))

    @staticmethod
    def active(cfg) -> bool:
        return cfg.alpha_pos != 0.0 or cfg.alpha_neg != 0.0

    @classmethod
    def check_facts(cls, config, facts) -> int:
        if not 0 <= config.layer < facts.llm_layers - 1:
            raise ConfigError(
                "layer", f"{config.layer} is not a layer before the last of this {facts.llm_layers}-layer LLM"
            )
        return config.layer

    def install(self) -> None:
        from ..capabilities import ModelFacts

        adapter = self.ctx.adapter
        self.check_facts(self.config, ModelFacts.of_adapter(adapter))
        if not self.active(self.config):
            return
        # the key classes of a static decode step (refilled before each step) and of a captured prefill segment
        # (before it runs), in fixed memory that the graphs read; what the override and the hooks leave in the state's
        # scratch is carried out of each replay
        self._static = StagedSlotClasses(
            [self.config.layer], ("valid", "image", "bos"), lambda: self.ctx.runner.active, run=self.ctx.captured
        )
        override = self._carried("attn", "removed", stage=self._static.stage_prefill, before_step=self._static.stage)
        install_override(self.ctx, self.config.layer, self._override, "ONLY (only)", override)
        last, norm = adapter.layers[-1], adapter.language_model.norm
        self.ctx.hooks.pre_hook(last, replayable(self._last_layer_input, self._carried("resid")), with_kwargs=True)
        self.ctx.hooks.forward_hook(norm, replayable(self._final_hidden, self._carried("final")))

    def _carried(self, *fields: str, stage=None, before_step=None) -> Carried:
        """The running state's scratch ``fields`` (what a replay of a decode step or a prefill segment wrote) carried
        out of the graph."""

        def get() -> tuple:
            scratch = self._scratch()
            return tuple(getattr(scratch, f) for f in fields)

        def put(values: tuple) -> None:
            scratch = self._scratch()
            for f, v in zip(fields, values):
                setattr(scratch, f, v)

        return Carried(get, put, stage, decode=True, before_step=before_step)

    def _scratch(self) -> _Scratch | None:
        state = self.ctx.runner.active
        return None if state is None else state.extras.setdefault(self.name, _Scratch())

    def _override(self, module, query, key, value, attention_mask, scaling, base, dropout=0.0, **kwargs):
        out, _ = base(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        scratch = self._scratch()
        if scratch is None:
            return out
        q_len, k_len = query.shape[2], key.shape[2]
        scores, add = masked_scores(query, key, attention_mask, q_len - 1)
        probs = torch.nan_to_num(torch.softmax(scores * scaling + add, -1), nan=0.0)[:, :, 0]  # [B, H, K]
        state, layer = self.ctx.runner.active, self.config.layer
        staged = static_step(state, query, key) or (q_len == k_len and self._static.staged_prefill(state, layer))
        if staged:  # a graph's: the classes staged before it (a decode step's over the layer's whole buffer)
            valid, image, bos = (
                self._static.get(state, layer, f, k_len, query.device) for f in ("valid", "image", "bos")
            )
        else:
            cls = slot_classes(state, layer)
            valid, image, bos = cls.valid, cls.image, cls.bos
        text = valid & ~image & ~bos  # [B, K]
        edited, scratch.removed = only_attention(probs, text, image)
        a = attend(edited[:, :, None], value)[:, 0]  # [B, H, D]
        scratch.attn = module.o_proj(a.reshape(a.shape[0], -1).to(query.dtype))  # [B, d]
        return out

    def _last_layer_input(self, module, args, kwargs):
        scratch = self._scratch()
        if scratch is not None:
            hidden = args[0] if args else kwargs["hidden_states"]
            scratch.resid = hidden[:, -1]
        return None

    def _final_hidden(self, module, args, output):
        scratch = self._scratch()
        if scratch is not None:
            scratch.final = output[:, -1]

    @torch.no_grad()
    def perturbed_logits(self, scratch: _Scratch) -> torch.Tensor:
        """l' ([B, V] fp32) from what the forward left: the last layer on the edited attention output."""
        cfg, adapter = self.config, self.ctx.adapter
        last = adapter.layers[-1]
        h = last.input_layernorm(scratch.attn) + cfg.residual_weight * scratch.resid
        h = h + last.mlp(last.post_attention_layernorm(h))
        h = adapter.language_model.norm(h) + cfg.final_weight * scratch.final
        return adapter.lm_head(h).float()

    def decode(self, req: DecodeRequest) -> DecodeOutput:
        cfg = self.config
        gens = req.generators(self.ctx.device)
        procs = warpers(cfg.temperature, cfg.top_k, cfg.top_p)
        on = self.active(cfg)

        def fuse(logits, attn, resid, final) -> torch.Tensor:  # [B, V + 1]: the fused logits, then agree
            l_cd = self.perturbed_logits(_Scratch(attn, resid, final))
            fused, agree = only_fuse(logits, l_cd, cfg.gamma, cfg.alpha_pos, cfg.alpha_neg)
            return torch.cat([fused, agree[:, None].to(fused.dtype)], 1)

        key = ("only.fuse", cfg.residual_weight, cfg.final_weight, cfg.gamma, cfg.alpha_pos, cfg.alpha_neg)

        def choose(logits, step, state):
            fused = logits
            if on:
                scratch = state.extras[self.name]
                # the last layer on the edited row, the fusion: one captured call where the session captures
                packed = self.ctx.captured(key, fuse, logits, scratch.attn, scratch.resid, scratch.final)
                fused, agree = packed[:, :-1], packed[:, -1].bool()  # [B, V], [B]
                st = state.stats.get(self.name)
                if st is None:  # counted on the device ([B] each), read once at the end (LMState.stats_rows)
                    st = state.stats[self.name] = {
                        "per_sample_additive_steps": torch.zeros_like(agree, dtype=torch.long),
                        "per_sample_removed_heads_first": scratch.removed.sum(-1),
                    }
                st["per_sample_additive_steps"] = st["per_sample_additive_steps"] + agree
            fused = fused.masked_fill(~plausibility_mask(logits, cfg.beta), float("-inf"))
            return sample_from(procs(None, fused), gens) if cfg.sample else fused.argmax(-1)

        out = autoregressive(self.ctx, req.inputs, choose, req.max_new_tokens)
        out.stats = {"forwards_per_step": 1, "intervention_layer": cfg.layer if on else None}
        return out
