"""The LLaVA-style vision tower as one captured CUDA graph per pixel-batch shape (``model.compile: auto`` on
CUDA), for a shorter time to first token.

A LLaVA, LLaVA-NeXT or LLaVA-OneVision tower (CLIP / SigLIP) runs a fixed-size pixel batch ``[n, 3, H, W]``
(images, tiles or frames) through ~24 layers: ~600 small kernels launched one by one from Python at batch 1,
launch-bound on a GPU, and the same for every pruner, since pruning starts after it. The session gives the
adapter a :class:`CapturedTower` (an instance attribute, restored on close); the adapter's
``tower_layers`` (the tower's forward and the concatenation of its feature layers) then runs through it:
captured once per input shape, dtype and device (the capture's warm-up is that call's own forward), replayed
afterwards with the pixels copied into the graph's static input. At most ``MAX_GRAPHS`` shapes are kept (the
least recently used goes first: each holds its activations, e.g. LLaVA-NeXT's tile counts differ by image).

The tower stays eager when a method's Python runs inside it (a hook or an attention probe on any of its
modules: checked at every call, so one put on after a capture is not skipped by the replays), unless every such
hook's work depends on shapes only and carries its result (a :class:`~mmfast.hooks.attention.Carried`: ToMe's
merges, a probe of the CLS row as VisionZip's, MustDrop's padded merge), which is put back after each replay, when
the session does not capture (``compile: off`` / ``static``, or not on CUDA), and for good after a capture that
raises (one log line). Qwen-VL towers take packed patches and a grid, and their fused attention is their own
path (``qwen_tower.py``): not captured here. The replayed kernels are the eager ones, so outputs are equal.
Capture time is added to the batch's ``capture_s``.

:class:`CapturedCalls` is the same for any pure function of tensors: the session gives methods one
(``MethodContext.captured``) for their selections, e.g. DivPrune's and CDPruner's greedy loops (64 picks of a
few kernels each at batch 1, launched one by one from Python otherwise).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..hooks.attention import Carried, capture_blocker

logger = logging.getLogger(__name__)

MAX_GRAPHS = 4
#: graphs kept for the methods' selections (``MethodContext.captured``): a few keys (a pruner's stages) times a
#: few shapes (prefill buckets, batch sizes); each holds only a selection's intermediates
SELECTION_GRAPHS = 16
_UNCHECKED = object()


@dataclass
class _Static:
    """A captured call's inputs (the graph reads them) and its carried results (the graph writes them)."""

    inputs: list[torch.Tensor]
    records: list = field(default_factory=list)


class CapturedCalls:
    """Pure functions of tensors run as captured graphs: ``calls(key, fn, *tensors)`` replays the graph of
    ``key`` and the inputs' shapes, dtypes and devices after copying ``tensors`` into its static inputs, or
    the first time runs ``fn`` (the capture's warm-up) and captures it; ``fn`` returns a tensor or a tuple of them. ``key`` must hold everything else
    ``fn`` depends on (its static arguments). Eager where ``factory()`` gives None and, for that ``key``, for
    good after a capture that raises (one log line); the output is a copy (a replay overwrites the graph's).

    ``factory()`` gives the graph class of this call (None: eager); ``runner`` the shared replay-or-capture
    routine and the capture-time counter; ``what`` says what then runs eagerly in the log line (e.g. "the vision
    tower runs")."""

    def __init__(self, runner: Any, factory: Callable[[], Any], what: str, max_graphs: int = MAX_GRAPHS) -> None:
        self.runner, self.factory, self.what, self.max_graphs = runner, factory, what, max_graphs
        self.graphs: OrderedDict[tuple, Any] = OrderedDict()
        self._failed: set[tuple] = set()  # the callers' keys whose capture raised: eager from then on

    def __call__(
        self, key: tuple, fn: Callable[..., torch.Tensor], *tensors: torch.Tensor, carried: Sequence[Carried] = ()
    ) -> torch.Tensor:
        """``carried``: the hooks' results inside ``fn`` that readers find after it (:class:`Carried`): after a
        replay the graph's are put back, after a capture this call's (the warm-up's)."""
        graph_type = None if key in self._failed else self.factory()
        if graph_type is None:
            return fn(*tensors)
        caller = key  # what a failed capture turns eager
        key = (key, *((tuple(t.shape), t.dtype, t.device) for t in tensors))
        runs: list[list] = []  # the carried results after each run of fn (the warm-up, the capture)

        def make() -> tuple[_Static, Callable[[], torch.Tensor]]:
            static = _Static([t.clone() for t in tensors])  # the graph's inputs

            def run() -> torch.Tensor:
                out = fn(*static.inputs)
                runs.append([c.get() for c in carried])
                return out

            return static, run

        def load(static: _Static) -> None:
            for dst, src in zip(static.inputs, tensors):
                dst.copy_(src)

        out = self.runner.replay_or_capture(
            self.graphs, key, graph_type, make, load, lambda exc: self._capture_failed(caller, exc)
        )
        if runs:  # captured (or tried) now: the graph's results kept for its replays, this call's put back
            if key in self.graphs and len(runs) > 1:
                self.graphs[key].static.records = runs[1]
            results = runs[0]
        else:
            results = self.graphs[key].static.records
        for c, result in zip(carried, results):
            if result is not None:
                c.put(result)
        if key in self.graphs:
            self.graphs.move_to_end(key)
            while len(self.graphs) > self.max_graphs:
                self.graphs.popitem(last=False)
        # the graph's output is overwritten by its next replay
        return tuple(o.clone() for o in out) if isinstance(out, tuple) else out.clone()

    def _capture_failed(self, key: tuple, exc: Exception) -> None:
        logger.warning(
            "model.compile: auto: %s without a captured graph (capturing failed: %s: %s)",
            self.what,
            type(exc).__name__,
            str(exc).splitlines()[0] if str(exc) else "",
        )
        self._failed.add(key)


def eager_call(key: tuple, fn: Callable[..., torch.Tensor], *tensors: torch.Tensor) -> torch.Tensor:
    """:class:`CapturedCalls`'s signature, always eager (a context without a session)."""
    return fn(*tensors)


class CapturedTower(CapturedCalls):
    """Runs ``fn(pixels)`` (a pure function of the pixels: the tower and its feature layers) as captured graphs,
    unless a method's Python runs inside ``tower``."""

    def __init__(self, tower: nn.Module, runner: Any, factory: Callable[[], Any]) -> None:
        super().__init__(runner, factory, "the vision tower runs")
        self.tower = tower
        self._blocker: str | None | object = _UNCHECKED
        self._carried: list[Carried] = []

    def __call__(self, fn: Callable[[torch.Tensor], torch.Tensor], pixels: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if self.factory() is None or () in self._failed:
            return fn(pixels)
        # checked at every call, not once: a hook or probe put on the tower after a capture (``probe.watch`` between
        # two generate calls) must stop the replays, which would skip it, or join the carried results
        carried: list[Carried] = []
        blocker = capture_blocker([self.tower], "the vision tower", carried=carried)
        if blocker is None and any(c.stage is not None for c in carried):
            blocker = "attention probes with rows staged from the prompt, on the vision tower"
        if blocker != self._blocker and blocker is not None:
            logger.info("model.compile: auto: the vision tower runs without a captured graph (%s)", blocker)
        if len(carried) != len(self._carried) or any(a is not b for a, b in zip(carried, self._carried)):
            self.graphs.clear()  # captured with other hooks inside: their replays would not carry these results
        self._blocker, self._carried = blocker, carried
        if blocker is not None:
            return fn(pixels)
        return super().__call__((), fn, pixels, carried=carried)
