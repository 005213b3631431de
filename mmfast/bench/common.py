"""Shared benchmark machinery: variants of one recipe, run in one process on the same inputs.

A benchmark recipe holds the baseline in its normal sections and the methods to compare in
``bench.compare``: each item is ``{name, pruning?, decoding?, speculative?}`` replacing those sections.
Accuracy comes from the evaluation runner (one resumable run directory per variant, identical
samples); speed from a separate timing pass over a fixed subset of the same samples (warm-up, then the
median of ``repeats``), always reported as ratios to the baseline measured in the same process.
"""

from __future__ import annotations

import difflib
import json
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config import Recipe, load_recipe
from ..errors import ConfigError, InputError, SamplesFailedError
from ..eval.data import resolve_data
from ..eval.runner import run_eval
from ..eval.tasks import build_tasks

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Variant:
    name: str
    recipe: Recipe


def budget_items(recipe: Recipe) -> list[dict]:
    """``bench.methods`` x ``bench.budgets`` as compare items ``{method}-{label}`` (in method order, then
    budget order): an entry N is ``budget: {tokens: N}`` (label ``N``), a mapping is that budget (label
    ``Budget.label``, e.g. ``r0.3333`` for ``{ratio: 0.3333}``)."""
    if bool(recipe.bench.methods) != bool(recipe.bench.budgets):
        missing = "bench.budgets" if recipe.bench.methods else "bench.methods"
        raise ConfigError(missing, "bench.methods and bench.budgets go together; set both (or neither)")
    items = []
    for j, entry in enumerate(recipe.bench.methods):
        if isinstance(entry, str):
            entry = {"method": entry}
        if not isinstance(entry, dict) or "method" not in entry or set(entry) - {"method", "params"}:
            raise ConfigError(f"bench.methods[{j}]", "expected a method name or {method: NAME, params: {...}}")
        for b in recipe.bench.budgets:
            budget, label = ({"tokens": b}, str(b)) if isinstance(b, int) else (b._to_recipe(), b.label)
            stage = {"method": entry["method"], "params": dict(entry.get("params") or {}), "budget": budget}
            items.append({"name": f"{entry['method']}-{label}", "pruning": [stage], "_origin": f"bench.methods[{j}]"})
    return items


def variants(recipe: Recipe, include_baseline: bool = True) -> list[Variant]:
    """The baseline (the recipe itself), every ``bench.compare`` item, then every ``bench.methods`` x
    ``bench.budgets`` variant (:func:`budget_items`), validated up front."""
    base = recipe.to_dict()
    # the baseline drops the bench section too, so editing the compare list keeps its results resumable
    out = [Variant("baseline", load_recipe(dict(base, bench={})))] if include_baseline else []
    names = {"baseline"}
    for i, item in enumerate([*recipe.bench.compare, *budget_items(recipe)]):
        where = item.pop("_origin", None) if isinstance(item, dict) else None
        where = where or f"bench.compare[{i}]"
        if not isinstance(item, dict) or "name" not in item:
            raise ConfigError(f"bench.compare[{i}]", "expected a mapping with a name and the sections to replace")
        unknown = set(item) - {"name", "pruning", "decoding", "speculative", "eval"}
        if unknown:
            raise ConfigError(
                f"{where}.{sorted(unknown)[0]}", "unknown key; allowed: name, pruning, decoding, speculative, eval"
            )
        if not isinstance(item["name"], str) or not item["name"]:
            raise ConfigError(f"{where}.name", f"expected the variant's name as a string, got {item['name']!r}")
        if item["name"] in names:
            raise ConfigError(f"{where}.name", f"duplicate variant name {item['name']!r}")
        names.add(item["name"])
        data = dict(base, name=f"{recipe.name}-{item['name']}")
        data["bench"] = {}
        for key in ("pruning", "decoding", "speculative"):
            if key in item:
                data[key] = item[key]
        if "eval" in item:
            data["eval"] = _merge(base["eval"], item["eval"])
        try:
            out.append(Variant(item["name"], load_recipe(data)))
        except ConfigError as exc:
            raise ConfigError(f"{where}.{exc.path}", exc.detail) from None
    shaped = recipe.bench.params.get("shaped_variants")
    for j, name in enumerate(shaped or ()):
        if name not in names:
            hint = difflib.get_close_matches(name, sorted(names), n=1)
            raise ConfigError(
                f"bench.params.shaped_variants[{j}]",
                f"no variant named {name!r}"
                + (f"; did you mean {hint[0]!r}?" if hint else f"; known: {', '.join(sorted(names))}"),
            )
    return out


