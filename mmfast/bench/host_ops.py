"""Host-side torch ops per captured decode step: a CPU proxy for the launch overhead between replays.

With ``model.compile: auto`` on CUDA a decode step replays one captured graph of the LM forward; every
torch op dispatched outside it (mask and position prep, input copies, ``lm_head``, the token choice,
the driver's stop bookkeeping) costs CPU dispatch and a launch, serialised with the GPU by the
driver's per-step sync (issue 27). :func:`count_step_ops` runs a recipe with :class:`ReplayGraph` (the
CPU emulator of CUDA-graph replay, :class:`~mmfast._graph_emulator.ReplayEmulator`) and
counts the aten ops dispatched outside the replays, per phase, per steady-state step. These are op
counts on the CPU, not GPU times.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .._graph_emulator import ReplayEmulator, reads_device_data
from ..config import load_recipe
from ..pipeline import Session, apply


def _transfer(func, args: tuple) -> bool:
    """An op that reads tensor data to the host (a value, or an output shape that depends on data: ``int(t)``,
    ``bool(t)``, ``nonzero``; :func:`~mmfast._graph_emulator.reads_device_data`) or makes a tensor from host data
    (``torch.tensor(...)``)."""
    return func is torch.ops.aten.lift_fresh.default or reads_device_data(func, args)


#: phases, in report order; an op is attributed to the innermost frame whose function names one
PHASES = ("runner.step prep", "replay copies", "lm_head", "decoder choose", "embedding", "driver bookkeeping")
_FRAMES = {
    "_replay": "replay copies",
    "step": "runner.step prep",  # LMRunner.step (the frame's self is the runner)
    "choose": "decoder choose",
    "_choose": "decoder choose",
    "embed_tokens": "embedding",
}


@dataclass
class OpCounter(TorchDispatchMode):
    """Counts aten ops by phase while active; ops run while ``paused`` (a graph replay) are not counted.

    ``marks`` holds the total count at each :meth:`mark` (the start of a replay): the ops between two
    marks are one steady-state step."""

    runner: Any = None
    lm_head: Any = None
    paused: bool = False
    in_step: bool = False  # inside LMRunner._replay (count_step_ops): a replay there is the LM step's
    by_phase: Counter = field(default_factory=Counter)
    total: int = 0
    #: host transfers outside replays: reads of tensor data (``.item()``, ``int(t)``, ``.tolist()``, ops whose output
    #: shape depends on data, e.g. ``nonzero``) and tensors made from host data (``torch.tensor(...)``): on a GPU
    #: each of a device tensor waits for the stream (pageable copies). On a CPU run every tensor is a host tensor, so this counts host-only ones too (an upper bound),
    #: and a ``.cpu()`` copy, which dispatches nothing here, is not seen
    transfers: int = 0
    #: ops the graphs replayed (what a CUDA graph launches as kernels: the device's side of a step)
    replayed: int = 0
    marks: list[tuple[int, Counter]] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__init__()

    def mark(self) -> None:
        self.marks.append((self.total, Counter(self.by_phase, transfers=self.transfers, replayed=self.replayed)))

    def _phase(self) -> str:
        frame = sys._getframe(2)
        while frame is not None:
            f_self = frame.f_locals.get("self")
            if self.lm_head is not None and f_self is self.lm_head:
                return "lm_head"
            name = frame.f_code.co_name
            if name == "prefill" and f_self is self.runner:
                return "prefill"
            if name in _FRAMES and (name != "step" or f_self is self.runner):
                return _FRAMES[name]
            frame = frame.f_back
        return "driver bookkeeping"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.total += 1
            self.by_phase[self._phase()] += 1
            self.transfers += _transfer(func, args)
        return func(*args, **(kwargs or {}))

    def per_step(self) -> dict[str, float]:
        """Mean ops per step by phase over the steps between the first and the last replay."""
        if len(self.marks) < 2:
            raise RuntimeError("fewer than two replays: no steady-state step was counted")
        (_, first), (_, last) = self.marks[0], self.marks[-1]
        n = len(self.marks) - 1
        out = {p: (last[p] - first[p]) / n for p in PHASES}
        out["total"] = sum(out.values())
        out["transfers"] = (last["transfers"] - first["transfers"]) / n
        out["replayed"] = (last["replayed"] - first["replayed"]) / n
        out["steps"] = n
        return out


class ReplayGraph(ReplayEmulator):
    """:class:`ReplayEmulator` (CUDA-graph semantics: the recorded ops replayed, no Python of the step)
    with the counter paused during a replay (what a CUDA graph replays is one launch, not host ops)."""

    counter: OpCounter | StageCounter | None = None
    made: list[ReplayGraph] = []

    def __init__(self) -> None:
        super().__init__()
        ReplayGraph.made.append(self)

    def replay(self) -> torch.Tensor:
        counter = ReplayGraph.counter
        if counter is None:
            return super().replay()
        if getattr(
            counter, "in_step", False
        ):  # the LM step's replay starts a step (a drafter's or a prefill's does not)
            counter.mark()
        counter.paused = True
        counter.replayed += len(self.ops)
        try:
            return super().replay()
        finally:
            counter.paused = False


@contextmanager
def _reading_lists(counter: OpCounter | StageCounter) -> Iterator[None]:
    """Count ``Tensor.tolist()`` as one of ``counter``'s transfers while active (it dispatches no aten op)."""
    tolist = torch.Tensor.tolist

    def counted(t: torch.Tensor):
        if not counter.paused:
            counter.transfers += 1
        return tolist(t)

    torch.Tensor.tolist = counted
    try:
        yield
    finally:
        torch.Tensor.tolist = tolist


