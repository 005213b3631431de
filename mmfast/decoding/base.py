"""Base class for decoders: the loop that turns prefill logits into tokens.

Decoders own their loop (greedy, sampling, beam, contrastive branches, OPERA's rollback, ...) and use
the session's :class:`~mmfast.runtime.LMRunner` for every forward, so pruning stages compose with
them. A decoder returns a :class:`DecodeOutput`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from ..config import Recipe
    from ..model import PreparedBatch
    from ..models.base import LMInputs
    from ..pipeline import Session
    from ..runtime import LMState


@dataclass
class DecodeOutput:
    """What a decoder produced for a batch."""

    tokens: list[list[int]]  # per sample, generated ids (EOS and padding removed)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    n_forwards: int = 0  # target-model forwards after prefill
    kv_bytes_prefill: list[int] = field(default_factory=list)  # per sample, logical bytes
    kv_bytes_end: list[int] = field(default_factory=list)
    vision_tokens_layer_avg: list[float] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)


class Decoder:
    """Turns a prepared batch into tokens."""

    Config: ClassVar[type]
    supports_speculative: ClassVar[bool] = False
    speculative_conflict: ClassVar[str] = "it owns its own search loop"

    def __init__(self, config: Any, session: Session) -> None:
        self.config = config
        self.session = session

    def install(self) -> None:
        """Register hooks (called once when the session opens)."""

    def decode(self, batch: PreparedBatch, inputs: LMInputs, max_new_tokens: int, seed: int) -> DecodeOutput:
        raise NotImplementedError

    @classmethod
    def check_recipe(cls, recipe: Recipe) -> str | None:
        return None


def now(device: torch.device) -> float:
    """Wall clock after the device has finished queued work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def state_accounting(state: LMState) -> tuple[list[int], list[float]]:
    """Per-sample logical KV bytes and layer-averaged vision-token count of a state."""
    per_layer = state.vision_tokens_per_layer().float()  # [B, n_layers]
    return state.kv_bytes_per_sample(), per_layer.mean(1).tolist()
