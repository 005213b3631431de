"""Strict recipes: YAML -> frozen dataclasses.

The loader builds nested dataclasses from their type hints and refuses anything it does not know:
unknown keys fail with the dotted path and a did-you-mean suggestion, wrong types and out-of-range
values fail with the key and the allowed range. Each method owns its ``Config`` dataclass (with the
paper's defaults); the recipe's ``method:`` key picks which one validates ``params:``.

Ranges are declared on fields with :func:`opt`::

    @dataclass(frozen=True)
    class Config:
        ratio: float = opt(0.5, lo=0.0, hi=1.0, doc="fraction of image tokens dropped")
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import logging
import math
import os
import re
import string
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from .capabilities import check_recipe
from .errors import ConfigError, IncompatibleRecipeError, InputError, UnknownMethodError
from .registry import REGISTRIES, TASKS

logger = logging.getLogger(__name__)

_MISSING = dataclasses.MISSING


def opt(
    default: Any = _MISSING,
    *,
    lo: float | None = None,
    hi: float | None = None,
    doc: str = "",
    factory=None,
    min_items: int = 0,
):
    """A dataclass field with an allowed range (inclusive; of every item of a list), the fewest items a
    list may have, and a one-line description."""
    meta = {"lo": lo, "hi": hi, "doc": doc, "min_items": min_items}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


# --------------------------------------------------------------------------- generic strict loader


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "null"
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin in (tuple, list):
        args = typing.get_args(tp)
        return f"list of {_type_name(args[0])}" if args else "list"
    if origin is dict:
        return "mapping"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, path: str) -> Any:
    """Convert ``value`` to type ``tp`` or raise ConfigError naming ``path``."""
    origin = typing.get_origin(tp)
    if tp is Any:
        _check_plain(value, path)
        return value
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value is False and "off" in allowed:  # YAML 1.1 reads an unquoted `off` as false (model.compile: off)
            value = "off"
        if value not in allowed:
            close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(path, f"{value!r} is not allowed{hint} (allowed: {', '.join(map(repr, allowed))})")
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(path, f"must not be null (expected {_type_name(tp)})")
        mappings = [a for a in args if dataclasses.is_dataclass(a) or typing.get_origin(a) is dict]
        if isinstance(value, dict) and len(mappings) == 1:  # a mapping can only be that arm: its own error
            return _convert(value, mappings[0], path)
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, path)
            except ConfigError as exc:
                errors.append(exc)
        if len(errors) == 1:
            raise errors[0]
        raise ConfigError(path, f"expected {_type_name(tp)}, got {value!r}")
    if origin in (tuple, list):
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(path, f"expected a list, got {type(value).__name__} {value!r}")
        item_tp = args[0] if args else Any
        return tuple(_convert(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        key_tp, val_tp = typing.get_args(tp) or (str, Any)
        if not isinstance(value, dict):
            raise ConfigError(path, f"expected a mapping, got {type(value).__name__}")
        return {_convert(k, key_tp, path): _convert(v, val_tp, f"{path}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, path)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, f"expected an integer, got {value!r}")
        _check_int_size(value, path)
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(path, f"expected a number, got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(path, f"{value!r} is not a finite number; give a finite value")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(path, f"expected a string, got {value!r}")
        return value
    raise ConfigError(path, f"unsupported field type {tp!r} (mmfast bug)")


_PLAIN_SCALARS = (str, int, float, bool, type(None))


#: the largest integer a recipe may hold (seeds, counts): what a 64-bit signed integer holds
MAX_RECIPE_INT = 2**63 - 1


def _check_int_size(value: int, path: str) -> None:
    if abs(value) > MAX_RECIPE_INT:
        raise ConfigError(
            path, f"a {value.bit_length()}-bit integer is too large; give one of at most {MAX_RECIPE_INT} (2**63 - 1)"
        )


def _check_plain(value: Any, path: str) -> None:
    """Refuse what YAML's tags make besides plain data (``2024-01-01`` is a date, ``!!binary`` bytes,
    ``!!set`` a set) in a free-form value: the recipe is written out and hashed as JSON-like data."""
    if isinstance(value, _PLAIN_SCALARS):
        if isinstance(value, int) and not isinstance(value, bool):
            _check_int_size(value, path)
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_plain(v, f"{path}[{i}]")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, _PLAIN_SCALARS):
                raise ConfigError(path, f"key {k!r} is a {type(k).__name__}; write keys as strings or numbers")
            _check_plain(v, _join(path, str(k)))
        return
    raise ConfigError(
        path,
        f"{value!r} is a {type(value).__name__} (a YAML tag or an unquoted date made it); give plain data "
        "(a string, number, true/false, list or mapping): quote it to give the text",
    )


def _check_range(value: Any, f: dataclasses.Field, path: str) -> None:
    least = f.metadata.get("min_items", 0)
    if isinstance(value, tuple) and len(value) < least:
        raise ConfigError(path, f"needs at least {least} item{'s' * (least > 1)}, got {len(value)}")
    lo, hi = f.metadata.get("lo"), f.metadata.get("hi")
    if value is None or (lo is None and hi is None):
        return
    items = value if isinstance(value, tuple) else (value,)
    for v in items:
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            if (lo is not None and v < lo) or (hi is not None and v > hi):
                rng = f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
                raise ConfigError(path, f"{v!r} is out of range; allowed {rng}")


def from_dict(cls: type, data: Any, path: str = "") -> Any:
    """Build dataclass ``cls`` from a mapping, strictly. ``path`` is the dotted prefix for errors."""
    hook = getattr(cls, "_from_recipe", None)
    if hook is not None:
        return hook(data, path)
    return _from_fields(cls, data, path)


def _from_fields(cls: type, data: Any, path: str, **fixed: Any) -> Any:
    """``from_dict`` without the ``_from_recipe`` hook; ``fixed`` fields are set by the caller, not the recipe."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            path,
            f"expected a mapping with keys {sorted(f.name for f in dataclasses.fields(cls) if f.name not in fixed)}",
        )
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init and f.name not in fixed}
    renamed = dict(getattr(cls, "_renamed", ()))  # old key -> what to write now (a method's renamed knob)
    for key in data:
        if key not in fields:
            if key in renamed:
                raise ConfigError(_join(path, str(key)), f"renamed; {renamed[key]}")
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = (
                f"did you mean {close[0]!r}?"
                if close
                else f"allowed keys: {', '.join(sorted(fields))}"
                if fields
                else "it takes no keys here"
            )
            raise ConfigError(_join(path, str(key)), f"unknown key; {hint}")
    kwargs = {}
    for name, f in fields.items():
        sub = _join(path, name)
        if name in data:
            kwargs[name] = _convert(data[name], hints[name], sub)
            _check_range(kwargs[name], f, sub)
        elif f.default is _MISSING and f.default_factory is _MISSING:  # type: ignore[misc]
            raise ConfigError(sub, "is required")
    try:
        return cls(**kwargs, **fixed)
    except ConfigError:
        raise
    except (ValueError, TypeError) as exc:
        raise ConfigError(path or cls.__name__, str(exc)) from None


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def to_dict(obj: Any) -> Any:
    """Canonical plain-data dump of a (nested) config."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        dump = getattr(obj, "_to_recipe", None)
        if dump is not None:
            return dump()
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): to_dict(v) for k, v in obj.items()}
    return obj


def describe_fields(cls: type) -> list[tuple[str, Any, str]]:
    """(name, default, doc) for each field of a config dataclass: used by ``mmfast list -v``."""
    out = []
    for f in dataclasses.fields(cls):
        default = (
            f.default
            if f.default is not _MISSING
            else (f.default_factory() if f.default_factory is not _MISSING else None)
        )  # type: ignore[misc]
        out.append((f.name, default, f.metadata.get("doc", "")))
    return out


# --------------------------------------------------------------------------- recipe sections


@dataclass(frozen=True)
class Budget:
    """One budget vocabulary for every pruning stage: exactly one of ``tokens``, ``ratio`` or ``flops``,
    each a rule *per visual input* (an image, or a whole video), applied to that input's own vision-token
    count N_i on every model family (LLaVA-1.5's fixed 576, LLaVA-NeXT / OneVision anyres, Qwen-VL
    dynamic resolution): never scaled from a reference count.

    ``tokens``: vision tokens kept per image at the LLM input for feature/tower-stage methods, or the
    layer-averaged equivalent vision tokens per image for in-LLM methods (each method's docstring says
    which and how it maps the budget to its own knobs, in ``budget_params`` or ``calibrate``); an image
    with fewer than ``tokens`` vision tokens is refused before the LLM runs, naming both counts.
    ``ratio``: the fraction of each image's vision tokens kept (0 < ratio <= 1): round(ratio * N_i) tokens
    (layer-averaged for in-LLM methods), at least 1.
    ``flops``: prefill FLOPs of the LLM as a fraction of the unpruned model on the loaded model's
    shape; converted to tokens per image by :func:`mmfast.flops.tokens_for_flops_ratio` at the image's
    own count N_i (rule documented there).
    """

    tokens: int | None = opt(None, lo=1, doc="vision tokens kept per image (layer-averaged for in-LLM methods)")
    ratio: float | None = opt(None, lo=0.0, hi=1.0, doc="fraction of each image's vision tokens kept (0 < ratio <= 1)")
    flops: float | None = opt(None, lo=0.0, hi=1.0, doc="prefill FLOPs ratio vs the unpruned model (0 < flops <= 1)")

    @classmethod
    def _from_recipe(cls, data: Any, path: str) -> Budget:
        if isinstance(data, dict):
            for key in ("ratio", "flops"):
                v = data.get(key)
                if isinstance(v, (int, float)) and not isinstance(v, bool) and v <= 0:
                    raise ConfigError(_join(path, key), f"{v!r} is out of range; allowed (0, 1] (a fraction above 0)")
        return _from_fields(cls, data, path)

    def __post_init__(self) -> None:
        given = [k for k in ("tokens", "ratio", "flops") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(
                "set exactly one of tokens, ratio or flops, e.g. budget: {tokens: 64} (vision tokens kept per image), "
                "budget: {ratio: 0.11} (fraction of each image's vision tokens kept) or budget: {flops: 0.2}"
                + (f"; got {' and '.join(given)}" if given else "")
            )
        for k in ("ratio", "flops"):
            v = getattr(self, k)
            if v is not None and v <= 0.0:
                raise ValueError(f"{k} must be > 0, got {v}")

    @property
    def key(self) -> str:
        """The one key that is set (``tokens``, ``ratio`` or ``flops``)."""
        return "tokens" if self.tokens is not None else ("ratio" if self.ratio is not None else "flops")

    @property
    def label(self) -> str:
        """Short text of the budget for names and tables: ``192``, ``r0.3333``, ``f0.2``."""
        if self.tokens is not None:
            return str(self.tokens)
        return f"r{self.ratio:g}" if self.ratio is not None else f"f{self.flops:g}"

    def _to_recipe(self) -> dict:
        return {self.key: getattr(self, self.key)}

    def check_fits(self, n: int, path: str, item: str = "image", fractions: bool = True) -> None:
        """Refuse a ``tokens`` budget above an input of ``n`` vision tokens (``path``: the budget's recipe path;
        ``item``: what the budget is per: image, video, frame group; ``fractions``: whether the stage takes a
        ``ratio`` budget there, suggested then)."""
        if self.tokens is not None and self.tokens > n:
            other = f", or for a fraction of every {item} with budget: {{ratio: r}}" if fractions else ""
            raise ConfigError(
                f"{path}.tokens",
                f"{self.tokens} vision tokens per {item} is more than this {item} has ({n} vision tokens at the LLM "
                f"input): a budget cannot keep more than the input; ask for at most {n}{other}",
            )


_STAGE_KEYS = ("method", "params", "budget")


@dataclass(frozen=True)
class MethodSpec:
    """``{method: name, params: {...}, budget: {...}}`` validated against the method's own ``Config``.

    ``budget`` (pruning stages only) is mapped to the method's own knobs when the session installs the
    stage; a ``params`` key that sets one of those knobs (the class's ``budget_knobs``) together with a
    budget is refused.
    """

    kind: str
    method: str
    params: Any
    budget: Budget | None = None

    @classmethod
    def build(cls, kind: str, data: Any, path: str, section_keys: tuple[str, ...] = ()) -> MethodSpec:
        """``section_keys``: the section's own keys besides the spec's (taken out of ``data`` by the
        caller, e.g. decoding's ``max_new_tokens``, ``seed``), named in an unknown key's hint."""
        if isinstance(data, str):
            data = {"method": data}
        if not isinstance(data, dict):
            raise ConfigError(path, "expected a mapping like {method: NAME, params: {...}}")
        allowed = (*(_STAGE_KEYS if kind == "pruning" else ("method", "params")), *section_keys)
        for key in data:
            if key not in allowed:
                close = difflib.get_close_matches(str(key), list(allowed), n=1)
                hint = f"did you mean {close[0]!r}?" if close else f"allowed keys: {', '.join(allowed)}"
                raise ConfigError(_join(path, str(key)), f"unknown key; {hint}")
        if "method" not in data:
            raise ConfigError(_join(path, "method"), "is required")
        name = _convert(data["method"], str, _join(path, "method"))
        registry = REGISTRIES[kind]
        try:
            entry = registry.get(name)
        except Exception as exc:
            raise ConfigError(_join(path, "method"), str(exc)) from None
        raw_params = data.get("params")
        if raw_params is None:  # ``params:`` left empty
            raw_params = {}
        if not isinstance(raw_params, dict):
            raise ConfigError(
                _join(path, "params"), f"expected a mapping (the parameters of {name!r}), got {raw_params!r}"
            )
        if entry.config_cls is None and raw_params:
            raise ConfigError(
                _join(path, f"params.{next(iter(raw_params))}"), f"unknown key; method {name!r} takes no params"
            )
        params = from_dict(entry.config_cls, raw_params, _join(path, "params")) if entry.config_cls else None
        budget = None
        if data.get("budget") is not None:
            budget = from_dict(Budget, data["budget"], _join(path, "budget"))
            knobs = tuple(getattr(entry.cls, "budget_knobs", ()))
            if not knobs:
                raise ConfigError(
                    _join(path, "budget"), f"method {name!r} does not take a budget; set its params instead"
                )
            clash = [k for k in knobs if isinstance(raw_params, dict) and k in raw_params]
            if clash:
                which = budget.key
                raise ConfigError(
                    _join(path, f"params.{clash[0]}"),
                    f"sets the same knob as {_join(path, 'budget.' + which)}; remove one of them "
                    f"(the budget sets {', '.join(knobs)})",
                )
        return cls(kind, name, params, budget)

    def _to_recipe(self) -> dict:
        out = {"method": self.method, "params": to_dict(self.params) if self.params is not None else {}}
        if self.budget is not None:  # only when set: recipes without a budget keep their hashes
            knobs = getattr(REGISTRIES[self.kind].get(self.method).cls, "budget_knobs", ())
            out["params"] = {k: v for k, v in out["params"].items() if k not in knobs}  # the budget sets them
            out["budget"] = self.budget._to_recipe()
        return out


@dataclass(frozen=True)
class ModelConfig:
    name: str = opt("mmfast/tiny-world", doc="local directory, hub id, or an embedded model name")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = opt("float32", doc="weights/compute dtype")
    device: str = opt("auto", doc="auto | cpu | cuda | cuda:N (ignored with device_map)")
    device_map: str | None = opt(None, doc="passed to from_pretrained, e.g. 'auto' for multi-GPU placement")
    attn_implementation: Literal["sdpa", "eager"] = opt("sdpa", doc="attention kernels; scores come from the probe")
    fused_vision_attention: bool = opt(
        True,
        doc="Qwen-VL towers: one batched sdpa call per chunk length instead of one per window / image "
        "(equal within float tolerance; mmfast/models/qwen_tower.py); false runs transformers' loop",
    )
    revision: str | None = opt(None, doc="hub revision")
    offload_folder: str | None = opt(None, doc="disk offload folder for device_map placement")
    max_memory: dict[int | str, str] | None = opt(
        None, doc="per-device memory caps for device_map, e.g. {0: 20GiB, cpu: 60GiB}"
    )
    compile: Literal["off", "static", "auto"] = opt(
        "auto",
        doc="decode on a static KV cache with fixed-shape steps: auto (on CUDA each step one captured CUDA "
        "graph; the dynamic cache where a method's step cannot be captured, except for one-token calls, and on other "
        "devices), static "
        "(eager static steps on any device), off (the dynamic cache); methods whose decode hooks need the "
        "dynamic cache fall back to it with a logged reason. auto on CUDA also captures the prefill (in segments "
        "between in-LLM pruning layers) and a LLaVA-style vision tower, where no method's Python runs inside them",
    )
    fuse_norms: bool = opt(
        False,
        doc="run the language model's RMSNorm modules as one torch.compile-d (Inductor) kernel each instead of ~8 "
        "eager ones (equal within float tolerance; fewer kernels per decode step; mmfast/models/fused_norms.py); "
        "where compiling fails the norms stay eager, with a warning",
    )

    def __post_init__(self) -> None:
        if self.device_map is None or self.device_map in DEVICE_MAP_STRATEGIES:
            return
        import torch

        try:
            torch.device(self.device_map)
        except (RuntimeError, ValueError):
            raise ConfigError(
                "model.device_map",
                f"{self.device_map!r} is neither a placement strategy "
                f"({', '.join(DEVICE_MAP_STRATEGIES)}) nor a device (cpu, cuda, cuda:N)",
            ) from None


#: the placement strategies ``from_pretrained(device_map=...)`` takes by name
DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


@dataclass(frozen=True)
class DecodingConfig:
    method: str = "greedy"
    params: Any = None
    max_new_tokens: int = opt(64, lo=1, hi=8192, doc="tokens generated per answer")
    seed: int | None = opt(
        None,
        lo=0,
        doc="seed for sampling-based decoders and random transforms; unset: evaluations "
        "and benches use 0, generate() without seed= follows torch's global RNG",
    )

    @classmethod
    def _from_recipe(cls, data: Any, path: str) -> DecodingConfig:
        if isinstance(data, str):  # shorthand: ``decoding: beam``
            data = {"method": data}
        if data is not None and not isinstance(data, dict):
            raise ConfigError(
                path, "expected a decoder name or a mapping like {method: NAME, params: {...}, max_new_tokens: N}"
            )
        data = dict(data or {})
        scalars = ("max_new_tokens", "seed")
        extra = {k: data.pop(k) for k in scalars if k in data}
        spec = MethodSpec.build("decoding", {"method": data.pop("method", "greedy"), **data}, path, scalars)
        base = from_dict(_DecodingScalars, extra, path)
        return cls(spec.method, spec.params, base.max_new_tokens, base.seed)

    def _to_recipe(self) -> dict:
        return {
            "method": self.method,
            "params": to_dict(self.params) if self.params is not None else {},
            "max_new_tokens": self.max_new_tokens,
            "seed": self.seed,
        }


@dataclass(frozen=True)
class _DecodingScalars:
    max_new_tokens: int = opt(64, lo=1, hi=8192)
    seed: int | None = opt(None, lo=0)


PopeSplit = Literal["random", "popular", "adversarial"]  # eval.pope.splits' choices


@dataclass(frozen=True)
class PopeTaskConfig:
    splits: tuple[PopeSplit, ...] = typing.get_args(PopeSplit)
    files: dict[str, str] = opt(factory=dict, doc="split -> question file; default from data root")
    prompt: str = opt("{question}", doc="'{question}' is replaced by the POPE question")
    parser: Literal["pope", "opera", "vcd", "lmms"] = "pope"
    max_new_tokens: int = opt(16, lo=1, hi=1024)
    strict_version: bool = opt(False, doc="refuse question files whose checksum is not a known release")
    world_version: Literal["official", "v1"] = opt(
        "official", doc="world POPE files: 'official' rule (default) or 'v1' (area-ordered positives, before 2026-11)"
    )

    def __post_init__(self) -> None:
        if not self.splits:
            raise ValueError(
                "splits is empty: name at least one of random, popular, adversarial (or leave pope out of eval.tasks)"
            )
        names = typing.get_args(PopeSplit)
        for key in self.files:  # a typo (randm) would be ignored and the default file evaluated
            if key in self.splits:
                continue
            if key in names:
                raise ConfigError(
                    f"eval.pope.files.{key}",
                    f"split {key!r} is not in eval.pope.splits ({', '.join(self.splits)}); add it there or remove "
                    "this file",
                )
            hint = difflib.get_close_matches(str(key), names, n=1)
            raise ConfigError(
                f"eval.pope.files.{key}",
                f"unknown POPE split {key!r}"
                + (f"; did you mean {hint[0]!r}?" if hint else f"; the splits are {', '.join(names)}"),
            )


@dataclass(frozen=True)
class ChairTaskConfig:
    n_images: int = opt(500, lo=1)
    seed: int = opt(0, lo=0)
    prompt: str = "Please describe this image in detail."
    max_new_tokens: int = opt(512, lo=1, hi=8192)
    image_ids_file: str | None = opt(None, doc="fixed list of image ids (one per line), instead of sampling")


@dataclass(frozen=True)
class DataConfig:
    dataset: Literal["world", "coco"] = opt("world", doc="the embedded world or real COCO val2014")
    root: str | None = opt(None, doc="world dir or COCO root; coco defaults to $MMFAST_COCO_ROOT")
    world_seed: int = opt(0, lo=0)
    image_dir: str | None = None
    instances: tuple[str, ...] = ()
    captions: tuple[str, ...] = ()


_TASK_SECTIONS = ("pope", "chair")  # built-in tasks whose options are EvalConfig fields (eval.pope, eval.chair)


@dataclass(frozen=True)
class EvalConfig:
    """``eval``: which registered tasks run (``eval.tasks``), on what data, and each task's options.

    Built-in tasks keep their sections as fields (``eval.pope``, ``eval.chair``); any other registered
    task with a ``Config`` dataclass takes its section ``eval.<task name>``, validated by that class and
    kept in ``task_options`` (written back as ``eval.<task name>``)."""

    tasks: tuple[str, ...] = opt((), doc="registered evaluation tasks to run, in order (`mmfast list` shows them)")
    data: DataConfig = opt(factory=DataConfig)
    pope: PopeTaskConfig = opt(factory=PopeTaskConfig)
    chair: ChairTaskConfig = opt(factory=ChairTaskConfig)
    batch_size: int = opt(1, lo=1, hi=256)
    limit: int | None = opt(None, lo=1, doc="samples per task/split (smoke runs)")
    max_failures: float = opt(
        0.05,
        lo=0.0,
        hi=1.0,
        doc="abort when more than this fraction of the planned samples fail (0: at the first failure)",
    )
    task_options: dict[str, Any] = opt(factory=dict, doc="sections eval.<task> of tasks outside the built-ins")

    def task_config(self, name: str) -> Any:
        """The options of task ``name``: ``eval.pope`` / ``eval.chair``, or a registered task's
        ``eval.<name>`` section (its ``Config()`` defaults when the recipe has none; None without a Config)."""
        if name in _TASK_SECTIONS:
            return getattr(self, name)
        if name in self.task_options:
            return self.task_options[name]
        config_cls = TASKS.get(name).config_cls
        return config_cls() if config_cls is not None else None

    @classmethod
    def _from_recipe(cls, data: Any, path: str) -> EvalConfig:
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(path, "expected a mapping with keys tasks, data, pope, chair, batch_size, ...")
        own = [f.name for f in dataclasses.fields(cls) if f.name != "task_options"]
        sections = [n for n in TASKS.names() if n not in own and TASKS.get(n).config_cls is not None]
        options: dict[str, Any] = {}
        rest: dict[str, Any] = {}
        for key, value in data.items():
            if key in own:
                rest[key] = value
            elif key in sections:
                options[key] = from_dict(TASKS.get(key).config_cls, value, _join(path, key))
            else:
                close = difflib.get_close_matches(str(key), own + sections, n=1)
                hint = f"did you mean {close[0]!r}?" if close else f"allowed keys: {', '.join(sorted(own + sections))}"
                raise ConfigError(_join(path, str(key)), f"unknown key; {hint}")
        cfg = _from_fields(cls, rest, path, task_options=options)
        for i, name in enumerate(cfg.tasks):
            where = f"{_join(path, 'tasks')}[{i}]"
            try:
                entry = TASKS.get(name)
            except UnknownMethodError as exc:
                raise ConfigError(where, str(exc)) from None
            if name in cfg.tasks[:i]:
                raise ConfigError(where, f"task {name!r} is listed twice; list each task once")
            if name in own and name not in _TASK_SECTIONS and entry.config_cls is not None:
                raise ConfigError(
                    where,
                    f"task {name!r} has options but its name is the eval key {_join(path, name)}; "
                    "register the task under another name",
                )
        return cfg

    def _to_recipe(self) -> dict:
        out = {f.name: to_dict(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "task_options"}
        out.update({name: to_dict(value) for name, value in self.task_options.items()})
        return out


@dataclass(frozen=True)
class BenchConfig:
    kind: Literal["none", "pruning", "decoding", "speculative", "speed", "gpu_speed", "video_cost"] = "none"
    compare: tuple[Any, ...] = opt((), doc="method variants run against the baseline in the same process")
    budgets: tuple[int | Budget, ...] = opt(
        (),
        lo=1,
        doc="pruning budgets: N (vision tokens kept per image) or a budget mapping such as {ratio: 0.3333}; "
        "each bench.methods entry runs at each",
    )
    methods: tuple[Any, ...] = opt(
        (),
        doc="pruning methods run at every bench.budgets entry: NAME or {method, params} (params without the budget's knobs)",
    )
    n_samples: int = opt(32, lo=1)
    warmup: int = opt(1, lo=0)
    repeats: int = opt(3, lo=1)
    shape: str | None = opt(None, doc="random-weight model shape for timings, e.g. llava-1.5-7b-slice")
    params: dict[str, Any] = opt(factory=dict, doc="benchmark-specific settings (keys by kind: BENCH_PARAMS)")

    def __post_init__(self) -> None:
        if self.kind == "none":  # nothing reads (or validates) these without a bench kind: a forgotten kind
            unused = [k for k in ("compare", "budgets", "methods", "shape", "params") if getattr(self, k)]
            if unused:
                raise ConfigError(
                    f"bench.{unused[0]}",
                    "is set but bench.kind is none, so no bench reads it; set bench.kind "
                    "(pruning, decoding, speculative, speed, gpu_speed, video_cost) or remove it",
                )
        allowed = BENCH_PARAMS.get(self.kind, {})
        for key, value in self.params.items():
            if key not in allowed:
                close = difflib.get_close_matches(str(key), list(allowed), n=1)
                hint = (
                    f"did you mean {close[0]!r}?"
                    if close
                    else f"allowed for a {self.kind} bench: {', '.join(sorted(allowed)) or 'none'}"
                )
                raise ConfigError(f"bench.params.{key}", f"unknown key; {hint}")
            _convert(value, allowed[key], f"bench.params.{key}")
            if key in BENCH_COUNTS and value < 1:  # a timing pass would fail (or divide by zero) after the evaluation
                raise ConfigError(f"bench.params.{key}", f"must be >= 1, got {value}")
        if self.kind == "speculative":
            _check_speculative_params(self.params)
        if self.shape is not None:
            from .models.factory import QWEN_SHAPES, SHAPES

            known = [*SHAPES, *(k for k in QWEN_SHAPES if k != "tiny")]
            if self.shape not in known:
                close = difflib.get_close_matches(self.shape, known, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ConfigError("bench.shape", f"unknown shape {self.shape!r}{hint} (known: {', '.join(known)})")


@dataclass(frozen=True)
class SpeculativeWorkload:
    """One ``bench.params.workloads`` item of a speculative bench (mmfast/bench/speculative.py): ``prompt`` asked
    about every timed image, ``max_new_tokens`` generated at most; ``name`` keys its rows (one per temperature)."""

    name: str
    prompt: str
    max_new_tokens: int = opt(lo=1)


def _check_speculative_params(params: dict[str, Any]) -> None:
    """A speculative bench's rows are keyed ``{workload}@T{temperature}``: names and temperatures are distinct (a
    repeat overwrote the other's results), names are not empty and hold no ``/`` (each names a plot file),
    temperatures >= 0 (0: greedy)."""
    names = [w["name"] for w in params.get("workloads", ())]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ConfigError(f"bench.params.workloads[{i}].name", f"workload {name!r} is listed twice; name each once")
        if not name or "/" in name:
            raise ConfigError(f"bench.params.workloads[{i}].name", f"{name!r} names a plot file: give a name without /")
    temps = [float(t) for t in params.get("temperatures", ())]
    for i, t in enumerate(temps):
        if t < 0 or t in temps[:i]:
            why = "is negative" if t < 0 else "is listed twice"
            raise ConfigError(f"bench.params.temperatures[{i}]", f"{t:g} {why}; give distinct temperatures >= 0")


#: the ``bench.params`` that count new tokens or samples (at least one each)
BENCH_COUNTS = ("e2e_new_tokens", "shaped_samples", "cost_new_tokens")

#: the ``bench.params`` each kind of benchmark reads, with their types (checked when the recipe loads)
BENCH_PARAMS: dict[str, dict[str, Any]] = {
    "pruning": {"e2e_new_tokens": int, "shaped_samples": int, "shaped_variants": tuple[str, ...]},
    "decoding": {"cost_new_tokens": int},
    "speculative": {"workloads": tuple[SpeculativeWorkload, ...], "temperatures": tuple[float, ...]},
    # mmfast/bench/gpu_speed.py: which shapes / batches / workloads / rows (fnmatch patterns) run, the
    # caption length, the random models' dtype, the embedded speculative part, device peak overrides
    "gpu_speed": {
        "shapes": tuple[str, ...],
        "batches": tuple[int, ...],
        "workloads": tuple[Literal["pope", "caption"], ...],
        "caption_tokens": int,
        "rows": tuple[str, ...],
        "dtype": Literal["float16", "bfloat16", "float32"],
        "embedded_speculative": bool,
        "embedded_samples": int,
        "embedded_rows": tuple[str, ...],
        "peak_bandwidth_tbs": float,
        "peak_tflops": float,
    },
    # mmfast/bench/video_cost.py: which video shapes and frame counts, the clip, a reduced depth for a CPU
    # (None: full), the random models' dtype, which rows (fnmatch patterns of variant names), the prompt
    "video_cost": {
        "shapes": tuple[str, ...],
        "frames": tuple[int, ...],
        "image_size": int,
        "seed": int,
        "clip": int,
        "clip_frames": int,
        "layers": int | None,
        "tower_layers": int | None,
        "dtype": Literal["float16", "bfloat16", "float32"],
        "rows": tuple[str, ...],
        "prompt": str,
    },
}


@dataclass(frozen=True)
class OutputConfig:
    dir: str = opt("runs/{name}", doc="output directory; {name} is the recipe name")
    overwrite: bool = False

    def __post_init__(self) -> None:

        try:
            fields = {f for _, f, _, _ in string.Formatter().parse(self.dir) if f is not None}
        except ValueError as exc:
            raise ConfigError(
                "output.dir",
                f"{self.dir!r} is not a valid path template ({exc}); write a literal brace as {{{{ or }}}}",
            ) from None
        if fields - {"name"}:
            raise ConfigError(
                "output.dir",
                f"{self.dir!r} uses {', '.join(sorted('{' + f + '}' for f in fields - {'name'}))}; "
                "the only field is {name} (the recipe name); write a literal brace as {{ or }}",
            )


@dataclass(frozen=True)
class Recipe:
    """A whole run: model, pruning stages, speculative drafter, decoder, evaluation, benchmark, output."""

    name: str = "recipe"
    description: str = ""
    model: ModelConfig = opt(factory=ModelConfig)
    pruning: tuple[MethodSpec, ...] = ()
    speculative: MethodSpec | None = None
    decoding: DecodingConfig = opt(factory=DecodingConfig)
    eval: EvalConfig = opt(factory=EvalConfig)
    bench: BenchConfig = opt(factory=BenchConfig)
    output: OutputConfig = opt(factory=OutputConfig)

    @classmethod
    def _from_recipe(cls, data: Any, path: str) -> Recipe:
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(path, "a recipe must be a mapping with sections model, pruning, decoding, ...")
        data = dict(data)
        pruning = data.pop("pruning", None)
        if pruning is None or pruning == {}:  # ``pruning:`` left empty; false or 0 is refused below
            pruning = []
        speculative = data.pop("speculative", None)
        if isinstance(pruning, dict):
            pruning = [pruning]
        if not isinstance(pruning, list):
            raise ConfigError("pruning", "expected a list of stages like [{method: fastv, params: {...}}]")
        stages = tuple(MethodSpec.build("pruning", st, f"pruning[{i}]") for i, st in enumerate(pruning))
        spec = MethodSpec.build("speculative", speculative, "speculative") if speculative not in (None, {}) else None
        base = from_dict(_RecipeScalars, data, path)
        recipe = cls(
            base.name, base.description, base.model, stages, spec, base.decoding, base.eval, base.bench, base.output
        )
        check_compatible(recipe)
        return recipe

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "description": self.description,
            "model": to_dict(self.model),
            "pruning": [s._to_recipe() for s in self.pruning],
            "speculative": self.speculative._to_recipe() if self.speculative else None,
            "decoding": self.decoding._to_recipe(),
            "eval": to_dict(self.eval),
            "bench": to_dict(self.bench),
            "output": to_dict(self.output),
        }

    def hash(self, leave_out_eval: tuple[str, ...] = ()) -> str:
        """sha256 of the canonical resolved recipe (written into every output), less the ``eval`` keys in
        ``leave_out_eval`` (settings that change no answer, for a run's identity). The ``output``
        section says where results go and whether to replace them, not what they are: it is left out,
        so rerunning a command without ``output.overwrite`` resumes what a run with it started."""
        what = {k: v for k, v in self.to_dict().items() if k != "output"}
        what["eval"] = {k: v for k, v in what["eval"].items() if k not in leave_out_eval}
        for key, values in _MODEL_KEYS_HASHED_ONLY_OFF_DEFAULT.items():
            if key in what["model"] and what["model"][key] in values:  # hashes of recipes from before the key stay
                del what["model"][key]
        if what["decoding"]["seed"] is None:  # an unset seed evaluates as 0: the same results, the same hash
            what["decoding"] = {**what["decoding"], "seed": 0}
        blob = json.dumps(what, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def replace(self, **changes: Any) -> Recipe:
        return dataclasses.replace(self, **changes)


#: ``model`` keys added after runs were committed, left out of :meth:`Recipe.hash` at these values so
#: that those runs still resume: the decode path (off, or auto: the same tokens as off except for the
#: last bit of GPU float kernels, as a batch size or a GPU model changes them, which the hash leaves out
#: too) and the fused Qwen tower attention (on: equal to transformers' per-window loop within float
#: tolerance, and LLaVA-family models have no such tower).
_MODEL_KEYS_HASHED_ONLY_OFF_DEFAULT: dict[str, tuple[Any, ...]] = {
    "compile": ("off", "auto"),
    "fused_vision_attention": (True,),
    "fuse_norms": (False,),
}


@dataclass(frozen=True)
class _RecipeScalars:
    name: str = "recipe"
    description: str = ""
    model: ModelConfig = opt(factory=ModelConfig)
    decoding: DecodingConfig = opt(factory=DecodingConfig)
    eval: EvalConfig = opt(factory=EvalConfig)
    bench: BenchConfig = opt(factory=BenchConfig)
    output: OutputConfig = opt(factory=OutputConfig)


# --------------------------------------------------------------------------- compatibility


def check_compatible(recipe: Recipe) -> None:
    """Refuse combinations that cannot run together, before any model is loaded (capabilities)."""
    problem = check_recipe(recipe)
    if problem:
        raise IncompatibleRecipeError(problem)


# --------------------------------------------------------------------------- loading


#: recipes larger than this are refused (a recipe is a few KiB; this bounds parsing time and memory)
MAX_RECIPE_BYTES = 1 << 20
#: YAML nodes a recipe may expand to, aliases counted at every use (bounds "billion laughs" recipes)
MAX_YAML_NODES = 100_000
#: how deeply a recipe's values may nest (a recipe needs a handful of levels; hundreds exhaust Python's
#: recursion limit when the resolved recipe is printed or hashed)
MAX_YAML_DEPTH = 64


class RecipeYAMLError(yaml.YAMLError):
    """A recipe the safe loader refuses (duplicate key, alias bomb); the message names the line."""


class _StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses duplicate mapping keys and documents whose aliases expand
    beyond :data:`MAX_YAML_NODES` nodes."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # unhashable keys: SafeLoader's own error says so
                continue
            line = key_node.start_mark.line + 1
            if first is not None:
                raise RecipeYAMLError(
                    f"line {line}: duplicate key {key!r} (first given at line {first}); keep only one of them"
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep=deep)
        except (ValueError, OverflowError) as exc:  # a scalar its tag cannot hold: 2024-13-45, a 5000-digit int
            text = node.value if isinstance(node, yaml.ScalarNode) else ""
            shown = f"{text[:40]}..." if len(text) > 40 else text
            raise RecipeYAMLError(
                f"line {node.start_mark.line + 1}: {shown!r} cannot be read as {node.tag.rsplit(':', 1)[-1]} "
                f"({' '.join(str(exc).split())}); quote it to give a string"
            ) from None

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        depth = getattr(self, "_mmfast_depth", 0)
        if depth >= MAX_YAML_DEPTH:
            mark = self.peek_event().start_mark
            raise RecipeYAMLError(
                f"line {mark.line + 1}: values nested more than {MAX_YAML_DEPTH} levels deep; "
                "a recipe needs a few levels: flatten it"
            )
        self._mmfast_depth = depth + 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._mmfast_depth = depth

    def get_single_node(self) -> yaml.Node | None:
        node = super().get_single_node()
        if node is not None:
            _expanded_size(node)
        return node


def _expanded_size(root: yaml.Node) -> int:
    """Nodes of the document with every alias expanded; refuses cycles, more than MAX_YAML_NODES and
    values nested deeper than MAX_YAML_DEPTH once aliases are expanded (an alias of a deep anchor placed
    deep inside another one: the composer's own depth check sees each anchor's depth alone)."""
    sizes: dict[int, tuple[int, int]] = {}  # node -> (expanded nodes, expanded levels)
    active: set[int] = set()

    def too_deep(node: yaml.Node) -> RecipeYAMLError:
        return RecipeYAMLError(
            f"line {node.start_mark.line + 1}: values nested more than {MAX_YAML_DEPTH} levels deep once aliases "
            "are expanded; a recipe needs a few levels: flatten it"
        )

    def size(node: yaml.Node, depth: int) -> int:
        key = id(node)
        if key in sizes:
            n, levels = sizes[key]
            if depth + levels > MAX_YAML_DEPTH:
                raise too_deep(node)
            return n
        if depth >= MAX_YAML_DEPTH:
            raise too_deep(node)
        if key in active:
            raise RecipeYAMLError(
                f"line {node.start_mark.line + 1}: a recursive alias (an anchor used inside itself); remove it"
            )
        active.add(key)
        n = 1
        children: list[yaml.Node] = []
        if isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        elif isinstance(node, yaml.MappingNode):
            children = [c for pair in node.value for c in pair]
        for child in children:
            n += size(child, depth + 1)
        active.discard(key)
        if n > MAX_YAML_NODES:
            raise RecipeYAMLError(
                f"line {node.start_mark.line + 1}: aliases expand the document to more than {MAX_YAML_NODES} "
                "values (nested anchors and aliases); write the recipe out without them"
            )
        sizes[key] = (n, 1 + max((sizes[id(c)][1] for c in children), default=0))
        return n

    return size(root, 0)


def parse_yaml(text: str) -> Any:
    """Parse recipe text with the strict safe loader (no tags beyond SafeLoader's, no duplicate keys,
    bounded alias expansion). Raises ``yaml.YAMLError``."""
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 -- a SafeLoader subclass


def yaml_problem(exc: yaml.YAMLError) -> str:
    """One line for a YAML error: the problem and where (PyYAML's own text spans several lines)."""
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem:
        mark = exc.problem_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        context = f" ({exc.context})" if exc.context else ""
        return f"{exc.problem}{context}{where}"
    return " ".join(str(exc).split())


def read_recipe_text(path: Path) -> str:
    """The text of a recipe file: refuses files over MAX_RECIPE_BYTES and non-UTF-8 (binary) files."""
    try:
        size = path.stat().st_size
        if size > MAX_RECIPE_BYTES:
            raise InputError(
                f"{path}: the recipe is {size} bytes, over the {MAX_RECIPE_BYTES}-byte limit; is this the right file?"
            )
        raw = path.read_bytes()
    except OSError as exc:
        raise InputError(f"{path}: cannot read the recipe ({exc.strerror or exc})") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(
            f"{path}: not a text recipe (invalid UTF-8 at byte {exc.start}); give a YAML file saved as UTF-8"
        ) from None


_INDEXED = re.compile(r"^([^\[\]]*)((?:\[-?\d+\])*)$")


def _override_keys(dotted: str) -> list[str | int]:
    """``pruning[0].params.k`` -> ["pruning", 0, "params", "k"]; refuses malformed paths."""
    keys: list[str | int] = []
    for part in dotted.split("."):
        m = _INDEXED.match(part)
        if not part or m is None or (not m.group(1) and not keys):
            raise InputError(
                f"override key {dotted!r} is not a dotted key path; use e.g. decoding.params.alpha=2 or pruning[0].params.k=3"
            )
        if m.group(1):
            keys.append(m.group(1))
        keys.extend(int(i) for i in re.findall(r"-?\d+", m.group(2)))
    return keys


def _is_index(key: str | int) -> bool:
    return isinstance(key, int) or re.fullmatch(r"-?\d+", key) is not None


def _is_list_key(keys: list[str | int]) -> bool:
    """Whether the recipe key ``keys`` (mapping keys from the top) is a list field, so that a number below it
    (``pruning.0``) is an index, not a mapping key (``model.max_memory.0``)."""
    cls: Any = Recipe
    for n, key in enumerate(keys):
        if isinstance(key, int) or not dataclasses.is_dataclass(cls):
            return False
        tp = typing.get_type_hints(cls).get(key)
        if tp is None:
            return False
        if n == len(keys) - 1:
            arms = typing.get_args(tp) if typing.get_origin(tp) in (Union, types.UnionType) else (tp,)
            return any(typing.get_origin(a) in (tuple, list) for a in arms)
        cls = tp
    return False


def _apply_override(data: dict, dotted: str, value: Any) -> str:
    """Set ``dotted`` (``a.b``, ``a[i].b``, ``a.i.b``) in ``data``: missing mappings are created, lists
    are indexed within range, and a key below a scalar is refused (it would silently replace it). A
    number between dots indexes a list (``pruning.0.params.keep``, as lmms-eval's ``--model_args`` write
    it) and is a key in a mapping. Returns the key's path as config errors spell it (``pruning[0].params.keep``)."""
    keys = _override_keys(dotted)
    node: Any = data
    where = ""
    for i, k in enumerate(keys):
        last = i == len(keys) - 1
        if isinstance(node, list) and _is_index(k):
            k = int(k)
            k = k + len(node) if -len(node) <= k < 0 else k
        label = f"{where}[{k}]" if isinstance(k, int) else _join(where, k)
        if isinstance(k, int):
            if not isinstance(node, list):
                raise InputError(
                    f"override {dotted!r}: {where or 'the recipe'} is not a list, so [{k}] cannot index it"
                )
            if not -len(node) <= k < len(node):
                raise InputError(
                    f"override {dotted!r}: {where} has {len(node)} entries, so [{k}] does not exist; "
                    f"index 0..{len(node) - 1}, or set the whole list"
                )
        elif not isinstance(node, dict):
            raise InputError(f"override {dotted!r}: {where} is {node!r}, not a mapping, so it has no key {k!r}")
        if last:
            node[k] = value
            return label
        child = node[k] if isinstance(k, int) else node.get(k)
        below = keys[i + 1]
        if child is None and (isinstance(below, int) or (_is_index(below) and _is_list_key(keys[: i + 1]))):
            raise InputError(
                f"override {dotted!r}: {label} is not in the recipe, so [{below}] does not exist; "
                f"set the whole list instead (e.g. {label}=[...])"
            )
        if child is None:
            child = node[k] = {}
        elif isinstance(child, str) and keys[i + 1] in ("method", "params"):
            child = node[k] = {"method": child}  # ``decoding: beam`` shorthand, then a key under it
        node = child
        where = label


def load_recipe(source: str | os.PathLike | dict, overrides: list[str] | None = None) -> Recipe:
    """Load and validate a recipe from a YAML file, a package recipe name, or a mapping.

    ``overrides`` are ``dotted.key=yaml_value`` strings (``pruning[0].params.k=3`` indexes a list)
    applied before validation.
    """
    label = "<dict>"
    if not isinstance(source, (str, os.PathLike, dict)):
        raise InputError(
            f"load_recipe got a {type(source).__name__}; pass a recipe file, a shipped recipe's name "
            "(`mmfast list recipes`) or a mapping"
        )
    if isinstance(source, dict):
        data = dict(source)
    else:
        path = resolve_recipe_path(source)
        label = str(path)
        try:
            data = parse_yaml(read_recipe_text(path))
        except yaml.YAMLError as exc:
            raise InputError(f"{path}: not a valid recipe: {yaml_problem(exc)}") from None
        if data is None:
            raise InputError(
                f"{path}: the recipe is empty; write at least its model (model: {{name: ...}}), or pass a shipped "
                "recipe's name (`mmfast list` shows them)"
            )
        if not isinstance(data, dict):
            raise InputError(f"{path}: a recipe must be a YAML mapping")
        data.setdefault("name", path.stem)
    overridden: dict[str, str] = {}  # the path each override set -> the override as given
    if isinstance(overrides, str):
        raise InputError(
            f"overrides is a list of key.path=value strings; got one string {overrides!r}: wrap it in a list"
        )
    for item in overrides or []:
        if not isinstance(item, str):
            raise InputError(f"override {item!r} is a {type(item).__name__}; give key.path=value strings")
        if "=" not in item:
            raise InputError(f"override {item!r} must look like key.path=value")
        key, raw = item.split("=", 1)
        try:
            value = parse_yaml(raw)
        except yaml.YAMLError as exc:
            raise InputError(
                f"override {item!r}: the value is not valid YAML ({yaml_problem(exc)}); quote it or fix the syntax"
            ) from None
        overridden[_apply_override(data, key.strip(), value)] = item
    try:
        return from_dict(Recipe, data, "")
    except ConfigError as exc:
        if exc.source is not None:
            raise
        # an error at or below a key an override set names the override, not the recipe file
        culprit = next(
            (
                item
                for path, item in reversed(overridden.items())
                if exc.path == path or exc.path.startswith((f"{path}.", f"{path}["))
            ),
            None,
        )
        if culprit is not None:
            raise ConfigError(exc.path, exc.detail, source=f"override {culprit!r}") from None
        # a section's own check (its __post_init__) failed where an override set one of its keys: both may be the cause
        inside = [item for path, item in overridden.items() if path.startswith((f"{exc.path}.", f"{exc.path}["))]
        if inside:
            given = ", ".join(repr(item) for item in inside)
            where = f"{label} with override {given}" if label != "<dict>" else f"override {given}"
            raise ConfigError(exc.path, exc.detail, source=where) from None
        if label != "<dict>":
            raise ConfigError(exc.path, exc.detail, source=label) from None
        raise


RECIPES_DIR = Path(__file__).resolve().parent / "recipes"


def resolve_recipe_path(source: str | os.PathLike) -> Path:
    """A recipe file: a path, else a name (``world_eval``, ``bench/pruning``) under ``./configs`` or
    among the recipes shipped in the package (``mmfast list recipes``).

    A ``configs/...`` path that does not exist here (the README's commands, run from an installed wheel
    rather than a checkout, where ``configs`` links to the package's recipes) is the shipped recipe of
    that name."""
    path = Path(source)
    if path.is_file():
        return path
    if not path.exists() and len(path.parts) > 1 and path.parts[0] == "configs":
        name = Path(*path.parts[1:])
        shipped = RECIPES_DIR / (name if name.suffix in (".yaml", ".yml") else name.with_name(f"{name.name}.yaml"))
        if shipped.is_file():
            logger.info(
                "%s is not in %s; using the shipped recipe %s",
                source,
                Path.cwd(),
                shipped.relative_to(RECIPES_DIR).with_suffix(""),
            )
            return shipped
    for root in (Path.cwd() / "configs", RECIPES_DIR):
        for cand in (root / str(source), root / f"{source}.yaml"):
            if cand.is_file():
                return cand
    raise InputError(
        f"recipe {str(source)!r} not found: give a path to a YAML file, or the name of a shipped recipe "
        f"(`mmfast list recipes`: {', '.join(shipped_recipes()) or 'none'})"
    )


def shipped_recipes() -> list[str]:
    """Names of the recipes shipped in the package (relative paths without ``.yaml``)."""
    return sorted(str(p.relative_to(RECIPES_DIR).with_suffix("")) for p in RECIPES_DIR.rglob("*.yaml"))
