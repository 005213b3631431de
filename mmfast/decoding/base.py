"""Base class for decoders: the loop that turns prefill logits into tokens.

A decoder supplies a step policy to the one decode driver (:func:`mmfast.decoding.loop.drive`: greedy,
sampling, contrastive branches, VHR) or owns a search (beam, OPERA's rollback) that ends through the
driver's shared :func:`~mmfast.decoding.loop.finish`. Every forward goes through the context's
:class:`~mmfast.runtime.LMRunner`, so pruning stages compose with every decoder. When the recipe has a
drafter, the session runs the speculative engine with the decoder's :meth:`Decoder.sampling` instead.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..capabilities import Capabilities
from ..errors import ConfigError
from ..flops import LLAVA_7B, LMShape, prefill_flops, project_schedule
from ..registry import Method

if TYPE_CHECKING:
    from ..inputs import PreparedBatch
    from ..models.base import LMInputs, VisionBatch
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

    def generators(self, device: torch.device) -> list[torch.Generator]:
        """One random generator per sample, seeded by (seed, sample identity): a sample draws the
        same numbers whatever batch, shard or process it is decoded in (see :func:`sample_seed`)."""
        return [sample_generator(sample_seed(self.seed, self.batch, b), device) for b in range(self.batch.batch_size)]


def sample_seed(seed: int, batch: PreparedBatch, b: int) -> int:
    """A 63-bit seed for sample ``b`` of ``batch`` from the run's ``seed`` and the sample's identity:
    its ``doc_id`` (``batch.meta[b]["doc_id"]``) when the caller gave one, else its prompt and the
    bytes of its images and video frames. Never depends on the sample's position in the batch."""
    meta = batch.meta[b] if b < len(batch.meta) else {}
    doc_id = meta.get("doc_id") if isinstance(meta, dict) else None
    h = hashlib.sha256(f"mmfast-sample\0{seed}\0".encode())
    if doc_id is not None:
        h.update(f"doc\0{doc_id}".encode())
    else:
        h.update(f"prompt\0{batch.prompts[b]}\0".encode())
        clip = batch.videos[b] if b < len(batch.videos) else None
        for im in [*batch.images[b], *(clip.frames if clip is not None else [])]:
            h.update(f"{im.mode}\0{im.size[0]}x{im.size[1]}\0".encode())
            h.update(im.tobytes())
    return int.from_bytes(h.digest()[:8], "big") >> 1


def sample_generator(seed: int, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


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
    #: per-method statistics of the clean branch's LLM stages (``LMState.stats``, first B rows)
    method_stats: dict[str, dict[str, Any]] = field(default_factory=dict)

    def set_prefill_accounting(self, acc: Accounting) -> None:
        self.kv_bytes_prefill = acc.kv_bytes
        self.vision_tokens_layer_avg = acc.vision_layer_avg
        self.flops_prefill = acc.flops
        self.flops_prefill_7b = acc.flops_7b


@dataclass(frozen=True)
class Sampling:
    """How the speculative engine chooses tokens for a decoder (temperature 0 = greedy)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0


class Decoder(Method):
    """Turns a prepared batch into tokens."""

    caps: ClassVar[Capabilities] = Capabilities()

    def observe_tower(self, vision: VisionBatch) -> None:
        """Right after the vision tower ran: move what this decoder's tower hooks saw into ``vision``."""

    def sampling(self) -> Sampling | None:
        """The token choice the speculative engine reproduces losslessly, or None when this decoder
        cannot be served by draft-and-verify (see its capabilities)."""
        return None

    def install(self) -> None:
        """Register hooks (called once when the session opens)."""

    def max_step_tokens(self) -> int:
        """The most slots one of this decoder's steps appends after the generated tokens it holds (a static
        cache reserves them): one, unless it looks ahead (OPERA's candidates)."""
        return 1

    def decode(self, req: DecodeRequest) -> DecodeOutput:
        raise NotImplementedError


def existing_layers(layers: Iterable[int], n: int) -> list[int]:
    """``layers`` (config key ``layers``, 0-based) as a list, refused unless each is a layer of this ``n``-layer
    LLM."""
    layers = list(layers)
    bad = [layer for layer in layers if not 0 <= layer < n]
    if bad:
        raise ConfigError("layers", f"{bad} do not exist in this {n}-layer LLM (0-based, 0..{n - 1})")
    return layers


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

    def rows(self, n: int, start: int = 0) -> Accounting:
        """The accounting of rows ``start .. start + n - 1`` (the clean branch of a branch batch)."""
        return Accounting(
            *(v[start : start + n] for v in (self.kv_bytes, self.vision_layer_avg, self.flops, self.flops_7b))
        )


def state_accounting(state: LMState) -> Accounting:
    """Logical KV bytes, layer-averaged vision tokens and prefill FLOPs of each sample."""
    # per-layer counts of what prefill computed (before any KV policy trimmed the cache)
    acc = state.accounting
    vis = acc.vision_override if acc.vision_override is not None else acc.prefill_vision
    vis = (vis if vis is not None else state.vision_tokens_per_layer()).float()  # [B, n_layers]
    tok = acc.prefill_tokens
    tok = (tok if tok is not None else state.tokens_per_layer()).float()  # [B, n_layers] text + vision
    shape = LMShape.of(state.text_config) if state.text_config is not None else None
    starts = [
        g.ref_start if g.ref_start is not None else g.start * LLAVA_7B.n_layers / state.n_layers for g in state.groups
    ]
    starts[0] = 0
    flops, flops_7b = [], []
    # one read to the host for every sample (not one per sample and group): the tokens per layer, then the vision
    # tokens' layer average
    rows = torch.cat([tok, vis.mean(1, keepdim=True).to(tok.device)], 1).tolist()  # [B][n_layers + 1]
    tok, vis_avg = [r[:-1] for r in rows], [r[-1] for r in rows]
    for b in range(state.batch_size):
        per_group = [tok[b][grp.start] for grp in state.groups]  # groups never merge: starts stay valid
        flops.append(prefill_flops(tok[b], shape) if shape else 0.0)
        flops_7b.append(prefill_flops(project_schedule(starts, per_group, LLAVA_7B.n_layers), LLAVA_7B))
    return Accounting(state.kv_bytes_per_sample(), vis_avg, flops, flops_7b)
