"""The one decode driver (:func:`drive`), the single-branch step policy, and token selection helpers."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Protocol

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from .base import Accounting, DecodeOutput, now, state_accounting

if TYPE_CHECKING:
    from ..context import MethodContext
    from ..models.base import LMInputs
    from ..runtime import LMState, StepOutput

# (logits [B, V] fp32, step, state) -> next tokens [B]
ChooseFn = Callable[[torch.Tensor, int, "LMState"], torch.Tensor]


class Streamer(Protocol):
    """What :func:`drive` feeds while it decodes (transformers' ``BaseStreamer``: ``TextStreamer``,
    ``TextIteratorStreamer`` fit): ``put`` gets the chosen token ids of every step, ``[B]`` on the CPU
    (finished rows get the pad id); ``end`` is called once after the last token."""

    def put(self, value: torch.Tensor) -> None: ...

    def end(self) -> None: ...


_STREAMER: ContextVar[Streamer | None] = ContextVar("mmfast_streamer", default=None)
_STREAMED: ContextVar[list[int] | None] = ContextVar("mmfast_streamed", default=None)


@contextlib.contextmanager
def streaming(streamer: Streamer) -> Iterator[list[int]]:
    """Within the block, :func:`drive` puts every step's tokens into ``streamer``. Yields a one-element
    list counting the steps streamed (0 after the block means the decoder never ran the driver)."""
    count = [0]
    token, token_count = _STREAMER.set(streamer), _STREAMED.set(count)
    try:
        yield count
    finally:
        _STREAMER.reset(token)
        _STREAMED.reset(token_count)


def warpers(temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> LogitsProcessorList:
    """transformers' sampling warpers, in generate()'s order (temperature, top-k, top-p)."""
    procs = LogitsProcessorList()
    if temperature != 1.0:
        procs.append(TemperatureLogitsWarper(temperature))
    if top_k > 0:
        procs.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        procs.append(TopPLogitsWarper(top_p))
    return procs


def sample_from(logits: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """Multinomial sample from softmax(logits) ([B, V] -> [B]); row b draws from ``generators[b]``
    only, so a sample's tokens do not depend on the other rows of its batch."""
    if len(generators) != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} rows to sample but {len(generators)} generators (mmfast bug)")
    probs = torch.softmax(logits.float(), dim=-1)
    return torch.cat([torch.multinomial(probs[b : b + 1], 1, generator=g)[:, 0] for b, g in enumerate(generators)])


def strip(tokens: list[int], stop_ids) -> list[int]:
    """Generated ids up to (excluding) the first stop token."""
    out = []
    for t in tokens:
        if t in stop_ids:
            break
        out.append(t)
    return out


class StepPolicy(Protocol):
    """What a decoder supplies to :func:`drive`: how to prefill, choose and advance.

    ``prefill`` returns the state that holds the clean branch (accounting is taken from its first
    ``B`` rows) and the first next-token logits ``[B, V]``; ``choose`` turns logits into tokens
    ``[B]``; ``advance`` feeds the chosen tokens and returns the next logits ``[B, V]``.
    """

    n_forwards: int

    def prefill(self) -> tuple[LMState, torch.Tensor]: ...

    def choose(self, logits: torch.Tensor, step: int) -> torch.Tensor: ...

    def advance(self, tokens: torch.Tensor) -> torch.Tensor: ...

    def end_state(self) -> LMState: ...


def finish(
    ctx: MethodContext,
    rows: list[list[int]],
    *,
    times: tuple[float, float, float],
    acc: Accounting,
    kv_end: list[int],
    n_forwards: int,
    method_stats: dict[str, dict[str, Any]],
    stats: dict[str, Any] | None = None,
) -> DecodeOutput:
    """The shared end of every decode loop: strip at the first stop token, times and accounting."""
    t0, t1, t2 = times
    out = DecodeOutput(
        tokens=[strip(r, ctx.special.eos) for r in rows],
        prefill_s=t1 - t0,
        decode_s=t2 - t1,
        n_forwards=n_forwards,
        kv_bytes_end=kv_end,
        stats=dict(stats or {}),
        method_stats=method_stats,
    )
    out.set_prefill_accounting(acc)
    return out


def rows_at_stop(
    end: dict[str, dict[str, Any]], at_stop: dict[int, dict[str, dict[str, Any]]]
) -> dict[str, dict[str, Any]]:
    """``end`` (method statistics at the end of a batch, ``LMState.stats_rows``) with the ``per_sample_*`` entries of
    each row in ``at_stop`` (row -> the statistics when that row stopped) taken from its snapshot: what a decode-time
    policy counted on the padding fed to a finished row (Dynamic-LLaVA's generated and skipped tokens, ZipVL's bytes)
    is not that sample's."""

    def take(d: dict[str, Any], snap: dict[str, Any], b: int) -> None:
        for k, v in d.items():
            old = snap.get(k)
            if isinstance(v, dict) and isinstance(old, dict):
                take(v, old, b)
            elif str(k).startswith("per_sample_") and isinstance(v, list) and isinstance(old, list):
                if b < len(v) and b < len(old):
                    v[b] = old[b]

    for b, snap in at_stop.items():
        for name, d in end.items():
            if isinstance(snap.get(name), dict):
                take(d, snap[name], b)
    return end