def row_recipe(recipe: Recipe) -> dict:
    """A variant's recipe as a stored row's settings record it: ``model.fuse_norms`` (added after rows were
    committed) only when on, so rows stored before it keep their settings and resume."""
    data = recipe.to_dict()
    if not recipe.model.fuse_norms:
        data["model"].pop("fuse_norms", None)
    return data


def only_variants(recipe: Recipe, names: list[str]) -> Recipe:
    """The recipe with ``bench.compare`` cut down to ``names`` (in the recipe's order)."""
    generated = budget_items(recipe)
    known = [item.get("name") for item in [*recipe.bench.compare, *generated] if isinstance(item, dict)]
    if not names:
        raise InputError(f"--only names no variant; give one or more of: {', '.join(known)}")
    for n in names:
        if n not in known:
            hint = difflib.get_close_matches(n, known, n=1)
            raise ConfigError(
                "bench.compare",
                f"no variant named {n!r}"
                + (f"; did you mean {hint[0]!r}?" if hint else f"; known: {', '.join(known)}"),
            )
    data = recipe.to_dict()
    keep = [
        item for item in [*recipe.bench.compare, *generated] if isinstance(item, dict) and item.get("name") in names
    ]
    for item in keep:
        item.pop("_origin", None)
    params = dict(data["bench"].get("params") or {})
    if "shaped_variants" in params:  # the timing subset follows the cut
        params["shaped_variants"] = [n for n in params["shaped_variants"] if n in names]
    data["bench"] = dict(data["bench"], compare=keep, methods=[], budgets=[], params=params)
    return load_recipe(data)


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def check_same_samples(vs: list[Variant], limit: int | None) -> None:
    """Refuse a variant whose ``eval`` override plans other inputs than the baseline's (another ``limit``, task,
    seed, prompt, data...): a bench compares its variants on identical samples. ``eval`` overrides that keep
    the inputs (``batch_size``, ``max_failures``, generation lengths) pass; ``limit`` is ``--limit``."""

    def inputs(v: Variant) -> list[tuple]:
        cfg = v.recipe.eval
        n = limit if limit is not None else cfg.limit
        tasks = build_tasks(cfg, resolve_data(cfg, cfg.tasks))
        return [(s.task, s.doc_id, str(s.image), str(s.video), s.prompt) for t in tasks for s in t.samples(n)]

    base = vs[0]
    planned = None
    for v in vs[1:]:
        if v.recipe.eval == base.recipe.eval:
            continue
        planned = inputs(base) if planned is None else planned
        mine = inputs(v)
        if mine != planned:
            first = next((a for a, b in zip(mine, planned) if a != b), None)
            raise InputError(
                f"bench variant {v.name!r}: its eval override plans other inputs than the baseline's ({len(mine)} samples vs {len(planned)}"
                + (f"; first differing: {first[1]!r}" if first else "")
                + "), and a bench compares its variants on identical samples; remove the override (only inputs-neutral "
                "keys such as batch_size or max_new_tokens may differ), or run it as its own recipe"
            )


def evaluate_variant(v: Variant, out: Path, limit: int | None, mm) -> dict[str, Any]:
    """``mmfast eval`` of variant ``v`` into ``out/variants/<name>``; its summary. A bench compares its
    variants on identical samples, so a variant with a failed or missing sample stops the bench (exit 3)
    instead of entering the tables and ratios on fewer samples; rerunning the command retries those samples
    and reuses everything finished."""
    where = out / "variants" / v.name
    summary = run_eval(v.recipe, limit=limit, output=str(where), mm=mm)
    counts = summary["counts"]
    if counts["failed"] or counts["not_run"]:
        shown = "; ".join(f"{f['doc_id']}: {f['error']}" for f in summary.get("failures", [])[:3])
        raise SamplesFailedError(
            f"bench variant {v.name!r}: {counts['failed']} of {counts['planned']} samples failed and "
            f"{counts['not_run']} have no answer{f' ({shown})' if shown else ''}; the bench compares variants on "
            f"identical samples, so it stops here. All failures are listed in {where / 'summary.json'}; fix the "
            "cause and rerun the same command (finished samples and variants are kept)"
        )
    return summary


