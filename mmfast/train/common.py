"""Shared training plumbing: seeding, schedules, and resumable checkpoints without pickle.

Checkpoints are a directory with ``tensors.safetensors`` (model and optimizer tensors) and
``meta.json`` (step, optimizer hyper-parameters, RNG seeds, anything JSON). Writing goes through a
temporary directory renamed into place, so a killed run never leaves a half-written checkpoint.
A checkpoint records its run's config; resuming it under another config is refused
(:func:`check_resume_config`), and so is reusing a work directory's cached data under other data
settings (:func:`bind_work_data`) or other model weights (:func:`bind_work_dir`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import random
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from ..errors import InputError, MMFastError
from ..eval.fingerprint import weights_fingerprint

logger = logging.getLogger(__name__)


def bind_work_dir(work: Path, model: torch.nn.Module) -> None:
    """Tie a work directory (cached features, generated data, checkpoints) to the weights that made it.

    Caches are reused on rerun, which is what makes training resumable; reusing them after the model
    was retrained would silently train on stale data, so a fingerprint mismatch is refused."""
    fp = weights_fingerprint(model)
    stamp = work / "model_fingerprint.json"
    if stamp.exists():
        old = json.loads(stamp.read_text()).get("weights_fingerprint")
        if old != fp:
            raise RuntimeError(
                f"{work} holds data made from other model weights (fingerprint {old} != {fp}); "
                "pass a fresh --work directory or delete this one"
            )
    else:
        stamp.write_text(json.dumps({"weights_fingerprint": fp}))


#: Config fields that do not change what a run computes (a resume may change them).
RESUMABLE_FIELDS = frozenset({"threads", "workers", "checkpoint_every"})


def _changes(old: dict[str, Any], new: dict[str, Any], ignore: frozenset[str] = frozenset()) -> str:
    """The fields (besides ``ignore``) whose values differ, as ``key: old -> new, ...`` ("" when none)."""
    keys = sorted(k for k in set(old) | set(new) if k not in ignore and old.get(k, "<unset>") != new.get(k, "<unset>"))
    return ", ".join(f"{k}: {old.get(k, '<unset>')!r} -> {new.get(k, '<unset>')!r}" for k in keys)


def check_resume_config(ckpt: Path, meta: dict[str, Any], config: dict[str, Any]) -> None:
    """Refuse to resume checkpoint ``ckpt`` (its ``meta``) with another ``config`` (``asdict(cfg)``).

    Only :data:`RESUMABLE_FIELDS` may differ: any other change (seed, steps, lr, data sizes, ...) would
    silently mix two runs."""
    old = meta.get("config")
    if old is None:
        raise InputError(f"{ckpt} records no training config, so a resume cannot be checked; delete it to start over")
    changes = _changes(old, config, RESUMABLE_FIELDS)
    if changes:
        raise InputError(
            f"{ckpt} was written by a run with another config ({changes}); rerun with the same arguments to "
            "resume, or pass a fresh --work directory (or delete the checkpoint) to start over"
        )


def bind_work_data(work: Path, data_config: dict[str, Any], name: str) -> None:
    """Tie the data a work directory caches (rendered-image features, generated answers) to the config
    fields that make it (seed, sizes, prompt mix): caches are keyed by count only, so reusing them under
    another seed would silently train on other images than the run's annotations describe. ``name``: the
    stamp file, one per trainer."""
    stamp = work / name
    if not stamp.exists():
        stamp.write_text(json.dumps(data_config, indent=1))
        return
    changes = _changes(json.loads(stamp.read_text()), data_config)
    if changes:
        raise InputError(
            f"{work} caches data made with another config ({changes}, recorded in {stamp}); rerun with the same "
            "arguments or pass a fresh --work directory"
        )


def require_positive(cfg: Any, *names: str) -> None:
    """Raise ``ValueError`` naming the first of the config fields ``names`` that is not > 0."""
    for name in names:
        value = getattr(cfg, name)
        if not value > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {value!r}")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def describe_device(device: str | torch.device) -> str:
    """What a finished phase records as the device it ran on: ``cpu``, or the GPU's name."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return str(device)


