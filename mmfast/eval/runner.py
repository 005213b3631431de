"""``mmfast eval``: run a recipe's evaluation tasks, crash-safe and resumable.

Per-sample records are appended to ``samples.jsonl`` as each batch finishes; rerunning the same
command skips finished samples and retries failed ones. A sample whose image is missing or corrupt
(or whose generation raises) is recorded with its error, never as an empty answer; the run aborts
once failures exceed ``eval.max_failures`` of the planned samples. ``summary.json`` holds the
metrics by task (``metrics.<task>.*``: ``metrics.pope.<split>.*``, ``metrics.pope.mean_f1``,
``metrics.chair.*``), token accounting and the full protocol (model, recipe + hash, prompts,
decoding, parser, file checksums, seeds, package versions). Tasks come from the registry
(:data:`mmfast.registry.TASKS`); the runner knows none of them by name.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from tqdm import tqdm

from .. import compat
from ..config import Recipe
from ..errors import InputError, MMFastError
from .data import cache_root, resolve_data
from .records import RecordStore
from .tasks import Sample, Task, build_tasks

logger = logging.getLogger(__name__)


class RunAbortedError(MMFastError):
    """Too many samples failed."""


def output_dir(recipe: Recipe, output: str | None) -> Path:
    return Path(output or recipe.output.dir.format(name=recipe.name))


def weights_fingerprint(model) -> str:
    """A cheap content fingerprint of a model's weights: every tensor's name, shape, dtype and first
    values (tensors offloaded to ``meta`` count by name and shape only). Retrained or swapped weights
    under the same path change it, so a resumed run never mixes answers of two models."""
    import hashlib

    import torch

    h = hashlib.sha256()
    with torch.no_grad():
        for name, t in model.state_dict().items():
            h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
            if t.device.type != "meta" and t.numel():
                h.update(t.detach().flatten()[:64].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def _guard(out: Path, recipe: Recipe, fingerprint: str) -> None:
    """Refuse to mix results of different recipes, or of different weights, in one directory
    (unless output.overwrite, which starts over)."""
    run_file = out / "run.json"
    if run_file.exists():
        old = json.loads(run_file.read_text())
        problem = None
        if old.get("recipe_hash") != recipe.hash():
            problem = f"results of another recipe (hash {old.get('recipe_hash')} != {recipe.hash()})"
        elif old.get("weights_fingerprint", fingerprint) != fingerprint:
            problem = f"results of other model weights (fingerprint {old.get('weights_fingerprint')} != {fingerprint})"
        if problem:
            if not recipe.output.overwrite:
                raise InputError(f"{out} holds {problem}; use another --output, or set output.overwrite: true to start over")
            logger.warning("%s holds %s; output.overwrite is set: starting over", out, problem)
            shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    if not run_file.exists():
        run_file.write_text(json.dumps(
            {"recipe_hash": recipe.hash(), "weights_fingerprint": fingerprint, "recipe": recipe.to_dict()}, indent=1))


def _shard_device(device: str, rank: int, world: int) -> str:
    """In a data-parallel run each process takes its own GPU (``cuda`` -> ``cuda:<local rank>``)."""
    import torch

    if world > 1 and torch.cuda.is_available() and device in ("auto", "cuda"):
        return f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}"
    return device


def git_sha() -> str | None:
    try:
        here = Path(__file__).resolve().parent
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def check_plan(plan: list[tuple[Task, list[Sample]]]) -> None:
    """Refuse a plan whose samples collide: a ``doc_id`` planned twice, or one record group used by two
    tasks, would mix answers on resume or in scoring."""
    doc_owner: dict[str, str] = {}
    group_owner: dict[str, str] = {}
    for task, samples in plan:
        for s in samples:
            if s.doc_id in doc_owner:
                raise InputError(
                    f"doc_id {s.doc_id!r} is planned twice (by evaluation tasks {doc_owner[s.doc_id]!r} and {task.name!r}); "
                    "each sample needs its own doc_id, prefixed with its task's name"
                )
            doc_owner[s.doc_id] = task.name
            if group_owner.setdefault(s.task, task.name) != task.name:
                raise InputError(
                    f"evaluation tasks {group_owner[s.task]!r} and {task.name!r} both use record group {s.task!r}; "
                    "prefix each task's record groups (Sample.task) with its name"
                )


def side_files(tasks: list[Task]) -> dict[str, str]:
    """Every task's side files (e.g. CHAIR's sampled image ids), written next to the records: file name -> text."""
    files: dict[str, str] = {}
    owner: dict[str, str] = {}
    for task in tasks:
        for fname, text in task.side_files().items():
            if Path(fname).name != fname or fname in ("run.json", "summary.json") or fname.startswith("samples."):
                raise InputError(f"evaluation task {task.name!r}: side file {fname!r} must be a plain file name, not one of the run's own files")
            if owner.setdefault(fname, task.name) != task.name:
                raise InputError(f"evaluation tasks {owner[fname]!r} and {task.name!r} both write side file {fname!r}")
            files[fname] = text
    return files


def _record(sample: Sample, result, text_filter: Callable[[str, Sample], str]) -> dict[str, Any]:
    return {
        "doc_id": sample.doc_id,
        "task": sample.task,
        "target": sample.target,
        "resps": [[result.text]],
        "filtered_resps": [text_filter(result.text, sample)],
        "image": sample.image.name,
        "prompt": sample.prompt,
        "meta": sample.meta,
        **{k: v for k, v in result.to_dict().items() if k != "text"},
    }


def _error_record(sample: Sample, exc: BaseException) -> dict[str, Any]:
    return {
        "doc_id": sample.doc_id,
        "task": sample.task,
        "target": sample.target,
        "image": sample.image.name,
        "prompt": sample.prompt,
        "meta": sample.meta,
        "error": f"{type(exc).__name__}: {exc}",
    }


def _run_batch(session, samples: list[Sample], text_filter) -> list[dict[str, Any]]:
    """Generate for a batch; on failure, isolate the failing samples one by one."""
    try:
        batch = session.mm.prepare([s.image for s in samples], [s.prompt for s in samples], meta=[s.meta for s in samples])
        results = session.run(batch, max_new_tokens=samples[0].max_new_tokens)
        return [_record(s, r, text_filter) for s, r in zip(samples, results)]
    except Exception as exc:
        if len(samples) > 1:
            return [rec for s in samples for rec in _run_batch(session, [s], text_filter)]
        if not isinstance(exc, MMFastError):
            logger.warning("sample %s failed:\n%s", samples[0].doc_id, traceback.format_exc())
        return [_error_record(samples[0], exc)]


def run_eval(
    recipe: Recipe,
    *,
    limit: int | None = None,
    output: str | None = None,
    num_processes: int = 1,
    mm=None,
) -> dict[str, Any]:
    """Run every task of ``recipe.eval``; returns (and writes) the summary."""
    cfg = recipe.eval
    if not cfg.tasks:
        raise InputError("the recipe has no eval.tasks (add e.g. tasks: [pope, chair])")
    if num_processes > 1:
        from .distributed import launch_data_parallel

        return launch_data_parallel(recipe, limit=limit, output=output, num_processes=num_processes)
    limit = limit or cfg.limit
    out = output_dir(recipe, output)
    from .distributed import shard_info

    rank, world = shard_info()
    data = resolve_data(cfg, cfg.tasks)  # every input checked before anything is written
    tasks = build_tasks(cfg, data, cache_dir=cache_root())
    plan = [(task, task.samples(limit)) for task in tasks]
    check_plan(plan)
    extra_files = side_files(tasks)
    if mm is None:
        from ..model import load_model

        mm = load_model(recipe.model, device=_shard_device(recipe.model.device, rank, world))
    fingerprint = weights_fingerprint(mm.model)
    if rank == 0:
        _guard(out, recipe, fingerprint)
    n_total = sum(len(s) for _, s in plan)
    if rank == 0:
        for fname, text in extra_files.items():
            (out / fname).write_text(text)
    store = RecordStore(out / ("samples.jsonl" if world == 1 else f"samples.rank{rank}.jsonl"))
    from ..pipeline import apply

    t0 = time.perf_counter()
    failures = 0
    with apply(mm, recipe) as session:
        for task, samples in plan:
            mine = [s for i, s in enumerate(samples) if i % world == rank]
            todo = [s for s in mine if not store.done(s.doc_id)]
            if len(todo) < len(mine):
                logger.info("%s: %d of %d samples already done (resuming)", task.name, len(mine) - len(todo), len(mine))
            bar = tqdm(total=len(todo), desc=f"{task.name}", disable=None if todo else True)  # None: only on a TTY
            for i in range(0, len(todo), cfg.batch_size):
                chunk = todo[i : i + cfg.batch_size]
                records = _run_batch(session, chunk, task.filter_response)
                store.append(records)
                failures = len([r for r in store.failed() if r["doc_id"] in {s.doc_id for _, ss in plan for s in ss}])
                bar.update(len(chunk))
                if failures > max(2, cfg.max_failures * n_total):
                    errs = "; ".join(f"{r['doc_id']}: {r['error']}" for r in store.failed()[:3])
                    raise RunAbortedError(
                        f"{failures} of {n_total} samples failed (threshold eval.max_failures={cfg.max_failures}); "
                        f"first errors: {errs}. Finished samples are saved in {store.path}; fix the cause and rerun."
                    )
            bar.close()
    elapsed = time.perf_counter() - t0
    if world > 1:
        from .distributed import gather_and_finish

        return gather_and_finish(recipe, out, plan, mm, elapsed)
    return finish(recipe, out, plan, store, mm, elapsed)


def finish(recipe: Recipe, out: Path, plan, store: RecordStore, mm, elapsed: float) -> dict[str, Any]:
    """Score the planned samples and write ``summary.json``."""
    planned = {s.doc_id for _, ss in plan for s in ss}
    ok = [r for r in store.successful() if r["doc_id"] in planned]
    failed = [r for r in store.failed() if r["doc_id"] in planned]
    by_task: dict[str, list[dict[str, Any]]] = {}
    for r in ok:
        by_task.setdefault(r["task"], []).append(r)
    metrics = {}
    for task, samples in plan:
        groups = dict.fromkeys(s.task for s in samples)
        scored = task.metrics({g: by_task[g] for g in groups if g in by_task})
        if scored:
            metrics[task.name] = scored
    summary = {
        "metrics": metrics,
        "counts": {"planned": len(planned), "finished": len(ok), "failed": len(failed)},
        "accounting": _accounting(ok),
        "protocol": protocol(recipe, mm, plan),
        "elapsed_s": round(elapsed, 2),
        "failures": [{"doc_id": r["doc_id"], "error": r["error"]} for r in failed[:50]],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    logger.info("wrote %s", out / "summary.json")
    return summary


def _accounting(records: list[dict[str, Any]]) -> dict[str, float]:
    if not records:
        return {}
    keys = ("n_vision_tokens", "vision_tokens_layer_avg", "kv_bytes_prefill", "kv_bytes_end", "n_new_tokens")
    out = {f"mean_{k}": sum(r[k] for r in records) / len(records) for k in keys if all(k in r for r in records)}
    return {k: round(v, 3) for k, v in out.items()}


def protocol(recipe: Recipe, mm, plan) -> dict[str, Any]:
    m = recipe.model
    return {
        "model": m.name,
        "weights_fingerprint": weights_fingerprint(mm.model),
        "dtype": str(mm.dtype).removeprefix("torch."),
        "attn_implementation": m.attn_implementation,
        "recipe_name": recipe.name,
        "recipe_hash": recipe.hash(),
        "recipe": recipe.to_dict(),
        "decoding": recipe.decoding._to_recipe(),
        "pruning": [s._to_recipe() for s in recipe.pruning],
        "speculative": recipe.speculative._to_recipe() if recipe.speculative else None,
        "batch_size": recipe.eval.batch_size,
        "tasks": {task.name: task.protocol() for task, _ in plan},
        "dataset": recipe.eval.data.dataset,
        "world_seed": recipe.eval.data.world_seed if recipe.eval.data.dataset == "world" else None,
        "versions": compat.versions(),
        "git_sha": git_sha(),
    }
