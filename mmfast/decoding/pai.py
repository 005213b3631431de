"""PAI: Paying More Attention to Image (Liu et al., ECCV 2024, arXiv 2407.21771; code: github LALBJ/PAI).

Algorithm (official ``attention.py`` / ``CFG.py``):
1. *Inference intervention.* In LLM layers ``start_layer .. end_layer - 1`` (LLaVA-1.5: 2..31), for
   every head, the attention logits of the **last query row** of each forward (the last prompt token
   at prefill, the new token at every decode step) to the image keys become ``w + alpha |w|``, after
   the scaling and the mask and **before** the softmax; nothing else changes.
2. *Logits refine* (``use_cfg``): an image-free copy of the prompt (the same template with the image
   removed) runs as a second branch with its own cache and **no** amplification;
   ``s = log_softmax(l)``, ``u = log_softmax(l_u)``, fused ``gamma (s - u) + u``, and tokens with
   ``s < log(0.1) + max s`` are set to -inf (adaptive plausibility constraint). ``gamma = 1`` returns
   ``s`` unchanged (no second branch here).
Then greedy (the official evaluation scripts' default) or sampling with the usual warpers.

Defaults: the README's POPE/CHAIR commands for LLaVA-1.5: ``--use-attn --alpha 0.2 --use-cfg
--gamma 1.1 --start-layer 2 --end-layer 32`` (the scripts' argparse default is gamma 2), greedy.
Layers on an LLM of another depth: ``start_layer`` stays absolute (2: every layer but the first two
is amplified) and ``end_layer`` defaults to the LLM's depth, so an L-layer LLM gets layers 2..L-1 (the
embedded 4-layer model: 2..3). The release runs ``--start-layer 2 --end-layer 32`` for all three of its
models (LLaVA-1.5-7B, MiniGPT-4, Shikra; each a 32-layer 7B LLM) and has no rule for another depth,
so mmfast keeps what its ``range(2, 32)`` says on any depth: skip the first two layers, amplify the
rest, the same shallow cut that mmfast's VHR keeps absolute (its layer 1; its last 14 of 32 scale)
and FastV's K = 2 by default (``layer_mapping: absolute``). ClearSight's layers scale because they are a
band in the middle of the depth (9..14 of 32), which an absolute index would not keep. (Not checked:
whether the paper states a reason for the first two layers.)
Hook points: the probe wrapper's attention override on the amplified layers (the model stays on
sdpa; only the last row is recomputed, O(keys) per head); the image-free branch through the branch
manager. On a static cache (``model.compile``) the override reads the image slots staged before each decode step
(over the layer's whole buffer) and before each captured prefill segment (``_attn_edit.StagedSlotClasses``), so
decode steps and the prefill are captured graphs under ``auto``. Cost: one forward per token with ``gamma = 1``; two (the second on a prompt without image
tokens) with CFG.

Deviations from the official code:
- with ``--use-cfg`` the official code leaves the *first* generated token unamplified (``llama_modify``
  sets ``use_cfg`` on the attention modules, which the CFG processor only clears after its first
  call). mmfast amplifies from the first token, as the paper describes; ``amplify_first_token: false``
  reproduces the official behaviour;
- the image span comes from the running layout (vision slots of the layer's group), not from fixed
  indices, so left padding, LLaVA-NeXT's tiles and pruned vision tokens are handled; amplified rows
  are recomputed in fp32 (the official code works in fp16 eager attention);
- under decode-without-cache (a stage that re-runs the whole sequence) the rows of the generated
  tokens are amplified as well, matching what the cached decode computes.
Families: all six (it needs nothing of the model). The edit is keyed on the running layout's vision slots, not on
positions, so it runs under M-RoPE (Qwen-VL) and anyres packing unchanged; on the Qwen families no-op =
greedy and batch (mixed image sizes) = per sample are tested (``tests/test_family_reasons.py``). The
release (LALBJ/PAI) has LLaVA and MiniGPT-4 code, none for the Qwen2-VL families: nothing was checked
against a Qwen release.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..capabilities import Capabilities
from ..config import opt
from ..errors import ConfigError
from ..registry import DECODERS
from ._attn_edit import StagedSlotClasses, edit_rows, held_slot_classes, install_override, override_caps, static_step
from .base import DecodeOutput, DecodeRequest
from .branches import Branch, MultiBranchDecoder
from .loop import autoregressive, sample_from, warpers


def pai_logits(logits: torch.Tensor, image_keys: torch.Tensor, alpha: float) -> torch.Tensor:
    """PAI's edit of attention logits: ``w + alpha |w|`` on the image keys.

    logits: [B, H, R, K] (scaled, before the mask); image_keys: [B, R, K] bool (rows to edit x image keys).
    """
    return torch.where(image_keys[:, None], logits + alpha * logits.abs(), logits)


def cfg_fuse(clean: torch.Tensor, unconditioned: torch.Tensor, gamma: float) -> torch.Tensor:
    """PAI's logits refine before the plausibility mask: ``gamma (s - u) + u`` on log-probabilities."""
    s = torch.log_softmax(clean.float(), dim=-1)
    u = torch.log_softmax(unconditioned.float(), dim=-1)
    return gamma * (s - u) + u


