"""ClearSight / VAF: Visual Amplification Fusion (Yin et al., CVPR 2025, arXiv 2503.13107; code: github
ustc-hyin/ClearSight).

Algorithm (official ``visaug/inference/AttnAdapter.py``): in the middle LLM layers where modality
fusion happens (LLaVA-1.5: layers 9..14, ``i > 8 and i < 15``), for every head, the attention logits
(``q K^T / sqrt(d)``, **before** the mask and the softmax) of every query row *after the image*
(the instruction and assistant prompt at prefill, each new token while decoding) are multiplied by
``enhance`` (1.15) on the image keys and by ``suppress`` (0.95) on the keys before the image (BOS +
system prompt + "USER:"); text keys after the image are untouched. One forward per token, no
contrastive input; then greedy (the official POPE inference uses ``generate``'s default).

Defaults: the README's ``--enh-para 1.15 --sup-para 0.95``; the layers are the paper's 9..14 of 32,
mapped proportionally (rounded) onto an LLM of another depth unless ``layers`` is given.
Hook points: the probe wrapper's attention override on those layers (the model stays on sdpa; the
rows after the image are recomputed in fp32, O(rows x keys)). Cost: one forward per token. On a static cache
(``model.compile``) the override reads the slot classes staged before each decode step (over the layer's whole
buffer) and before each captured prefill segment (``_attn_edit.StagedSlotClasses``), so decode steps and the
prefill are captured graphs under ``auto``; a captured prefill recomputes every row of the edited layers (where the
rows after the image start depends on the prompt) and keeps the base output of the rows before the image.

Deviations from the official code: the image span and the system-prompt span come from the running
layout (left padding, LLaVA-NeXT tiles, pruned vision tokens) instead of the fixed indices 35 / 576;
rows and keys are classified per sample; the edited rows are computed in fp32 (official: fp16 eager);
a sample without an image is left untouched. Not verified: a third-party summary of the paper mentions
restricting the edit to "visual perception" heads; the released inference code edits every head of
the chosen layers, which is what mmfast does.
Families: all six (it needs nothing of the model): the scaled logits are keyed on the running layout's vision slots,
position-agnostic, so it runs under M-RoPE (Qwen-VL) unchanged; no-op = greedy and batch (mixed image
sizes) = per sample are tested on the Qwen families (``tests/test_family_reasons.py``). The release
(ustc-hyin/ClearSight, ``visaug/``) has no Qwen-VL code; its layers are LLaVA-1.5's, mapped by depth.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..capabilities import Capabilities
from ..config import opt
from ..registry import DECODERS
from ._attn_edit import StagedSlotClasses, edit_rows, held_slot_classes, install_override, override_caps, static_step
from .base import DecodeOutput, Decoder, DecodeRequest, existing_layers
from .loop import autoregressive, sample_from, warpers

PAPER_LAYERS = tuple(range(9, 15))  # of the 32-layer LLaVA-1.5-7B LLM


def paper_layers(n_layers: int) -> list[int]:
    """The paper's layers 9..14 of 32 mapped (rounded) onto an n-layer LLM."""
    return sorted({min(n_layers - 1, round(layer * n_layers / 32)) for layer in PAPER_LAYERS})


def vaf_logits(
    logits: torch.Tensor, rows: torch.Tensor, image: torch.Tensor, system: torch.Tensor, enhance: float, suppress: float
) -> torch.Tensor:
    """VAF's edit of attention logits ([B, H, R, K], before the mask).

    rows: [B, R] query rows to edit; image / system: [B, K] key classes.
    """
    scale = 1.0 + (enhance - 1.0) * image.float() + (suppress - 1.0) * system.float()  # [B, K]
    return torch.where(rows[:, None, :, None], logits * scale[:, None, None, :], logits)