def drive(ctx: MethodContext, policy: StepPolicy, batch_size: int, max_new_tokens: int) -> DecodeOutput:
    """The one decode driver: prefill, then one token per step until EOS or ``max_new_tokens``.

    Owns timing, stopping (finished rows are fed padding), stripping and accounting; the policy owns
    the forwards and the token choice. Inside :func:`streaming`, every step's tokens go to the streamer.
    """
    device = ctx.device
    streamer, streamed = _STREAMER.get(), _STREAMED.get()
    stop = set(ctx.special.eos)
    t0 = now(device)
    state, logits = policy.prefill()
    t1 = now(device)
    acc = state_accounting(state).rows(batch_size)
    # stop bookkeeping on the host: one device-to-host copy (the step's sync) per step
    finished = [False] * batch_size
    generated: list[list[int]] = []
    kv_at_stop: dict[int, int] = {}  # a row's cache when it stopped: the padding fed after it is not its own
    stats_at_stop: dict[int, dict[str, dict[str, Any]]] = {}  # likewise its method statistics (rows_at_stop)
    for step in range(max_new_tokens):
        nxt = policy.choose(logits, step)  # [B]
        if any(finished):  # finished rows are fed padding
            nxt = nxt.masked_fill(torch.tensor(finished, device=nxt.device), ctx.special.pad)
        row = nxt.tolist()
        generated.append(row)
        if streamer is not None:
            streamer.put(torch.tensor(row))
            streamed[0] += 1
        stopped = [b for b, t in enumerate(row) if t in stop and not finished[b]]  # stop token at this step
        for b in stopped:
            finished[b] = True
        if all(finished) or step == max_new_tokens - 1:
            break
        if stopped:
            now_state = policy.end_state()
            kv_now = now_state.kv_bytes_per_sample()
            kv_at_stop.update({b: kv_now[b] for b in stopped})
            stats_now = copy.deepcopy(now_state.stats_rows(batch_size))
            stats_at_stop.update({b: stats_now for b in stopped})
        logits = policy.advance(nxt)
    t2 = now(device)
    ids = [list(r) for r in zip(*generated)] if generated else [[] for _ in range(batch_size)]
    end = policy.end_state()  # stats of decode-time policies are complete only now
    kv_end = [kv_at_stop.get(b, kv) for b, kv in enumerate(end.kv_bytes_per_sample()[:batch_size])]
    return finish(
        ctx,
        ids,
        times=(t0, t1, t2),
        acc=acc,
        kv_end=kv_end,
        n_forwards=policy.n_forwards,
        method_stats=rows_at_stop(end.stats_rows(batch_size), stats_at_stop),
    )


class SingleBranch:
    """One branch: ``runner.prefill`` then ``runner.step`` (or a full recompute without cache)."""

    def __init__(
        self,
        ctx: MethodContext,
        inputs: LMInputs,
        choose: ChooseFn,
        on_prefill: Callable[[LMState, StepOutput], None] | None = None,
    ) -> None:
        self.ctx, self.inputs, self._choose, self.on_prefill = ctx, inputs, choose, on_prefill
        self.state: LMState | None = None
        self.n_forwards = 0

    def prefill(self) -> tuple[LMState, torch.Tensor]:
        self.state, out = self.ctx.runner.prefill(self.inputs)
        if self.on_prefill is not None:
            self.on_prefill(self.state, out)  # may drop rows (VHR's text-only stream)
        return self.state, out.logits[:, -1]

    def choose(self, logits: torch.Tensor, step: int) -> torch.Tensor:
        return self._choose(logits, step, self.state)

    def advance(self, tokens: torch.Tensor) -> torch.Tensor:
        runner, state = self.ctx.runner, self.state
        self.n_forwards += 1
        if runner.use_cache:
            return runner.step(state, tokens[:, None]).logits[:, -1]
        # recompute the whole sequence (Dynamic-LLaVA's decode-without-cache rule)
        inputs = state.inputs.append(tokens[:, None], self.ctx.adapter.embed_tokens(tokens[:, None]))
        self.state, out = runner.prefill(inputs)
        return out.logits[:, -1]

    def end_state(self) -> LMState:
        return self.state


def autoregressive(
    ctx: MethodContext,
    inputs: LMInputs,
    choose: ChooseFn,
    max_new_tokens: int,
    *,
    on_prefill: Callable[[LMState, StepOutput], None] | None = None,
    batch_size: int | None = None,
) -> DecodeOutput:
    """Single-branch decoding with ``choose`` through the driver."""
    policy = SingleBranch(ctx, inputs, choose, on_prefill)
    return drive(ctx, policy, batch_size or inputs.batch_size, max_new_tokens)
