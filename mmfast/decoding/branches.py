"""The branch manager behind every contrastive / ensemble decoder (VCD, M3ID, RITUAL, DAMRO, LQCD).

A decoder declares auxiliary *branches*: the same prompt with a noised image (VCD), no image (M3ID),
a transformed image (RITUAL), only the outlier tokens (DAMRO), a leading question (LQCD). Each branch
has its own KV cache and is fed the same chosen token at every step; branches whose sequences have
the same length are concatenated along the batch and run as one forward. At each step the decoder
fuses the branch logits:

- contrastive ``(1 + a) l - a l'`` (VCD, DAMRO, LQCD), additive ``l + a l'`` (RITUAL), or M3ID's
  ``l + (1 - g_t) / g_t (l - l_u)`` with ``g_t = exp(-lambda t)``;
- the adaptive plausibility constraint keeps token y only if ``l_y >= log(beta) + max(l)``, computed on
  the clean branch's logits (every reference implementation works in logit space);
- selection: greedy, or sampling with (VCD, RITUAL, M3ID) or without (DAMRO) the usual warpers.

Pruning stages in the same recipe act on every branch's prefill (they are hooked into the runner); an
image branch is encoded with ``ctx.encode_branch``, so per-token decisions (tags) and statistics stay
with each branch's own inputs and states. The loop itself is the one decode driver's.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..config import opt
from ..errors import InputError
from ..models.base import LMInputs
from .base import DecodeOutput, Decoder, DecodeRequest
from .loop import drive, sample_from, warpers

if TYPE_CHECKING:
    from PIL import Image

    from ..context import MethodContext


@dataclass
class Branch:
    name: str
    inputs: LMInputs  # [B, L_branch]
    #: what building the branch decided (``per_sample_*`` lists), merged into the decoder's stats
    stats: dict = field(default_factory=dict)


class BranchSet:
    """Branches of one batch, each with its own KV cache, all fed the same token each step."""

    def __init__(self, ctx: MethodContext, branches: list[Branch]) -> None:
        self.ctx = ctx
        self.names = [b.name for b in branches]
        self.batch = branches[0].inputs.batch_size
        by_len: dict[int, list[int]] = {}
        for i, b in enumerate(branches):
            by_len.setdefault(b.inputs.length, []).append(i)
        self.groups = [(idx, LMInputs.cat([branches[i].inputs for i in idx])) for idx in by_len.values()]
        self.states: list = []
        self.n_forwards = 0

    def _split(self, idx: list[int], logits: torch.Tensor, out: dict[str, torch.Tensor]) -> None:
        for j, i in enumerate(idx):
            out[self.names[i]] = logits[j * self.batch : (j + 1) * self.batch]

    def prefill(self) -> dict[str, torch.Tensor]:
        """Prefill every group; returns last-position logits [B, V] per branch name."""
        out: dict[str, torch.Tensor] = {}
        for idx, inputs in self.groups:
            state, step = self.ctx.runner.prefill(inputs)
            self.states.append(state)
            self._split(idx, step.logits[:, -1], out)
        return out

    def step(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        """Feed ``tokens`` ([B]) to every branch; returns next logits [B, V] per branch."""
        out: dict[str, torch.Tensor] = {}
        for (idx, _), state in zip(self.groups, self.states):
            toks = tokens.repeat(len(idx))[:, None]  # [n_branches * B, 1]
            self._split(idx, self.ctx.runner.step(state, toks).logits[:, -1], out)
            self.n_forwards += 1
        return out

    def clean_state(self):
        """The state holding the clean branch (first branch), and its row offset."""
        for (idx, _), state in zip(self.groups, self.states):
            if 0 in idx:
                return state, idx.index(0) * self.batch
        raise RuntimeError("no clean branch")


def plausibility_mask(clean: torch.Tensor, beta: float) -> torch.Tensor:
    """[B, V] bool: tokens kept by the adaptive plausibility constraint (beta = 0 keeps all)."""
    if beta <= 0:
        return torch.ones_like(clean, dtype=torch.bool)
    cutoff = math.log(beta) + clean.max(dim=-1, keepdim=True).values
    return clean >= cutoff


def contrastive(clean: torch.Tensor, aux: torch.Tensor, alpha: float) -> torch.Tensor:
    return (1 + alpha) * clean - alpha * aux


def additive(clean: torch.Tensor, aux: torch.Tensor, alpha: float) -> torch.Tensor:
    return clean + alpha * aux


def m3id(clean: torch.Tensor, unconditioned: torch.Tensor, t: int, lam: float) -> torch.Tensor:
    # the weight (1 - g) / g = e^(lambda t) - 1 capped at e^50: beyond it the contrast alone orders the tokens (the
    # formula's limit), where exp(-lambda t) underflows to 0 (division by zero) or the weight overflows fp32 (NaN)
    gamma = math.exp(-min(lam * t, 50.0))
    return clean + (1 - gamma) / gamma * (clean - unconditioned)


def query_rng(seed: int, prompt: str, image: Image.Image) -> random.Random:
    """Per-query randomness that does not depend on batch composition (VCD's noise, RITUAL's
    transform, LQCD's template): a function of (seed, prompt, image) only."""
    h = hashlib.sha256(f"{seed}\0{prompt}\0".encode() + image.tobytes()).digest()
    return random.Random(int.from_bytes(h[:8], "big"))


@dataclass(frozen=True)
class BranchConfig:
    """Fusion weight, plausibility cutoff and token selection shared by the branch decoders (sampling
    straight from the softmax of the fused logits: DAMRO's release)."""

    alpha: float = opt(1.0, lo=0.0, hi=20.0, doc="weight of the auxiliary branch (0 = plain decoding)")
    beta: float = opt(0.1, lo=0.0, hi=1.0, doc="adaptive plausibility cutoff on the clean branch (0 = off)")
    sample: bool = opt(True, doc="sample from the fused logits (false: argmax)")


@dataclass(frozen=True)
class WarpedBranchConfig(BranchConfig):
    """A branch decoder that samples through transformers' warpers (VCD's, RITUAL's, LQCD's releases)."""

    temperature: float = opt(1.0, lo=1e-4, hi=100.0, doc="sampling temperature (warpers)")
    top_p: float = opt(1.0, lo=0.0, hi=1.0, doc="nucleus mass (warpers)")
    top_k: int = opt(0, lo=0, doc="top-k, 0 = off (warpers)")


def _check_context(ctx: MethodContext, branches: list[Branch], max_new: int) -> None:
    """Refuse a branch longer than the clean prompt (LQCD's leading rewording) that, with ``max_new`` new tokens,
    exceeds the LLM's context: the session checked the clean prompt only."""
    limit = getattr(ctx.adapter.text_config, "max_position_embeddings", None)
    if not limit:
        return
    for br in branches:
        for b, n in enumerate(br.inputs.attention_mask.sum(1).tolist()):  # [B] real tokens of each sample
            if n + max_new > limit:
                raise InputError(
                    f"input longer than the context of {ctx.name} ({limit} tokens): the {br.name} branch of sample "
                    f"{b}: {n} tokens + {max_new} new tokens = {n + max_new}, {n + max_new - limit} over; shorten the "
                    "prompt or lower max_new_tokens"
                )


class MultiBranchDecoder(Decoder):
    """Base class: subclasses build auxiliary branches and fuse branch logits."""

    def branches(self, req: DecodeRequest) -> list[Branch]:
        raise NotImplementedError

    def fuse(self, logits: dict[str, torch.Tensor], step: int) -> torch.Tensor:
        raise NotImplementedError

    def decode(self, req: DecodeRequest) -> DecodeOutput:
        policy = _BranchPolicy(self, req)
        out = drive(self.ctx, policy, req.inputs.batch_size, req.max_new_tokens)
        out.stats = {"branches": policy.bset.names, "forwards_per_step": len(policy.bset.groups)}
        for branch in policy.branches:
            out.stats.update(branch.stats)
        return out


class _BranchPolicy:
    """The driver's step policy for a branch decoder: prefill every branch, fuse, feed all."""

    def __init__(self, decoder: MultiBranchDecoder, req: DecodeRequest) -> None:
        cfg = decoder.config
        self.decoder, self.req, self.beta, self.sample = decoder, req, cfg.beta, cfg.sample
        self.gens = req.generators(decoder.ctx.device)  # one per sample: batch-independent draws
        # a config with the warper keys (VCD, RITUAL, LQCD; M3ID and PAI declare their own) samples through them;
        # else straight from softmax(fused) (DAMRO)
        warped = isinstance(cfg, WarpedBranchConfig) or hasattr(cfg, "temperature")
        self.procs = warpers(cfg.temperature, cfg.top_k, cfg.top_p) if warped else None
        self.bset: BranchSet
        self.logits: dict[str, torch.Tensor] = {}

    @property
    def n_forwards(self) -> int:
        return self.bset.n_forwards

    def prefill(self):
        self.branches = self.decoder.branches(self.req)
        _check_context(self.decoder.ctx, self.branches, self.req.max_new_tokens)
        self.bset = BranchSet(self.decoder.ctx, [Branch("clean", self.req.inputs), *self.branches])
        self.logits = self.bset.prefill()
        state, row = self.bset.clean_state()
        assert row == 0, "the clean branch leads its group"
        return state, self.logits["clean"]

    def choose(self, clean: torch.Tensor, step: int) -> torch.Tensor:
        fused = self.decoder.fuse(self.logits, step).float()
        fused = fused.masked_fill(~plausibility_mask(self.logits["clean"].float(), self.beta), float("-inf"))
        if not self.sample:
            return fused.argmax(-1)
        return sample_from(self.procs(None, fused) if self.procs is not None else fused, self.gens)

    def advance(self, tokens: torch.Tensor) -> torch.Tensor:
        self.logits = self.bset.step(tokens)
        return self.logits["clean"]

    def end_state(self):
        return self.bset.clean_state()[0]