def count_step_ops(mm, recipe: dict, images, prompts, max_new_tokens: int = 12) -> dict[str, float]:
    """Ops per captured decode step outside the graph, by phase, for one ``generate`` call of ``recipe``
    (``compile: static`` with :class:`ReplayGraph` as the session's graph factory; one batch)."""
    original = Session._capture_factory
    Session._capture_factory = lambda self: ReplayGraph  # restored below; this process only counts
    ReplayGraph.made = []
    try:
        with apply(mm, load_recipe(recipe), compile="static") as s:
            counter = OpCounter(runner=s.runner, lm_head=s.runner.adapter.lm_head)
            replay = s.runner._replay

            def marked(state, step, staged=()):  # LMRunner._replay: what it replays is the LM step
                counter.in_step = True
                try:
                    return replay(state, step, staged)
                finally:
                    counter.in_step = False

            s.runner._replay = marked
            ReplayGraph.counter = counter
            with counter, _reading_lists(counter):
                s.generate(images, prompts, max_new_tokens=max_new_tokens, seed=0)
            del s.runner._replay
    finally:
        Session._capture_factory = original
        ReplayGraph.counter = None
    return counter.per_step()


#: stages of a one-token call, in report order: an op goes to the innermost frame naming one
STAGES = ("tower", "pruning", "build inputs", "LLM prefill", "rest")
_STAGE_FRAMES = {"_tower": "tower", "prune_vision": "pruning", "build_inputs": "build inputs", "prefill": "LLM prefill"}


class StageCounter(TorchDispatchMode):
    """Counts aten ops by pipeline stage while active, none while ``paused`` (a graph replay)."""

    def __init__(self, runner: Any) -> None:
        super().__init__()
        self.runner, self.paused, self.by_stage = runner, False, Counter()
        self.replayed = 0  # ops the graphs replayed
        self.transfers = 0  # host transfers outside replays, as :attr:`OpCounter.transfers` counts them

    def _stage(self) -> str:
        frame = sys._getframe(2)
        while frame is not None:
            name = frame.f_code.co_name
            if name in _STAGE_FRAMES and (name != "prefill" or frame.f_locals.get("self") is self.runner):
                return _STAGE_FRAMES[name]
            frame = frame.f_back
        return "rest"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.by_stage[self._stage()] += 1
            self.transfers += _transfer(func, args)
        return func(*args, **(kwargs or {}))


def count_call_ops(mm, recipe: dict, images, prompts, *, captured: bool = True) -> tuple[Counter, int]:
    """Torch ops a one-token ``generate`` call of ``recipe`` dispatches outside graph replays, by stage
    (:data:`STAGES`: what a TTFT pays in launches), after a first call of the same inputs (its graphs captured:
    the steady state of a long run), and its host transfers (:attr:`OpCounter.transfers`: on a GPU each read of
    device data waits for the queue to drain). ``captured`` False: ``compile: static`` without graphs, every op
    eager."""
    counter = _call_counter(mm, recipe, images, prompts, 1, "static", captured)
    return counter.by_stage, counter.transfers


def count_token_ops(
    mm,
    recipe: dict,
    images,
    prompts,
    compile: str,
    *,
    captured: bool,
    tokens: tuple[int, int] = (4, 20),
    videos=None,
) -> tuple[float, float]:
    """(ops dispatched outside graph replays, ops the graphs replayed) per generated token of ``recipe``: a call of
    ``tokens[1]`` new tokens less one of ``tokens[0]``, each after a first call of the same inputs (its graphs
    captured), over the tokens between (both calls must run to their length: a decoder that stops early raises).
    ``compile``: ``off`` (the dynamic cache) or ``static`` (with ``captured``: the CPU stand-in of CUDA graphs);
    ``videos``: the prompts' videos, if any."""
    short, long = (_call_counter(mm, recipe, images, prompts, n, compile, captured, videos) for n in tokens)
    if (short.tokens, long.tokens) != tokens:
        raise RuntimeError(f"the calls made {short.tokens} and {long.tokens} tokens, not {tokens}")
    n = tokens[1] - tokens[0]
    host = sum(long.by_stage.values()) - sum(short.by_stage.values())
    return host / n, (long.replayed - short.replayed) / n


def _call_counter(mm, recipe: dict, images, prompts, max_new_tokens: int, compile: str, captured: bool, videos=None):
    """The :class:`StageCounter` of a ``generate`` call after a first call of the same inputs; its ``tokens``: the
    first sample's generated count."""
    original = Session._capture_factory
    if captured:
        Session._capture_factory = lambda self: ReplayGraph  # restored below; this process only counts
    ReplayGraph.made = []
    try:
        with apply(mm, load_recipe(recipe), compile=compile) as s:
            kw = {} if videos is None else {"videos": videos}
            s.generate(images, prompts, max_new_tokens=max_new_tokens, seed=0, **kw)  # captures the call's graphs
            counter = StageCounter(s.runner)
            ReplayGraph.counter = counter  # pauses it while a graph replays
            with counter, _reading_lists(counter):
                out = s.generate(images, prompts, max_new_tokens=max_new_tokens, seed=0, **kw)
    finally:
        Session._capture_factory = original
        ReplayGraph.counter = None
    counter.tokens = len(out[0].token_ids)
    return counter