def cosine_lr(step: int, total: int, base: float, warmup: int = 50, floor: float = 0.05) -> float:
    """Linear warmup then cosine decay to ``floor * base``."""
    if step < warmup:
        return base * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return base * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def _flatten_optimizer(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    sd = opt.state_dict()
    tensors, scalars = {}, {}
    for pid, state in sd["state"].items():
        for key, val in state.items():
            if isinstance(val, torch.Tensor):
                tensors[f"optim.{pid}.{key}"] = val.contiguous()
            else:
                scalars[f"{pid}.{key}"] = val
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _unflatten_optimizer(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    state: dict[int, dict[str, Any]] = {}
    for name, val in tensors.items():
        if name.startswith("optim."):
            _, pid, key = name.split(".", 2)
            state.setdefault(int(pid), {})[key] = val
    for name, val in meta["scalars"].items():
        pid, key = name.split(".", 1)
        state.setdefault(int(pid), {})[key] = val
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def save_checkpoint(
    path: str | os.PathLike,
    modules: dict[str, torch.nn.Module],
    opt: torch.optim.Optimizer | None,
    meta: dict[str, Any],
) -> None:
    """Atomically write modules' weights, the optimizer and ``meta`` to directory ``path``."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    tensors = {
        f"{prefix}.{k}": v.detach().contiguous() for prefix, m in modules.items() for k, v in m.state_dict().items()
    }
    full_meta = dict(meta)
    if opt is not None:
        otensors, ometa = _flatten_optimizer(opt)
        tensors.update(otensors)
        full_meta["optimizer"] = ometa
    save_file({k: v.cpu() for k, v in tensors.items()}, str(tmp / "tensors.safetensors"))
    (tmp / "meta.json").write_text(json.dumps(full_meta, indent=1))
    if path.exists():
        shutil.rmtree(path)
    tmp.rename(path)


def load_checkpoint(
    path: str | os.PathLike, modules: dict[str, torch.nn.Module], opt: torch.optim.Optimizer | None = None
) -> dict[str, Any]:
    """Restore what :func:`save_checkpoint` wrote; returns ``meta``."""
    path = Path(path)
    tensors = load_file(str(path / "tensors.safetensors"))
    meta = json.loads((path / "meta.json").read_text())
    for prefix, m in modules.items():
        sd = {k[len(prefix) + 1 :]: v for k, v in tensors.items() if k.startswith(prefix + ".")}
        m.load_state_dict(sd)
    if opt is not None and "optimizer" in meta:
        _unflatten_optimizer(opt, tensors, meta["optimizer"])
    return meta


# -- the training scripts' command line -----------------------------------------------------------------
def add_config_args(parser: argparse.ArgumentParser, config_cls: type) -> None:
    """One ``--field-name`` option per field of the dataclass ``config_cls``, defaulting to the field's default (a
    bool field takes 0 / 1: argparse would read any non-empty text, "0" too, as true)."""
    for f in dataclasses.fields(config_cls):
        kind = int if f.type == "bool" else type(f.default)
        parser.add_argument("--" + f.name.replace("_", "-"), type=kind, default=f.default)


def config_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace, config_cls: type) -> Any:
    """``config_cls`` from the options :func:`add_config_args` added; a value the config refuses (its
    ``__post_init__``) is a usage error (exit 2, naming the option)."""
    try:
        return config_cls(
            **{
                f.name: bool(getattr(args, f.name)) if f.type == "bool" else getattr(args, f.name)
                for f in dataclasses.fields(config_cls)
            }
        )
    except ValueError as exc:  # a config value out of range
        parser.error(str(exc))


def run_or_exit_2(name: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``; a user error (a missing model, a work directory of another run, ...) is logged by
    ``name``'s logger and exits 2, without a traceback."""
    try:
        return fn(*args, **kwargs)
    except MMFastError as exc:
        logging.getLogger(name).error("%s", exc)
        sys.exit(2)
