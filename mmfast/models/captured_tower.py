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
modules, e.g. VisionZip's CLS attention, MustDrop's or HICom's recorders: checked once per session), when the
session does not capture (``compile: off`` / ``static``, or not on CUDA), and for good after a capture that
raises (one log line). Qwen-VL towers take packed patches and a grid, and their fused attention is their own
path (``qwen_tower.py``): not captured here. The replayed kernels are the eager ones, so outputs are equal.
Capture time is added to the batch's ``capture_s``.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..hooks.attention import capture_blocker

logger = logging.getLogger(__name__)

MAX_GRAPHS = 4
_UNCHECKED = object()


class CapturedTower:
    """Runs ``fn(pixels)`` (a pure function of the pixels: the tower and its feature layers) as captured graphs.

    ``factory()`` gives the graph class of this call (None: eager); ``runner`` the shared replay-or-capture
    routine and the capture-time counter."""

    def __init__(self, tower: nn.Module, runner: Any, factory: Callable[[], Any]) -> None:
        self.tower, self.runner, self.factory = tower, runner, factory
        self.graphs: OrderedDict[tuple, Any] = OrderedDict()
        self._blocker: str | None | object = _UNCHECKED
        self._failed = False

    def __call__(self, fn: Callable[[torch.Tensor], torch.Tensor], pixels: torch.Tensor) -> torch.Tensor:
        graph_type = self.factory()
        if graph_type is None or self._failed:
            return fn(pixels)
        if self._blocker is _UNCHECKED:  # the session's hooks are installed before its first call
            self._blocker = capture_blocker([self.tower], "the vision tower")
            if self._blocker is not None:
                logger.info("model.compile: auto: the vision tower runs without a captured graph (%s)", self._blocker)
        if self._blocker is not None:
            return fn(pixels)
        key = (tuple(pixels.shape), pixels.dtype, pixels.device)

        def make() -> tuple[torch.Tensor, Callable[[], torch.Tensor]]:
            static = pixels.clone()  # [n, 3, H, W] the graph's input
            return static, lambda: fn(static)

        out = self.runner.replay_or_capture(
            self.graphs, key, graph_type, make, lambda static: static.copy_(pixels), self._capture_failed
        )
        if key in self.graphs:
            self.graphs.move_to_end(key)
            while len(self.graphs) > MAX_GRAPHS:
                self.graphs.popitem(last=False)
        return out.clone()  # the graph's output is overwritten by its next replay

    def _capture_failed(self, exc: Exception) -> None:
        logger.warning(
            "model.compile: auto: the vision tower runs without a captured graph (capturing it failed: %s: %s)",
            type(exc).__name__,
            str(exc).splitlines()[0] if str(exc) else "",
        )
        self._failed = True
