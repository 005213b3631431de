"""Attention probe: attention probabilities for chosen query rows while the model runs sdpa.

mmfast registers one wrapper per base implementation (``mmfast_probe_sdpa``, ``mmfast_probe_eager``)
with transformers' ``AttentionInterface`` *and* the base implementation's mask function with
``AttentionMaskInterface`` (without the latter transformers would silently build no mask). The
wrapper calls the base implementation for the output, then, only on modules that carry a probe, computes
``softmax(q[rows] K^T * scale + mask[rows])`` in fp32 for the requested rows: O(rows x keys) per head,
never the L x L matrix. The same wrapper lets a method override one module's attention computation
(ZipVL's sparse prefill) without touching any other module.

A module is probed while it has a ``_mmfast_attn`` instance attribute (set and removed by the
HookSession), holding a :class:`ModuleAttentionHooks`. A recorder declares its phase: ``recorders`` run
on every forward, ``prefill_recorders`` (the methods that read attention only to prune at prefill:
FastV, DART, SparseVLM, MustDrop) are skipped while the runner runs an LLM decode step
(``HookSession.decoding``), so they never run inside one and leave it capturable as one CUDA graph.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from .. import compat
from ..errors import InputError

if TYPE_CHECKING:
    from .session import HookSession

_BASES = ("sdpa", "eager")


def is_probed(module: nn.Module) -> bool:
    """Whether the probe wrapper records or overrides ``module``'s attention (else it passes through)."""
    return getattr(module, "_mmfast_attn", None) is not None


def probe_name(base: str) -> str:
    if base.startswith(compat.PROBE_PREFIX):
        return base
    if base not in _BASES:
        raise NotImplementedError(
            f"the attention probe wraps {', '.join(_BASES)}, not {base!r}; load the model with "
            "attn_implementation='sdpa' (recommended) or 'eager'"
        )
    return compat.PROBE_PREFIX + base


class Recorder(Protocol):
    def __call__(
        self,
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float,
    ) -> None: ...


class Override(Protocol):
    def __call__(self, module, query, key, value, attention_mask, scaling, base: Callable, **kwargs): ...


@dataclass
class ModuleAttentionHooks:
    """What the wrapper does on one attention module: record rows, and/or replace the computation.

    ``recorders`` and ``override`` act on every forward, LLM decode steps included; ``prefill_recorders``
    are not called while ``session.decoding`` (an LLM decode step runs)."""

    recorders: list[Recorder] = field(default_factory=list)
    override: Override | None = None
    prefill_recorders: list[Recorder] = field(default_factory=list)
    session: HookSession | None = field(default=None, repr=False)

    def acts_at_decode(self) -> bool:
        """Whether anything here runs Python in an LLM decode step that a captured step cannot replay (a hook
        whose :class:`Carried` says its decode work depends on shapes only can be replayed)."""
        return any(self.decode_carried(fn) is None for fn in self.every_forward())

    def every_forward(self) -> list[Callable]:
        """The override and recorders: what acts in every forward, decode steps included."""
        return [*([self.override] if self.override is not None else []), *self.recorders]

    @staticmethod
    def decode_carried(fn: Callable) -> Carried | None:
        """``fn``'s :class:`Carried` where a captured decode step may replay it, else None."""
        carried = getattr(fn, "mmfast_replayable", None)
        return carried if carried is not None and carried.decode else None


