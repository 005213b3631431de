"""Self-speculative decoding by layer skipping (Draft & Verify, Zhang et al. ACL 2024; SWIFT, 2024).

Algorithm: the draft is the target itself with a set of decoder layers skipped; it drafts up to
``gamma`` tokens one at a time, stopping early when its top-1 probability falls below ``threshold``
(dynamic draft length); the full model then verifies the chain in one forward. The draft writes into
the shared KV cache of the layers it runs; those entries are rolled back after drafting, and the
verification forward writes the exact ones. The skip set is given, or chosen on calibration prompts by
greedy search (repeatedly add the layer whose removal keeps argmax agreement with the full model
highest under teacher forcing) until ``skip_fraction`` of the layers are skipped; layer 0 is never
skipped. With ``skip: null`` (the default) the first batch served is the calibration set (logged); pass
``calibration_tokens: 0`` and an explicit ``skip`` for fully reproducible runs (at T > 0 the draft decides
which draws the verify rule uses, so with ``skip: null`` a sampled answer depends on which sample came first).
Hook points: an instance-level ``forward`` replacement on the skippable layers (identity while the
draft runs), owned and restored by the session; captured steps are keyed on the draft mode and skip set
(``runner.graph_variants``), so a draft step never replays the target's graph or the reverse.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..capabilities import Capabilities, ModelFacts
from ..config import opt
from ..errors import ConfigError
from ..registry import DRAFTERS
from .base import Drafter
from .tree import DraftTree

logger = logging.getLogger(__name__)


@DRAFTERS.register("layer_skip", description="self-speculative drafts from the target with layers skipped; no training")
class LayerSkip(Drafter):
    caps = Capabilities()
    """Self-speculative layer skipping."""

    @dataclass(frozen=True)
    class Config:
        skip: tuple[int, ...] | None = opt(None, doc="layers skipped by the draft; null = calibrate on the first batch")
        skip_fraction: float = opt(0.5, lo=0.0, hi=0.9, doc="fraction of layers to skip when calibrating")
        gamma: int = opt(4, lo=1, hi=32, doc="max draft tokens per cycle")
        threshold: float = opt(0.6, lo=0.0, hi=1.0, doc="stop drafting when the draft's top-1 prob is lower")
        calibration_tokens: int = opt(16, lo=0, hi=256, doc="greedy tokens per calibration prompt")

    @classmethod
    def check_facts(cls, config, facts) -> None:
        """``skip`` must name layers 1..n-1 of this LLM (layer 0 always runs); checked before weights load."""
        n = facts.llm_layers
        bad = sorted(i for i in set(config.skip or ()) if not 0 < i < n)
        if bad:
            raise ConfigError(
                "skip",
                f"cannot skip layers {bad}: layer 0 always runs and this LLM has {n} layers; give layers 1..{n - 1}",
            )

    def install(self) -> None:
        layers = self.ctx.adapter.layers
        self.check_facts(self.config, ModelFacts.of_adapter(self.ctx.adapter))
        self.active = False
        self.skip: set[int] = set(self.config.skip or ())
        self.skip_chosen = self.config.skip is not None  # skip: null calibrates once (it may choose no layer)
        for i in range(1, len(layers)):
            layer = layers[i]
            self.ctx.hooks.set_attr(layer, "forward", self._wrap(i, layer.forward))
        # a captured step records one branch of the skips: the draft's graphs are not the target's
        self.ctx.runner.graph_variants.append(lambda state: ("layer_skip", self.active and tuple(sorted(self.skip))))

    def _wrap(self, index: int, forward):
        def maybe_skip(hidden_states, *args, **kwargs):
            if self.active and index in self.skip:
                return hidden_states  # the draft skips this layer (no compute, no cache write)
            return forward(hidden_states, *args, **kwargs)

        # a captured prefill segment may run it: a prefill never drafts (``active`` is False there)
        maybe_skip.mmfast_graph_safe = True  # type: ignore[attr-defined]
        return maybe_skip

    def begin(self, ctx) -> None:
        if not self.skip_chosen:
            self.skip = self.calibrate(ctx)
            self.skip_chosen = True

    @torch.inference_mode()
    def calibrate(self, ctx) -> set[int]:
        """Greedy skip-set search on this prompt under teacher forcing (full-model greedy tokens)."""
        runner = self.ctx.runner
        n_layers = len(self.ctx.adapter.layers)
        # layer 0 always runs: at most n_layers - 1 layers can be skipped (a small model, a large fraction)
        target = min(int(round(self.config.skip_fraction * n_layers)), n_layers - 1)
        # the full model's greedy continuation of this prompt
        dev = ctx.inputs.input_ids.device
        state, out = runner.prefill(ctx.inputs)
        toks = [int(out.logits[0, -1].argmax())]
        for _ in range(self.config.calibration_tokens - 1):
            toks.append(int(runner.step(state, torch.tensor([[toks[-1]]], device=dev)).logits[0, -1].argmax()))
        prev = torch.tensor([toks[:-1]], dtype=torch.long, device=dev)  # [1, n-1] (empty for one token)
        seq = ctx.inputs.append(prev, self.ctx.adapter.embed_tokens(prev))
        want = torch.tensor(toks, device=dev)  # [n]

        def agreement(skip: set[int]) -> float:
            self.skip, self.active = skip, True
            try:
                logits = self.ctx.adapter.lm_head(_last_hidden(runner, seq))  # [1, L, V]
            finally:
                self.active = False
            pred = logits[0, -len(toks) :].argmax(-1)
            return float((pred == want).float().mean())

        chosen: set[int] = set()
        while len(chosen) < target:
            scores = {i: agreement(chosen | {i}) for i in range(1, n_layers) if i not in chosen}
            best = max(scores, key=scores.get)
            chosen.add(best)
            logger.info("layer_skip calibration: skip %s (agreement %.3f)", sorted(chosen), scores[best])
        self.skip = chosen
        return chosen

    def max_step_tokens(self) -> int:
        return 1 + self.config.gamma  # the verified chain and its root (the draft steps append fewer)

    def propose(self, ctx, root: int) -> DraftTree:
        runner, state = self.ctx.runner, ctx.state
        cp = state.checkpoint()
        tokens, qs = [], []
        x = root
        self.active = True
        try:
            for _ in range(self.config.gamma):
                logits = runner.step(state, torch.tensor([[x]], device=ctx.inputs.input_ids.device)).logits[0, -1]
                ctx.extras["draft_forwards"] = ctx.extras.get("draft_forwards", 0) + 1
                if ctx.greedy:
                    probs = torch.softmax(logits.float(), -1)
                    x = int(probs.argmax())
                    q = None
                else:
                    probs = ctx.probs(logits)
                    x = int(torch.multinomial(probs, 1, generator=ctx.generator))
                    q = probs
                if float(probs.max()) < self.config.threshold and tokens:
                    break
                tokens.append(x)
                qs.append(q)
                if x in self.ctx.special.eos:
                    break
        finally:
            self.active = False
            state.rollback(cp)
        ctx.extras["draft_tokens"] = ctx.extras.get("draft_tokens", 0) + len(tokens)
        return DraftTree.chain(tokens, qs, device=ctx.inputs.input_ids.device)


def _last_hidden(runner, inputs) -> torch.Tensor:
    """Final-norm hidden states of every position of ``inputs`` (one prefill, current skip set)."""
    out = runner.lm(
        inputs_embeds=inputs.embeds,
        attention_mask=inputs.attention_mask,
        position_ids=runner.adapter.lm_position_ids(inputs.position_ids),
        use_cache=False,
    )
    return out.last_hidden_state
