"""A CPU emulator of CUDA-graph capture and replay (:class:`ReplayEmulator`), so the captured decode step's
graph bugs show up without a GPU.

A CUDA graph records the kernels a function launches and replays only them, on the same memory: what the
function computed in Python at capture (an int read from a tensor, a branch on data, a shape, a tensor
made once on the host and replaced later) is frozen at its capture-time value, tensors the step allocates
keep their addresses, and a host read of device data (``.item()``, ``.tolist()``, ``nonzero``) cannot be
captured at all. :class:`ReplayEmulator` is a :class:`~mmfast.runtime.StepGraph` with those semantics:

* ``capture(fn)`` runs ``fn`` once under a ``TorchDispatchMode`` that records every aten op (function,
  arguments, outputs; tensors by object identity, anything else as the value it had: frozen). A host read
  (``aten._local_scalar_dense`` under ``.item()`` / ``int(t)`` / ``bool(t)``, ``.tolist()``, ``.numpy()``,
  an op returning a Python scalar computed from data such as ``torch.equal``, or an op whose output shape
  depends on data such as ``nonzero`` / ``masked_select``) raises, as a CUDA capture fails on a sync.
  As a CUDA capture launches nothing, the capture's writes to tensors that existed before it are undone
  afterwards, and the tensors it allocated are poisoned (NaN, or a sentinel for integers): a caller that
  reads the capture's output, or keeps a tensor made during capture, sees garbage as it would on a GPU.
* ``replay()`` re-executes the recorded ops in order on the recorded tensors; no Python of ``fn`` runs.
  A functional op is called again with the same tensor objects and its fresh outputs are copied into the
  outputs recorded at capture, which later ops hold; an in-place or ``out=`` op writes its recorded
  arguments again; a view op runs nothing: its recorded output already aliases its base's memory (on a
  GPU a view is metadata, not a kernel), so it sees the base's new values. Returns ``fn``'s output tensor (or
  tuple of tensors).

Limits: it runs on whatever device the tensors are on and cannot see device-to-host copies on the CPU
(``t.cpu()`` of a CPU tensor is no copy); random ops draw again from their recorded generator at each
replay (a CUDA graph advances its Philox offset likewise); ops are re-dispatched from Python, so a replay
costs about as much as the eager step (fine for tiny test models, not a speed model).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

from .runtime import StepGraph

aten = torch.ops.aten


class CaptureHostReadError(RuntimeError):
    """A host read of device data while capturing (a CUDA capture fails on the sync it needs)."""


# ops returning a Python value that reads only metadata, never tensor data (no sync on a GPU)
_METADATA = {
    aten.is_same_size.default,
    aten.sym_size.int,
    aten.sym_stride.int,
    aten.sym_numel.default,
    aten.sym_storage_offset.default,
    aten.dim.default,
    aten.is_contiguous.default,
    aten.is_contiguous.memory_format,
    aten.is_non_overlapping_and_dense.default,
}
_DATA_DEPENDENT = (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output)


def _integer_index(func, args: tuple) -> bool:
    """``t[idx, ...]`` with integer index tensors only (``aten.index.Tensor`` is tagged data-dependent for boolean
    masks, whose output shape is the count of True): its shape is the indices', so a CUDA graph captures it."""
    if func is not aten.index.Tensor:
        return False
    return all(i is None or not (i.dtype.is_floating_point or i.dtype in (torch.bool, torch.uint8)) for i in args[1])


def reads_device_data(func, args: tuple) -> bool:
    """Whether ``func`` on ``args`` waits for tensor data on the host: it reads a value (``int(t)``, ``bool(t)``,
    ``.item()``, ``torch.equal``) or its output's shape depends on data (``nonzero``, a boolean-mask index). On a
    GPU each waits for the stream's queued work; a CUDA graph cannot capture it."""
    if func is aten.is_nonzero.default:  # bool(t): untagged, a Python bool from the data
        return True
    return any(tag in func.tags for tag in _DATA_DEPENDENT) and not _integer_index(func, args)