def timing_samples_of(recipe: Recipe, n: int, tasks: tuple[str, ...] | None = None) -> list:
    """A fixed subset of the evaluation's samples (in task order) for timing passes."""
    import dataclasses

    from ..eval.data import resolve_data
    from ..eval.tasks import build_tasks

    cfg = recipe.eval if tasks is None else dataclasses.replace(recipe.eval, tasks=tasks)
    data = resolve_data(cfg, cfg.tasks)
    return [s for task in build_tasks(cfg, data) for s in task.samples(n)][:n]


def warm_repeats(fn: Callable[[], Any], warmup: int, repeats: int) -> list[tuple[float, Any]]:
    """``(wall seconds, result)`` of ``repeats`` calls of ``fn()`` after ``warmup`` untimed ones (CUDA
    synchronised): what every timing of a bench takes its median of."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        result = fn()
        sync()
        out.append((time.perf_counter() - t0, result))
    return out


def median_time(fn: Callable[[], Any], warmup: int, repeats: int) -> float:
    """Median wall time of ``fn()`` after ``warmup`` untimed calls (CUDA synchronised)."""
    return statistics.median(t for t, _ in warm_repeats(fn, warmup, repeats))


def peak_rss_reset() -> bool:
    """Reset the process's peak-RSS counter (Linux: /proc/self/clear_refs = 5)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def write_markdown(
    path: Path,
    title: str,
    command: str,
    header: list[str],
    rows: list[list[Any]],
    notes: list[str],
    model: dict | None = None,
) -> None:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 1000 else f"{v:.3g}"
        return "" if v is None else str(v)

    lines = [f"# {title}", "", f"Command: `{command}`", ""]
    if model:
        lines[-1:] = ["", f"Model: `{model['name']}` (weights fingerprint `{model['weights_fingerprint']}`)", ""]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "---|" * len(header))
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    if notes:
        lines += [""] + [f"- {n}" for n in notes]
    path.write_text("\n".join(lines) + "\n")


def dump(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, default=str))


BENCH_MARKER = "bench.json"
"""Written first into a bench's output directory: marks it as mmfast's, so a rerun may write into it."""


def _is_legacy_bench_dir(out: Path) -> bool:
    """A bench directory written before :data:`BENCH_MARKER`: its ``summary.json`` is a bench summary
    (``model`` with a weights fingerprint, ``results``), or it holds only evaluation runs in ``variants/``."""
    try:
        summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
        if isinstance(summary, dict) and "results" in summary and "weights_fingerprint" in (summary.get("model") or {}):
            return True
    except (OSError, ValueError):
        pass
    names = {p.name for p in out.iterdir()}
    variants_dir = out / "variants"
    return (
        names == {"variants"}
        and variants_dir.is_dir()
        and all((v / "run.json").is_file() for v in variants_dir.iterdir())
    )


def claim_bench_dir(out: Path, kind: str, recipe_name: str) -> None:
    """Create ``out`` for a bench, or accept it when it is empty or mmfast's bench directory; refuse a
    folder of someone else's files (a bench writes ``results.md``, ``summary.json``, plots there and
    would overwrite them), as ``mmfast eval`` does. Then write :data:`BENCH_MARKER`."""
    if out.is_dir() and any(out.iterdir()) and not (out / BENCH_MARKER).is_file() and not _is_legacy_bench_dir(out):
        foreign = sorted(p.name for p in out.iterdir())
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise InputError(
            f"output directory {out} is not empty ({shown}) and is not an mmfast bench directory (no {BENCH_MARKER}); "
            "a bench writes results.md, summary.json and plots there and would overwrite files of the same names: "
            "use another --output (or an empty directory)"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / BENCH_MARKER).write_text(json.dumps({"kind": kind, "recipe": recipe_name}) + "\n")
    except OSError as exc:
        raise InputError(
            f"cannot write the bench directory {out}: {exc.strerror or exc}; choose another --output"
        ) from None
