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

import inspect
import itertools
import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .. import compat
from ..errors import InputError
from .attention import forget, probe_name

logger = logging.getLogger(__name__)

_UNSET = object()
#: the open sessions of each model, in opening order (weak: an abandoned session does not keep its model alive): a
#: session closed while another open one changed the same thing after it (not LIFO) hands what it restores to that
#: one, which restores it
_OPEN: weakref.WeakKeyDictionary[nn.Module, list[weakref.ref[HookSession]]] = weakref.WeakKeyDictionary()
#: the order of every change the sessions make (an attribute set, the switch to the probe): which came after which
_ORDER = itertools.count()


class HookSession:
    """Context manager that installs hooks on a model and restores it exactly on exit."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._attrs: list[tuple[Any, str, Any, int]] = []  # (object, name, the value before, order of the change)
        self._attn_before: dict[str, str] | None = None
        self._attn_order = -1  # order of the switch to the probe
        self.closed = False
        _OPEN.setdefault(model, []).append(weakref.ref(self))
        #: True while the runner runs an LLM decode step: ``prefill_only`` hooks and recorders are skipped
        self.decoding = False

    # -- installation --------------------------------------------------------------------------
    def forward_hook(
        self, module: nn.Module, fn: Callable, *, with_kwargs: bool = False, prefill_only: bool = False
    ) -> None:
        """``prefill_only``: ``fn`` acts only outside LLM decode steps (skipped while ``decoding``)."""
        self._check_open("a forward hook")
        fn = self._outside_decode(fn) if prefill_only else fn
        self._handles.append(module.register_forward_hook(fn, with_kwargs=with_kwargs))

    def pre_hook(
        self, module: nn.Module, fn: Callable, *, with_kwargs: bool = False, prefill_only: bool = False
    ) -> None:
        """``prefill_only``: ``fn`` acts only outside LLM decode steps (skipped while ``decoding``)."""
        self._check_open("a forward pre-hook")
        fn = self._outside_decode(fn) if prefill_only else fn
        self._handles.append(module.register_forward_pre_hook(fn, with_kwargs=with_kwargs))

    def _outside_decode(self, fn: Callable) -> Callable:
        def hook(*args: Any, **kwargs: Any) -> Any:
            return None if self.decoding else fn(*args, **kwargs)

        hook.mmfast_prefill_only = True  # type: ignore[attr-defined]
        return hook

    def set_attr(self, obj: Any, name: str, value: Any) -> None:
        """Set an *instance* attribute, remembering the old value (or its absence) for close(); a module's
        submodule, parameter or buffer of that name, or a property's value, is the old value (put back, not deleted,
        by close())."""
        self._check_open(f"attribute {name!r}")
        old = obj.__dict__.get(name, _UNSET) if hasattr(obj, "__dict__") else getattr(obj, name, _UNSET)
        if old is _UNSET and hasattr(inspect.getattr_static(type(obj), name, None), "__set__"):
            old = getattr(obj, name)  # a property's (a config's ``_attn_implementation``): set back, not deleted
        if isinstance(obj, nn.Module):
            for held in (obj._parameters, obj._buffers, obj._modules):
                if name in held:
                    old = held[name]
        self._attrs.append((obj, name, old, next(_ORDER)))
        setattr(obj, name, value)

    def use_probe_attention(self) -> None:
        """Route every attention call through the probe wrapper of its current implementation."""
        if self._attn_before is not None:
            return
        self._check_open("the attention probe")
        self._attn_before = compat.get_attn_implementation(self.model)
        self._attn_order = next(_ORDER)
        wrapped = {k: probe_name(v) for k, v in self._attn_before.items()}
        compat.set_attn_implementation(self.model, wrapped)

    def _check_open(self, what: str) -> None:
        """Refuse to install ``what`` on a closed session: nothing would remove it from the model."""
        if self.closed:
            raise InputError(
                f"cannot install {what}: this hook session is closed (close() restored the model, and nothing would "
                "remove it again); open a new session (HookSession(model), or mmfast.apply(mm, recipe))"
            )

    # -- teardown --------------------------------------------------------------------------------
    def close(self) -> None:
        if self.closed:
            return
        opened = [s for r in _OPEN.get(self.model, []) if (s := r()) is not None and not s.closed]
        others = [s for s in opened if s is not self]
        for handle in reversed(self._handles):
            handle.remove()
        self._handles.clear()
        for obj, name, old, order in reversed(self._attrs):
            # another open session (opened before or after this one) set it next, remembering this session's value: it
            # restores the value before this session's instead
            taker = min(
                (
                    (o_order, s, i)
                    for s in others
                    for i, (o, n, _, o_order) in enumerate(s._attrs)
                    if o is obj and n == name and o_order > order
                ),
                default=None,
                key=lambda t: t[0],
            )
            if taker is not None:
                mine = taker[1]._attrs[taker[2]][2]  # the value this session set, which the taker replaced
                taker[1]._attrs[taker[2]] = (obj, name, old, taker[0])
                if name == "_mmfast_attn":  # the later sessions' copies of this session's attention hooks
                    held = [
                        obj.__dict__.get(name),
                        *(a[2] for t in others for a in t._attrs if a[0] is obj and a[1] == name),
                    ]
                    forget(mine, None if old is _UNSET else old, held)
            elif old is _UNSET:
                try:
                    delattr(obj, name)
                except AttributeError:
                    pass
            else:
                setattr(obj, name, old)
        self._attrs.clear()
        if self._attn_before is not None:
            prober = min(
                (s for s in others if s._attn_before is not None and s._attn_order > self._attn_order),
                default=None,
                key=lambda s: s._attn_order,
            )
            if prober is not None:  # an open session switched after this one, still probes: it restores the original
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
