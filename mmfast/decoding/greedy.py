"""Greedy decoding (argmax at every step): the baseline every other decoder is compared with.

With a ``speculative`` section in the recipe, the session runs the lossless draft-and-verify engine
instead of one token per forward; the output tokens are identical.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..capabilities import Capabilities
from ..registry import DECODERS
from .base import DecodeOutput, Decoder, DecodeRequest, Sampling
from .loop import autoregressive


@DECODERS.register(
    "greedy", description="argmax decoding (baseline); lossless speculative drafting when a drafter is set"
)
class Greedy(Decoder):
    """Greedy decoding."""

    caps = Capabilities(speculative=True)

    @dataclass(frozen=True)
    class Config:
        pass

    def sampling(self) -> Sampling:
        return Sampling(temperature=0.0)

    def decode(self, req: DecodeRequest) -> DecodeOutput:
        return autoregressive(self.ctx, req.inputs, lambda logits, step, state: logits.argmax(-1), req.max_new_tokens)
