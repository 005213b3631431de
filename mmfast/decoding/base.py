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
    from ..models.base import LMInputs, VisionBatch
    from ..pipeline import Session
    from ..runtime import LMState


@dataclass
class DecodeRequest:
    """Everything a decoder gets for one batch."""

    batch: PreparedBatch  # prompts, images, token ids, pixel values
    vision: VisionBatch  # the (pruned) vision features the inputs were built from
    inputs: LMInputs  # the spliced, left-padded LLM inputs of the clean branch
    max_new_tokens: int
    seed: int
    raw_vision: VisionBatch | None = None  # before feature-stage pruning (DAMRO's outlier branch)


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
    flops_prefill: list[float] = field(default_factory=list)  # per sample, model at hand (papers' convention)
    flops_prefill_7b: list[float] = field(default_factory=list)  # same schedule on the LLaVA-1.5-7B shape
    stats: dict[str, Any] = field(default_factory=dict)

    def set_prefill_accounting(self, acc: Accounting) -> None:
        self.kv_bytes_prefill = acc.kv_bytes
        self.vision_tokens_layer_avg = acc.vision_layer_avg
        self.flops_prefill = acc.flops
        self.flops_prefill_7b = acc.flops_7b


class Decoder:
    """Turns a prepared batch into tokens."""

    Config: ClassVar[type]
    supports_speculative: ClassVar[bool] = False
    families: ClassVar[frozenset[str]] = frozenset({"llava", "llava_next"})
    speculative_conflict: ClassVar[str] = "it owns its own search loop"

    def __init__(self, config: Any, session: Session) -> None:
        self.config = config
        self.session = session

    def install(self) -> None:
        """Register hooks (called once when the session opens)."""

    def decode(self, req: DecodeRequest) -> DecodeOutput:
        raise NotImplementedError

    @classmethod
    def check_recipe(cls, recipe: Recipe) -> str | None:
        return None


def now(device: torch.device) -> float:
    """Wall clock after the device has finished queued work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@dataclass
class Accounting:
    """Per-sample token accounting of a state (right after prefill, or at the end)."""

    kv_bytes: list[int]
    vision_layer_avg: list[float]
    flops: list[float]
    flops_7b: list[float]


def state_accounting(state: LMState) -> Accounting:
    """Logical KV bytes, layer-averaged vision tokens and prefill FLOPs of each sample."""
    from ..flops import LLAVA_7B, LMShape, prefill_flops, project_schedule

    # per-layer counts of what prefill computed (before any KV policy trimmed the cache)
    vis = state.extras.get("vision_tokens_per_layer", state.extras.get("prefill_vision_per_layer"))
    vis = (vis if vis is not None else state.vision_tokens_per_layer()).float()  # [B, n_layers]
    tok = state.extras.get("prefill_tokens_per_layer")
    tok = (tok if tok is not None else state.tokens_per_layer()).float()  # [B, n_layers] text + vision
    shape = LMShape.of(state.text_config) if state.text_config is not None else None
    starts = [g.ref_start if g.ref_start is not None else g.start * LLAVA_7B.n_layers / state.n_layers for g in state.groups]
    starts[0] = 0
    flops, flops_7b = [], []
    for b in range(state.batch_size):
        per_group = [float(tok[b, grp.start]) for grp in state.groups]  # groups never merge: starts stay valid
        flops.append(prefill_flops(tok[b].tolist(), shape) if shape else 0.0)
        flops_7b.append(prefill_flops(project_schedule(starts, per_group, LLAVA_7B.n_layers), LLAVA_7B))
    return Accounting(state.kv_bytes_per_sample(), vis.mean(1).tolist(), flops, flops_7b)