@DECODERS.register(
    "clearsight", description="ClearSight VAF: amplify visual / damp system-prompt attention in middle layers"
)
class ClearSight(Decoder):
    """Visual Amplification Fusion."""

    @dataclass(frozen=True)
    class Config:
        enhance: float = opt(1.15, lo=0.0, hi=10.0, doc="factor on image-key logits (1 = off)")
        suppress: float = opt(0.95, lo=0.0, hi=10.0, doc="factor on system-prompt-key logits (1 = off)")
        layers: tuple[int, ...] | None = opt(None, doc="0-based LLM layers; default the paper's 9..14 of 32, mapped")
        sample: bool = opt(False, doc="sample instead of greedy")
        temperature: float = opt(1.0, lo=1e-4, hi=100.0)
        top_p: float = opt(1.0, lo=0.0, hi=1.0)
        top_k: int = opt(0, lo=0)

    @staticmethod
    def active(cfg) -> bool:
        return cfg.enhance != 1.0 or cfg.suppress != 1.0

    @classmethod
    def capabilities(cls, params) -> Capabilities:
        cfg = params if params is not None else cls.Config()
        return override_caps(cls.active(cfg))

    @classmethod
    def check_facts(cls, config, facts) -> list[int]:
        n = facts.llm_layers
        return sorted(set(existing_layers(config.layers if config.layers is not None else paper_layers(n), n)))

    def install(self) -> None:
        from ..capabilities import ModelFacts

        self.layers = self.check_facts(self.config, ModelFacts.of_adapter(self.ctx.adapter))
        # the image, system-prompt and after-image slots of a static decode step (refilled before each step) and of
        # a captured prefill segment (before it runs), in fixed memory that the graphs read
        self._static = StagedSlotClasses(
            self.layers,
            ("image", "before_image", "after_image"),
            lambda: self.ctx.runner.active,
            image_only=True,
            run=self.ctx.captured,
            enabled=lambda: self.ctx.decoding is None or self.ctx.decoding is self,  # a per-call decoder: no edit
        )
        if self.active(self.config):
            for layer in self.layers:
                install_override(
                    self.ctx, layer, self._override(layer), "ClearSight (clearsight)", self._static.carried()
                )

    def _override(self, layer: int):
        enhance, suppress = self.config.enhance, self.config.suppress

        def override(module, query, key, value, attention_mask, scaling, base, dropout=0.0, **kwargs):
            out, _ = base(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
            state = self.ctx.runner.active
            if state is None or self._static.imageless(state):  # no vision token to enhance
                return out
            q_len, k_len = query.shape[2], key.shape[2]
            decode = static_step(state, query, key)
            if decode or (q_len == k_len and self._static.staged_prefill(state, layer)):  # a graph's: no host read
                image = self._static.get(state, layer, "image", k_len, query.device)  # [B, K]
                system = self._static.get(state, layer, "before_image", k_len, query.device)  # [B, K]
                has = self._static.get(state, layer, "has_image", k_len, query.device)  # [B, 1]
                # a decode step's new slots are generated tokens' (after the image: every row); a prefill's rows after
                # the image, all rows recomputed (where they start depends on the prompt; the others keep their base)
                if decode:
                    rows = has.expand(-1, q_len)  # [B, Q]
                else:
                    rows = self._static.get(state, layer, "after_image", k_len, query.device) & has  # [B, T]

                def edit_staged(logits: torch.Tensor, r0: int) -> torch.Tensor:
                    return vaf_logits(logits, rows[:, r0:], image, system, enhance, suppress)

                return edit_rows(query, key, value, attention_mask, scaling, out, rows, edit_staged, r0=0)
            cls = held_slot_classes(state, layer, k_len, "ClearSight")
            has_image = cls.image.any(1, keepdim=True)  # [B, 1]
            rows = cls.after_image[:, k_len - q_len :] & has_image  # [B, Q]

            def edit(logits: torch.Tensor, r0: int) -> torch.Tensor:
                return vaf_logits(logits, rows[:, r0:], cls.image, cls.before_image, enhance, suppress)

            return edit_rows(query, key, value, attention_mask, scaling, out, rows, edit)

        return override

    def decode(self, req: DecodeRequest) -> DecodeOutput:
        cfg = self.config
        gens = req.generators(self.ctx.device)
        procs = warpers(cfg.temperature, cfg.top_k, cfg.top_p)

        def choose(logits, step, state):
            return sample_from(procs(None, logits), gens) if cfg.sample else logits.argmax(-1)

        out = autoregressive(self.ctx, req.inputs, choose, req.max_new_tokens)
        out.stats = {"forwards_per_step": 1, "amplified_layers": self.layers if self.active(cfg) else []}
        return out