@dataclass
class _Op:
    func: Any  # an aten OpOverload
    args: tuple
    kwargs: dict
    outputs: list[torch.Tensor]  # the tensors the capture's call returned, in pytree order
    fresh: list[bool]  # per output: new memory (copied into at replay) or an alias of an argument
    run: bool  # False: a view op (nothing to execute at replay)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _Recorder(TorchDispatchMode):
    """Records the aten ops run under it; refuses host reads."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[_Op] = []
        self.produced: set[int] = set()  # ids of tensors some recorded op returned
        self.external: set[int] = set()  # storages of tensors that existed before the capture
        self.inputs: dict[int, torch.Tensor] = {}  # id -> a tensor from before the capture that an op read
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (tensor, its contents before)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._local_scalar_dense.default:
            raise CaptureHostReadError(f"{func} reads a tensor's value on the host (.item(), int(t), bool(t))")
        if any(tag in func.tags for tag in _DATA_DEPENDENT) and not _integer_index(func, args):
            raise CaptureHostReadError(f"{func}: its output's shape or value depends on tensor data")
        flat_in, _ = tree_flatten((args, kwargs))
        tensors_in = [t for t in flat_in if isinstance(t, torch.Tensor)]
        for t in tensors_in:
            if id(t) not in self.produced:
                self.external.add(_storage(t))
                self.inputs.setdefault(id(t), t)
        written = self._written(func, args, kwargs)
        for t in written:  # a capture launches nothing: its writes to outside tensors are undone after
            if _storage(t) in self.external and id(t) not in self.saved:
                with _disable_current_modes():  # the emulator's own work: no mode outside sees it
                    self.saved[id(t)] = (t, t.clone())
        out = func(*args, **kwargs)
        flat_out, _ = tree_flatten(out)
        outputs = [t for t in flat_out if isinstance(t, torch.Tensor)]
        if func not in _METADATA and any(isinstance(v, (bool, int, float, complex)) for v in flat_out):
            raise CaptureHostReadError(f"{func} returns a Python value computed from tensor data")
        storages = {_storage(t) for t in tensors_in}
        fresh = [_storage(t) not in storages for t in outputs]
        self.produced.update(id(t) for t in outputs)
        run = bool(written) or any(fresh) or not outputs
        self.ops.append(_Op(func, args, kwargs, outputs, fresh, run))
        return out

    @staticmethod
    def _written(func, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        """The tensor arguments ``func`` writes (in-place ``self``, ``out=``), from its schema."""
        got = []
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
            got.extend(t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))
        return got


def _poison(t: torch.Tensor) -> None:
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.logical_not_()
    else:  # a value no index or count takes, in the dtype's range
        t.fill_(max(-7777, torch.iinfo(t.dtype).min))


class _NoHostReads:
    """``.tolist()`` and ``.numpy()`` read tensor data on the host without an aten op: refused while capturing."""

    NAMES = ("tolist", "numpy")

    def __enter__(self) -> None:
        self.saved = {name: torch.Tensor.__dict__.get(name) for name in self.NAMES}  # None: inherited

        def refuse(name: str) -> Callable:
            def read(self, *args, **kwargs):
                raise CaptureHostReadError(f"Tensor.{name}() reads a tensor's values on the host")

            return read

        for name in self.NAMES:
            setattr(torch.Tensor, name, refuse(name))

    def __exit__(self, *exc) -> None:
        for name, method in self.saved.items():
            if method is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, method)


class ReplayEmulator(StepGraph):
    """:class:`~mmfast.runtime.StepGraph` on any device with CUDA-graph semantics (see the module docstring)."""

    def __init__(self) -> None:
        self.ops: list[_Op] = []  # what a replay executes
        self.inputs: list[torch.Tensor] = []  # the tensors from before the capture that the graph reads
        self.out: torch.Tensor | None = None
        self.replays = 0

    def capture(self, fn: Callable[[], torch.Tensor]) -> None:
        if self.out is not None:
            raise RuntimeError("a ReplayEmulator captures once")
        t0 = time.perf_counter()
        rec = _Recorder()
        try:
            with _NoHostReads(), rec:
                out = fn()
        finally:
            with _disable_current_modes():  # the emulator's own work: no mode outside sees it
                for t, before in reversed(rec.saved.values()):
                    t.copy_(before)
        outs = out if isinstance(out, tuple) else (out,)
        if not all(isinstance(o, torch.Tensor) and id(o) in rec.produced for o in outs):
            raise RuntimeError("the captured function must return a tensor it computed, or a tuple of them")
        poisoned: set[int] = set()
        with _disable_current_modes():
            for op in rec.ops:
                for t, fresh in zip(op.outputs, op.fresh):
                    if fresh and _storage(t) not in rec.external and _storage(t) not in poisoned:
                        poisoned.add(_storage(t))
                        _poison(t)
        self.ops = [op for op in rec.ops if op.run]
        self.inputs = list(rec.inputs.values())
        self.out = out
        self.capture_s = time.perf_counter() - t0

    def replay(self) -> torch.Tensor:
        if self.out is None:
            raise RuntimeError("replay before capture")
        for op in self.ops:
            got = op.func(*op.args, **op.kwargs)
            for dst, src, fresh in zip(
                op.outputs, (t for t in tree_flatten(got)[0] if isinstance(t, torch.Tensor)), op.fresh
            ):
                if fresh:
                    if src.shape != dst.shape:
                        raise RuntimeError(
                            f"{op.func}: replay made shape {tuple(src.shape)}, captured {tuple(dst.shape)}"
                        )
                    dst.copy_(src)
        self.replays += 1
        return self.out