@DECODERS.register("pai", description="PAI: amplify attention to image tokens + CFG against an image-free prompt")
class PAI(MultiBranchDecoder):
    """Paying More Attention to Image."""

    use_warpers = True

    @dataclass(frozen=True)
    class Config:
        alpha: float = opt(0.2, lo=0.0, hi=10.0, doc="attention amplification w + alpha|w| on image keys (0 = off)")
        gamma: float = opt(1.1, lo=0.0, hi=20.0, doc="CFG weight against the image-free prompt (1 = off)")
        beta: float = opt(0.1, lo=0.0, hi=1.0, doc="adaptive plausibility cutoff of the CFG step (0 = off)")
        start_layer: int = opt(
            2, lo=0, doc="first amplified LLM layer (0-based; absolute on any depth, see the docstring)"
        )
        end_layer: int | None = opt(None, doc="one past the last amplified layer (default: the LLM's depth, 32)")
        amplify_first_token: bool = opt(True, doc="amplify at prefill too (false: the official code's CFG quirk)")
        sample: bool = opt(False, doc="sample instead of greedy")
        temperature: float = opt(1.0, lo=1e-4, hi=100.0)
        top_p: float = opt(1.0, lo=0.0, hi=1.0)
        top_k: int = opt(0, lo=0)

    @classmethod
    def capabilities(cls, params) -> Capabilities:
        cfg = params if params is not None else cls.Config()
        return override_caps(cfg.alpha != 0.0, search="single" if cfg.gamma == 1.0 else "branches")

    @classmethod
    def check_facts(cls, config, facts) -> list[int]:
        n = facts.llm_layers
        end = n if config.end_layer is None else config.end_layer
        # an end_layer given that is not after a valid start_layer, or past the depth: that key is at fault
        if config.end_layer is not None and config.start_layer < n and not config.start_layer < end <= n:
            raise ConfigError(
                "end_layer",
                f"{end} is not one past a layer from start_layer ({config.start_layer}) to the last of this {n}-layer "
                f"LLM; give {config.start_layer + 1}..{n}, or leave it unset (the depth)",
            )
        if not 0 <= config.start_layer < end <= n:
            raise ConfigError(
                "start_layer", f"layers {config.start_layer}..{end - 1} are not a range of this {n}-layer LLM"
            )
        return list(range(config.start_layer, end))

    def install(self) -> None:
        from ..capabilities import ModelFacts

        self.layers = self.check_facts(self.config, ModelFacts.of_adapter(self.ctx.adapter))
        # the image keys of a static decode step (refilled before each step) and of a captured prefill segment (before
        # it runs), in fixed memory that the graphs read
        self._static = StagedSlotClasses(
            self.layers,
            ("image",),
            lambda: self.ctx.runner.active,
            image_only=True,
            run=self.ctx.captured,
            enabled=lambda: self.ctx.decoding is None or self.ctx.decoding is self,  # a per-call decoder: no edit
        )
        if self.config.alpha != 0.0:
            for layer in self.layers:
                install_override(self.ctx, layer, self._override(layer), "PAI (pai)", self._static.carried())

    def _override(self, layer: int):
        alpha, first = self.config.alpha, self.config.amplify_first_token

        def override(module, query, key, value, attention_mask, scaling, base, dropout=0.0, **kwargs):
            out, _ = base(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
            state = self.ctx.runner.active
            if state is None or self._static.imageless(state):  # the image-free CFG branch: nothing to amplify
                return out
            q_len, k_len = query.shape[2], key.shape[2]
            prefill = q_len == k_len
            decode = static_step(state, query, key)
            if decode or (prefill and self._static.staged_prefill(state, layer)):  # a graph's: no host read
                if prefill and not first:
                    return out
                image = self._static.get(state, layer, "image", k_len, query.device)  # [B, K]
                has = self._static.get(state, layer, "has_image", k_len, query.device)  # [B, 1]
                # a decode step's new slots are all generated tokens' (edited); a static prefill holds none, so only
                # its last row is edited
                r0 = 0 if decode else q_len - 1
                rows = has.expand(-1, q_len) if decode else torch.cat([has.new_zeros(has.shape[0], r0), has], 1)

                def edit_staged(logits: torch.Tensor, r0: int) -> torch.Tensor:
                    return pai_logits(logits, rows[:, r0:, None] & image[:, None, :], alpha)

                return edit_rows(query, key, value, attention_mask, scaling, out, rows, edit_staged, r0=r0)
            cls = held_slot_classes(state, layer, k_len, "PAI")
            gen = cls.generated[:, k_len - q_len :]  # [B, Q] generated tokens' rows (a recompute's: every one)
            rows = gen.clone()
            if not prefill:
                rows[:, -1] = True  # the last query row of a decode forward
            elif first:  # the prompt's last row, amplified at the prefill (a recompute: the row before the generated)
                pos = torch.arange(q_len, device=rows.device)
                prompt = cls.valid[:, k_len - q_len :] & ~gen
                rows |= pos == torch.where(prompt, pos, -1).max(1, keepdim=True).values
            rows &= cls.image.any(1, keepdim=True)

            def edit(logits: torch.Tensor, r0: int) -> torch.Tensor:
                sel = rows[:, r0:, None] & cls.image[:, None, :]  # [B, R, K]
                return pai_logits(logits, sel, alpha)

            return edit_rows(query, key, value, attention_mask, scaling, out, rows, edit)

        return override

    # -- decoding ------------------------------------------------------------------------------
    def branches(self, req: DecodeRequest) -> list[Branch]:
        return [Branch("no_image", self.ctx.text_only_inputs(req.batch))]

    def fuse(self, logits, step):
        return cfg_fuse(logits["clean"], logits["no_image"], self.config.gamma)

    def decode(self, req: DecodeRequest) -> DecodeOutput:
        cfg = self.config
        if cfg.gamma != 1.0:
            out = super().decode(req)
        else:  # official CFGLogits returns log_softmax(l) unchanged: the same argmax / distribution
            gens = req.generators(self.ctx.device)
            procs = warpers(cfg.temperature, cfg.top_k, cfg.top_p)

            def choose(logits, step, state):
                return sample_from(procs(None, logits), gens) if cfg.sample else logits.argmax(-1)

            out = autoregressive(self.ctx, req.inputs, choose, req.max_new_tokens)
            out.stats = {"branches": ["clean"], "forwards_per_step": 1}
        out.stats["amplified_layers"] = self.layers if cfg.alpha != 0.0 else []
        return out
