"""Multinomial sampling with the usual warpers (temperature, top-k, top-p).

The "regular" baseline of VCD, RITUAL and DAMRO is plain sampling at T=1, top-p=1, no top-k: the
defaults here. With a drafter, the speculative engine's lossless rejection rule is used instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..capabilities import Capabilities
from ..config import opt
from ..registry import DECODERS
from .base import DecodeOutput, Decoder, DecodeRequest, Sampling
from .loop import autoregressive, sample_from, warpers


@DECODERS.register("sample", description="multinomial sampling (T, top-k, top-p); the VCD/RITUAL 'regular' baseline")
class Sample(Decoder):
    """Sampling."""

    caps = Capabilities(speculative=True)

    @dataclass(frozen=True)
    class Config:
        temperature: float = opt(1.0, lo=1e-4, hi=100.0, doc="softmax temperature")
        top_k: int = opt(0, lo=0, doc="keep the k most likely tokens (0 = off)")
        top_p: float = opt(1.0, lo=0.0, hi=1.0, doc="nucleus mass (1 = off)")

    def sampling(self) -> Sampling:
        cfg = self.config
        return Sampling(cfg.temperature, cfg.top_k, cfg.top_p)

    def decode(self, req: DecodeRequest) -> DecodeOutput:
        cfg = self.config
        gens = req.generators(self.ctx.device)  # one per sample: batch-independent draws
        procs = warpers(cfg.temperature, cfg.top_k, cfg.top_p)

        def choose(logits, step, state):
            return sample_from(procs(None, logits), gens)

        return autoregressive(self.ctx, req.inputs, choose, req.max_new_tokens)
