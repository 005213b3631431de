"""Greedy decoding (argmax at every step): the baseline every other decoder is compared with.

With a ``speculative`` section in the recipe, greedy runs the lossless draft-and-verify engine
instead of one token per forward; the output tokens are identical.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..registry import DECODERS
from .base import Decoder, DecodeOutput, DecodeRequest
from .loop import autoregressive


@DECODERS.register("greedy", description="argmax decoding (baseline); lossless speculative drafting when a drafter is set")
class Greedy(Decoder):
    """Greedy decoding."""

    supports_speculative = True

    @dataclass(frozen=True)
    class Config:
        pass

    def decode(self, req: DecodeRequest) -> DecodeOutput:
        if self.session.drafter is not None:
            from ..speculative.engine import speculative_decode

            return speculative_decode(self.session, req, temperature=0.0)
        return autoregressive(self.session, req.inputs, lambda logits, step, state: logits.argmax(-1), req.max_new_tokens)