def _make_wrapper(base: str) -> Callable:
    def wrapper(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        base_fn = compat.attention_function(base)
        hooks: ModuleAttentionHooks | None = getattr(module, "_mmfast_attn", None)
        if hooks is not None and hooks.override is not None:
            out = hooks.override(module, query, key, value, attention_mask, scaling, base_fn, dropout=dropout, **kwargs)
        else:
            out, _ = base_fn(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        if hooks is not None:
            for rec in hooks.recorders:
                rec(module, query, key, attention_mask, scaling)
            if hooks.session is None or not hooks.session.decoding:
                for rec in hooks.prefill_recorders:
                    rec(module, query, key, attention_mask, scaling)
        return out, None

    wrapper.__name__ = f"mmfast_probe_{base}"
    return wrapper


for _base in _BASES:
    compat.register_attention(compat.PROBE_PREFIX + _base, _make_wrapper(_base), mask_like=_base)


def row_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    rows: torch.Tensor,
    is_causal: bool,
) -> torch.Tensor:
    """Attention probabilities of selected query rows, in fp32.

    Args:
        query: [B, H, Q, D] (after RoPE). key: [B, Hkv, K, D] (after RoPE, cache included).
        attention_mask: None, bool [B|1, 1, Q, K] (True = attend) or additive float of that shape.
        rows: [R] or [B, R] long indices into Q; -1 marks an unused row (its output is all zeros).
        is_causal: whether a missing mask means causal (decoder) or full (vision encoder).

    Returns:
        [B, H, R, K] probabilities.
    """
    bsz, n_heads, q_len, _ = query.shape
    k_len = key.shape[2]
    if rows.dim() == 1:
        rows = rows.unsqueeze(0).expand(bsz, -1)
    valid = rows >= 0  # [B, R]
    safe = rows.clamp(min=0)
    idx = safe[:, None, :, None].expand(bsz, n_heads, -1, query.shape[-1])
    q = query.gather(2, idx).float()  # [B, H, R, D]
    k = key.float()
    if k.shape[1] != n_heads:  # GQA: repeat_kv
        k = k.repeat_interleave(n_heads // k.shape[1], dim=1)  # [B, H, K, D]
    scores = torch.matmul(q, k.transpose(-1, -2)) * scaling  # [B, H, R, K]
    if attention_mask is not None:
        m = attention_mask
        if m.shape[0] == 1 and bsz > 1:
            m = m.expand(bsz, *m.shape[1:])
        m = m[:, :, :, :k_len]
        m = m.gather(2, safe[:, None, :, None].expand(bsz, m.shape[1], -1, k_len))  # [B, 1, R, K]
        if m.dtype == torch.bool:
            scores = scores.masked_fill(~m, float("-inf"))
        else:
            scores = scores + m.float()
    elif is_causal and q_len > 1:
        offset = k_len - q_len
        key_pos = torch.arange(k_len, device=scores.device)
        allowed = key_pos[None, None, :] <= (safe[:, :, None] + offset)  # [B, R, K]
        scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)
    return probs * valid[:, None, :, None]


RowSelector = Callable[[int, int], torch.Tensor]
"""(q_len, k_len) -> rows [R] or [B, R] (-1 = unused)."""


def last_row(q_len: int, k_len: int) -> torch.Tensor:
    return torch.tensor([q_len - 1])


def cls_row(q_len: int, k_len: int) -> torch.Tensor:
    return torch.tensor([0])


def all_rows(q_len: int, k_len: int) -> torch.Tensor:
    return torch.arange(q_len)


@dataclass(frozen=True)
class Carried:
    """How a hook's result crosses a captured graph (a prefill segment: ``LMRunner._segment``; the vision
    tower: ``CapturedTower``). Set as the hook's ``mmfast_replayable`` (:func:`replayable`) by a recorder,
    override, forward hook, replaced forward or pre-hook whose work depends on shapes only (so the graph
    redoes it at each replay, into the memory it wrote while captured): ``get()`` reads the result the last
    run left where its reader looks, ``put(result)`` puts one back there (after a replay: the graph's; after
    the capture: the warm-up's, the one this call computed)."""

    get: Callable[[], object]
    put: Callable[[object], None]
    #: for a recorder whose inputs are known before the forward but change from call to call (rows picked from
    #: the batch): ``stage(length)`` puts this call's into the memory the graph reads, before a segment of that
    #: length runs (captured or replayed), and returns what the graph's key needs of them (their padded width);
    #: ``stage(None)`` drops them after it
    stage: Callable[[int | None], Hashable] | None = None
    #: the hook acts in LLM decode steps too (an override or a recorder of every forward), and that work also
    #: depends on shapes only: a captured decode step replays it, its result put back after each replay
    #: (``LMRunner.capture_blocker``, ``LMRunner._step_carried``)
    decode: bool = False
    #: for a decode hook that reads fixed memory filled from the running state (an override's slot classes):
    #: ``before_step(state)`` refills it before every static decode step, captured or eager (``LMRunner``), and
    #: returns what the step graph's key needs of the state (a host fact the hook's work depends on)
    before_step: Callable[[Any], Hashable] | None = None


def replayable(fn: Callable, carried: Carried) -> Callable:
    """``fn`` (a hook whose work depends on shapes only) as one a captured graph may replay: its result, which
    ``carried`` reads and puts back, crosses the replays."""

    def hook(*args, **kwargs):
        return fn(*args, **kwargs)

    hook.mmfast_replayable = carried  # type: ignore[attr-defined]
    return hook


def capture_blocker(
    modules: Iterable[nn.Module],
    where: str,
    *,
    own: Callable[[Callable], bool] = lambda hook: False,
    carried: list[Carried] | None = None,
) -> str | None:
    """Why ``modules`` (with their submodules) cannot run as one captured graph (None: they can): a method's
    Python inside them, which a replay would not run. Blocks a pre-hook that is not ``own``, a forward hook that
    is not inert, an instance ``forward`` not marked ``mmfast_graph_safe`` (pure tensor work of shapes only), an
    attention override or a recorder (of every forward or of the prefill), unless ``carried`` is given and the
    hook carries a :class:`Carried` as its ``mmfast_replayable`` (its work depends on shapes only; the Carried is
    appended to ``carried`` once: the caller puts its result back after each replay).
    ``where`` names the modules in the reason."""

    def carries(fn: Callable) -> bool:  # a hook whose work depends on shapes only, its result carried across
        replay = getattr(fn, "mmfast_replayable", None)
        if carried is None or replay is None:
            return False
        if not any(c is replay for c in carried):
            carried.append(replay)
        return True

    for m in (sub for mod in modules for sub in mod.modules()):
        if any(not own(h) and not carries(h) for h in m._forward_pre_hooks.values()):
            return f"hooks on {where}"
        forward = m.__dict__.get("forward")  # an instance forward set by a method (``HookSession.set_attr``)
        if forward is not None and not getattr(forward, "mmfast_graph_safe", False) and not carries(forward):
            return f"a replaced forward on {where}"
        if any(not compat.is_inert_output_hook(h) and not carries(h) for h in m._forward_hooks.values()):
            return f"hooks on {where}"
        hooks = getattr(m, "_mmfast_attn", None)
        if hooks is None:
            continue
        if any(not carries(fn) for fn in hooks.every_forward()):
            return f"attention probes, recorders or overrides acting in every forward, on {where}"
        if any(not carries(rec) for rec in hooks.prefill_recorders):
            return f"attention probes or recorders whose work depends on the batch, on {where}"
    return None


#: row selectors whose rows depend on the shapes only: a probe with one of these computes the same rows of any
#: batch of a shape, so it may run inside a captured prefill segment (``LMRunner``) and its record be replayed
SHAPE_ONLY_ROWS = frozenset({last_row, cls_row, all_rows})
#: staged probe rows (``watch(rows_from_inputs=True)``) are padded to a multiple of this many rows
ROW_PAD = 16


def staged_copy(buffers: dict, key: Hashable, fresh: torch.Tensor, device) -> torch.Tensor:
    """``fresh`` copied into the memory ``buffers`` keeps under ``key`` (made on ``device`` the first time): a
    captured graph's input, at the same address for every call of that key."""
    buf = buffers.get(key)
    if buf is None:
        buf = buffers[key] = torch.empty(fresh.shape, dtype=fresh.dtype, device=device)
    return buf.copy_(fresh)


def pad_rows(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` ([..., R]) padded with -1 (unused rows: all-zero records) to a multiple of :data:`ROW_PAD`."""
    pad = -rows.shape[-1] % ROW_PAD
    return torch.nn.functional.pad(rows, (0, pad), value=-1) if pad else rows


@dataclass
class ProbeRecord:
    """Attention rows captured on one module during one forward."""

    probs: torch.Tensor  # [B, H, R, K] fp32 (or reduced over heads: [B, R, K])
    rows: torch.Tensor  # [B, R]
    q_len: int
    k_len: int


class AttentionProbe:
    """Collects attention rows from a set of modules. Results are keyed by a caller-chosen name.

    Usage (inside a HookSession)::

        probe = AttentionProbe(session)
        probe.watch("llm.1", adapter.layers[1].self_attn, rows=last_row)
        model(...)
        probe["llm.1"].probs  # [B, H, 1, K]
    """

    def __init__(self, session, reduce: str | None = None) -> None:
        self.session = session
        self.records: dict[str, ProbeRecord] = {}
        self.reduce = reduce
        self._rows: dict[tuple, torch.Tensor] = {}  # shape-only rows on the device, made once per shape
        self._staged: dict[str, tuple[int, torch.Tensor]] = {}  # name -> (q_len, rows [B, W]) staged for a segment
        self._row_buffers: dict[tuple, torch.Tensor] = {}  # the staged rows' memory, one per shape and width
        self.time_s = 0.0  # time spent computing probe rows (the scoring overhead of probing methods)

    def watch(
        self,
        name: str,
        attn_module: nn.Module,
        rows: RowSelector = last_row,
        *,
        when: Callable[[int, int], bool] | None = None,
        reduce: str | None = None,
        prefill_only: bool = False,
        rows_from_inputs: bool = False,
        decode_replayable: bool = False,
    ) -> None:
        """Record ``rows`` of ``attn_module``'s attention under ``name`` on each forward.

        ``when(q_len, k_len)`` filters forwards; ``reduce`` is None (keep heads), "mean" or "max" over
        heads; ``prefill_only``: the caller reads the record only at prefill, so the probe does not run
        in LLM decode steps (which can then be captured graphs). ``rows_from_inputs`` (with
        ``prefill_only``): ``rows`` depend on the batch but are known before the forward, from the call's
        inputs (e.g. text rows chosen from the prompt), so a captured prefill segment stages them as its
        input (:meth:`_stage`) instead of running this probe's Python. ``decode_replayable`` (shape-only
        ``rows``; ``when`` a function of the forward's shapes and of what the caller keeps apart in the graph's
        key, e.g. a verify step's block mask): the probe records in LLM decode steps too, and a captured step
        replays it, its record put back after each replay (OPERA's last-layer rows).
        """
        if compat.attends_per_chunk(attn_module):  # each call's record would replace the previous chunk's
            raise InputError(
                f"probe {name!r}: {type(attn_module).__name__} (a Qwen-VL vision block) calls attention once per "
                "image or window, so a probe would keep the last one's rows only; record every call with a recorder "
                "on hooks.attach(session, module) instead (as VisionZip's ReceivedAttention does)"
            )
        hooks = attach(self.session, attn_module)
        reduce = reduce if reduce is not None else self.reduce
        is_causal = bool(getattr(attn_module, "is_causal", False))
        shape_only = rows in SHAPE_ONLY_ROWS

        def record(module, query, key, attention_mask, scaling) -> None:
            q_len, k_len = query.shape[2], key.shape[2]
            if when is not None and not when(q_len, k_len):
                return
            t0 = time.perf_counter()
            staged = self._staged.get(name)
            if shape_only:  # copied to the device once per shape: none inside a captured segment
                r = self._rows.get((rows, q_len, k_len, query.device))
                if r is None:
                    r = self._rows[(rows, q_len, k_len, query.device)] = rows(q_len, k_len).to(query.device)
            elif staged is not None and staged[0] == q_len:  # a captured segment's input (its graph reads it)
                r = staged[1]
            elif rows_from_inputs:  # padded as when staged: the same computation, captured or not
                r = pad_rows(_within(name, rows(q_len, k_len), q_len).to(query.device))
            else:
                r = _within(name, rows(q_len, k_len), q_len).to(query.device)
            probs = row_attention(query, key, attention_mask, scaling, r, is_causal)
            if reduce == "mean":
                probs = probs.mean(1)
            elif reduce == "max":
                probs = probs.amax(1)
            rr = r if r.dim() == 2 else r.unsqueeze(0).expand(query.shape[0], -1)
            self.records[name] = ProbeRecord(probs, rr, q_len, k_len)
            self.time_s += time.perf_counter() - t0

        # a captured prefill segment replays this recorder where its rows depend on shapes only or are staged as
        # the graph's input, and puts the record its graph writes back after each replay
        stageable = rows_from_inputs and prefill_only and not shape_only
        if decode_replayable and (prefill_only or not shape_only):
            raise ValueError(f"probe {name!r}: a decode-replayable probe records in every forward, on shape-only rows")
        record.mmfast_replayable = (  # type: ignore[attr-defined]
            Carried(
                lambda: self.records.get(name),
                lambda rec: self.records.__setitem__(name, rec),
                (lambda length: self._stage(name, rows, length)) if stageable else None,
                decode=decode_replayable,
            )
            if shape_only or stageable
            else None
        )
        (hooks.prefill_recorders if prefill_only else hooks.recorders).append(record)

    def _stage(self, name: str, rows: RowSelector, length: int | None) -> Hashable:
        """Stage ``rows`` of a prefill segment of ``length`` slots (q_len = k_len) for the probe ``name``: in the
        same device memory for every call of a shape and width (what a captured graph reads), padded
        (:func:`pad_rows`) so that calls whose row counts differ a little replay one graph. Returns the graph's
        key part; ``length`` None drops the staged rows."""
        if length is None:
            self._staged.pop(name, None)
            return None
        fresh = pad_rows(_within(name, rows(length, length), length))  # [B, W] or [W]
        buf = staged_copy(self._row_buffers, (name, tuple(fresh.shape), length, fresh.device), fresh, fresh.device)
        self._staged[name] = (length, buf)
        return (name, fresh.shape[-1])

    def __getitem__(self, name: str) -> ProbeRecord:
        if name not in self.records:
            raise KeyError(f"no attention recorded for {name!r}; was the module run with the probe installed?")
        return self.records[name]

    def get(self, name: str) -> ProbeRecord | None:
        return self.records.get(name)

    def clear(self) -> None:
        self.records.clear()


def _within(name: str, rows: torch.Tensor, q_len: int) -> torch.Tensor:
    """``rows`` (a row selector's answer), refused where a row on the host lies past the forward's ``q_len`` query rows
    (an index error deep in the probe on the CPU, a device-side assert on CUDA); rows already on the device are not
    read back."""
    if rows.device.type == "cpu" and rows.numel() and int(rows.max()) >= q_len:
        raise InputError(
            f"probe {name!r}: row {int(rows.max())} asked of a forward with {q_len} query rows; a row selector gets "
            "(q_len, k_len) of each forward: pick rows from them (an in-LLM pruner shortens the sequence of its "
            "layer and the later ones, and a decode step has one row per new token; ``when`` skips forwards)"
        )
    return rows


def attach(session, attn_module: nn.Module) -> ModuleAttentionHooks:
    """``session``'s ModuleAttentionHooks of ``attn_module``, created (and scheduled for removal) if needed. Where
    another open session (an outer one) has its own there, ``session`` gets a copy of it to add to (what the outer
    one installed keeps acting), so what ``session`` adds goes with its close instead of staying in the outer's."""
    hooks = attn_module.__dict__.get("_mmfast_attn")
    if hooks is None or hooks.session is not session:
        outer = hooks
        hooks = ModuleAttentionHooks(session=session)
        if outer is not None:
            hooks.recorders = list(outer.recorders)
            hooks.override = outer.override
            hooks.prefill_recorders = list(outer.prefill_recorders)
        session.set_attr(attn_module, "_mmfast_attn", hooks)
        session.use_probe_attention()
    return hooks


def forget(closing: ModuleAttentionHooks, before: ModuleAttentionHooks | None, held: list) -> None:
    """Take what a closing session added on a module (its hooks ``closing`` over ``before``, the hooks it found there
    or None) out of the hooks in ``held`` (other open sessions': copies :func:`attach` made of ``closing``), so that a
    closed session's recorders and override stop acting."""
    if not isinstance(closing, ModuleAttentionHooks):
        return
    kept = before if isinstance(before, ModuleAttentionHooks) else ModuleAttentionHooks()
    added = [
        fn
        for fn in (*closing.recorders, *closing.prefill_recorders)
        if not any(fn is k for k in (*kept.recorders, *kept.prefill_recorders))
    ]
    for hooks in held:
        if not isinstance(hooks, ModuleAttentionHooks) or hooks is closing or hooks is before:
            continue
        hooks.recorders[:] = [fn for fn in hooks.recorders if not any(fn is a for a in added)]
        hooks.prefill_recorders[:] = [fn for fn in hooks.prefill_recorders if not any(fn is a for a in added)]
        if (
            closing.override is not None
            and closing.override is not kept.override
            and hooks.override is closing.override
        ):
            hooks.override = kept.override
