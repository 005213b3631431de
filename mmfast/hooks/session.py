"""HookSession: the only object that changes a model, and it puts everything back.

It owns every forward hook and pre-hook handle, every instance attribute it sets, and the attention
implementation it switches to (the probe). ``close()`` removes and restores all of it in reverse
order, so after ``with HookSession(model): ...`` the model computes exactly what it computed before
(tested: identical logits, no leftover hooks, original attention implementation).

Phases: a hook (or attention recorder, :mod:`.attention`) installed ``prefill_only`` declares that it acts
only outside LLM decode steps; the session skips it while ``decoding`` is set (by the runner, for each
decode step), so such a hook never runs inside a decode step and does not keep it from being one captured
CUDA graph (``LMRunner.capture_blocker``).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .. import compat

logger = logging.getLogger(__name__)

_UNSET = object()
#: the open sessions of each model, in opening order (weak: an abandoned session does not keep its model alive): a
#: session closed before a later one (not LIFO) hands what it restores to that later one, which restores it
_OPEN: weakref.WeakKeyDictionary[nn.Module, list[weakref.ref[HookSession]]] = weakref.WeakKeyDictionary()


class HookSession:
    """Context manager that installs hooks on a model and restores it exactly on exit."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._attrs: list[tuple[Any, str, Any]] = []
        self._attn_before: dict[str, str] | None = None
        self.closed = False
        _OPEN.setdefault(model, []).append(weakref.ref(self))
        #: True while the runner runs an LLM decode step: ``prefill_only`` hooks and recorders are skipped
        self.decoding = False

    # -- installation --------------------------------------------------------------------------
    def forward_hook(
        self, module: nn.Module, fn: Callable, *, with_kwargs: bool = False, prefill_only: bool = False
    ) -> None:
        """``prefill_only``: ``fn`` acts only outside LLM decode steps (skipped while ``decoding``)."""
        fn = self._outside_decode(fn) if prefill_only else fn
        self._handles.append(module.register_forward_hook(fn, with_kwargs=with_kwargs))

    def pre_hook(
        self, module: nn.Module, fn: Callable, *, with_kwargs: bool = False, prefill_only: bool = False
    ) -> None:
        """``prefill_only``: ``fn`` acts only outside LLM decode steps (skipped while ``decoding``)."""
        fn = self._outside_decode(fn) if prefill_only else fn
        self._handles.append(module.register_forward_pre_hook(fn, with_kwargs=with_kwargs))

    def _outside_decode(self, fn: Callable) -> Callable:
        def hook(*args: Any, **kwargs: Any) -> Any:
            return None if self.decoding else fn(*args, **kwargs)

        hook.mmfast_prefill_only = True  # type: ignore[attr-defined]
        return hook

    def set_attr(self, obj: Any, name: str, value: Any) -> None:
        """Set an *instance* attribute, remembering the old value (or its absence) for close()."""
        old = obj.__dict__.get(name, _UNSET) if hasattr(obj, "__dict__") else getattr(obj, name, _UNSET)
        if isinstance(obj, nn.Module) and name in obj._modules:
            old = obj._modules[name]
        self._attrs.append((obj, name, old))
        setattr(obj, name, value)

    def use_probe_attention(self) -> None:
        """Route every attention call through the probe wrapper of its current implementation."""
        if self._attn_before is not None:
            return
        from .attention import probe_name

        self._attn_before = compat.get_attn_implementation(self.model)
        wrapped = {k: probe_name(v) for k, v in self._attn_before.items()}
        compat.set_attn_implementation(self.model, wrapped)

    # -- teardown --------------------------------------------------------------------------------
    def close(self) -> None:
        if self.closed:
            return
        opened = [s for r in _OPEN.get(self.model, []) if (s := r()) is not None and not s.closed]
        later = opened[opened.index(self) + 1 :] if self in opened else []  # sessions opened after this one, open
        for handle in reversed(self._handles):
            handle.remove()
        self._handles.clear()
        for obj, name, old in reversed(self._attrs):
            # a later open session set it again, remembering this session's value: it restores the original instead
            taker = next(
                ((s, i) for s in later for i, (o, n, _) in enumerate(s._attrs) if o is obj and n == name), None
            )
            if taker is not None:
                taker[0]._attrs[taker[1]] = (obj, name, old)
            elif old is _UNSET:
                try:
                    delattr(obj, name)
                except AttributeError:
                    pass
            else:
                setattr(obj, name, old)
        self._attrs.clear()
        if self._attn_before is not None:
            prober = next((s for s in later if s._attn_before is not None), None)
            if prober is not None:  # a later open session still probes: it restores the original on its close
                prober._attn_before = self._attn_before
            else:
                compat.set_attn_implementation(self.model, self._attn_before)
            self._attn_before = None
        self.closed = True
        _OPEN[self.model] = [weakref.ref(s) for s in opened if s is not self]

    def __enter__(self) -> HookSession:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def is_prefill_only(hook: Callable) -> bool:
    """Whether ``hook`` was installed ``prefill_only`` (a no-op in every LLM decode step)."""
    return bool(getattr(hook, "mmfast_prefill_only", False))


def count_hooks(model: nn.Module) -> int:
    """Number of hooks registered on any submodule (for leak tests)."""
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
