"""``mmfast bench`` for vision-token pruning: accuracy, token accounting and speed vs the unpruned model.

Two parts, one process:

1. **The embedded world model**: every variant runs the recipe's evaluation (POPE splits + CHAIR) on
   the same samples; reported with vision tokens at the LLM input, the layer-averaged equivalent
   count, KV bytes, analytical FLOPs (model at hand and the LLaVA-1.5-7B projection) and, from a timing
   pass on a fixed subset, prefill and end-to-end latency ratios and the methods' scoring overhead.
2. **A LLaVA-1.5-shaped random model** (``bench.shape``: the real CLIP-L/336 tower and a few Llama
   layers at width 4096) where, as in the real model, the LLM dominates prefill: measured prefill
   speedup next to the FLOPs ratio of the same schedule.
"""

from __future__ import annotations

import logging
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..errors import MMFastError
from ..eval.runner import evaluation_calibration
from ..model import MMModel
from ..pipeline import apply
from ..pruning._budget import CalibrationSet
from .common import (
    Variant,
    dump,
    evaluate_variant,
    median_time,
    timing_samples_of,
    variants,
    warm_repeats,
    write_markdown,
)
from .render import (
    budget_leaders,
    budget_text,
    has_budgets,
    pruning_plots,
    slice_label,
    timing_labels,
    timing_protocol_note,
    with_budget_column,
    with_slice_speedup,
    write_results,
)

logger = logging.getLogger(__name__)


def time_variant(
    mm: MMModel, v: Variant, samples, warmup: int, repeats: int, new_tokens: int, calibration=None
) -> dict[str, float]:
    """Median prefill (1 new token) and end-to-end (``new_tokens``) latency summed over ``samples``
    (token budgets calibrated on ``calibration``, the evaluation's own set), and the median scoring time of the
    same timed prefill calls (warm-ups excluded, as from the times)."""
    with apply(mm, v.recipe, calibration=calibration) as session:
        batches = [mm.prepare([s.image], [s.prompt]) for s in samples]

        def prefill() -> float:  # the call's scoring seconds, summed over the samples
            return sum(session.run(b, max_new_tokens=1)[0].stats.get("scoring_s", 0.0) for b in batches)

        def e2e():
            for b in batches:
                session.run(b, max_new_tokens=new_tokens)

        timed = warm_repeats(prefill, warmup, repeats)
        t_e2e = median_time(e2e, warmup, repeats)
    t_prefill = statistics.median(t for t, _ in timed)
    return {"prefill_s": t_prefill, "e2e_s": t_e2e, "scoring_s": statistics.median(s for _, s in timed)}


def run_pruning_bench(recipe, mm: MMModel, out: Path, limit: int | None) -> dict[str, Any]:
    cfg = recipe.bench
    vs = variants(recipe)
    rows, results = [], {}
    timing_samples = timing_samples_of(recipe, cfg.n_samples)
    new_tokens = int(cfg.params.get("e2e_new_tokens", 32))
    for i, v in enumerate(vs, 1):
        logger.info("bench variant %d/%d %s: evaluation", i, len(vs), v.name)
        summary = evaluate_variant(v, out, limit, mm)
        logger.info(
            "bench variant %d/%d %s: timing (%d samples x %d repeats)",
            i,
            len(vs),
            v.name,
            len(timing_samples),
            cfg.repeats,
        )
        calibration = evaluation_calibration(v.recipe, limit) if any(st.budget for st in v.recipe.pruning) else None
        timing = time_variant(mm, v, timing_samples, cfg.warmup, cfg.repeats, new_tokens, calibration)
        results[v.name] = {
            "metrics": summary["metrics"],
            "accounting": _accounting(summary),
            "timing": timing,
            "pruning": [st._to_recipe() for st in v.recipe.pruning],
        }
    base = results["baseline"]
    for name, r in results.items():
        acc, t, m = r["accounting"], r["timing"], r["metrics"]
        pope = m.get("pope", {})
        chair = m.get("chair", {})
        r["ratios"] = {
            "prefill_speedup": base["timing"]["prefill_s"] / t["prefill_s"],
            "e2e_speedup": base["timing"]["e2e_s"] / t["e2e_s"],
            "flops_ratio": acc["flops_prefill"] / base["accounting"]["flops_prefill"],
            "flops_ratio_7b": acc["flops_prefill_7b"] / base["accounting"]["flops_prefill_7b"],
            "kv_ratio_prefill": acc["kv_bytes_prefill"] / base["accounting"]["kv_bytes_prefill"],
            "scoring_overhead": t["scoring_s"] / base["timing"]["prefill_s"],
            "pope_f1_retained": (pope.get("mean_f1", 0) / base["metrics"]["pope"]["mean_f1"])
            if pope and base["metrics"].get("pope")
            else None,
        }
        rows.append(
            [
                name,
                round(acc["n_vision_tokens"], 1),
                round(acc["vision_tokens_layer_avg"], 1),
                *(pope.get(s, {}).get("f1") for s in ("random", "popular", "adversarial")),
                pope.get("mean_f1"),
                chair.get("chair_s"),
                chair.get("chair_i"),
                r["ratios"]["prefill_speedup"],
                r["ratios"]["e2e_speedup"],
                r["ratios"]["flops_ratio"],
                r["ratios"]["flops_ratio_7b"],
                r["ratios"]["kv_ratio_prefill"],
                r["ratios"]["scoring_overhead"],
            ]
        )
    header = [
        "variant",
        "vision tok @LLM",
        "layer-avg tok",
        "POPE F1 rand",
        "pop",
        "adv",
        "mean F1",
        "CHAIR_s",
        "CHAIR_i",
        "prefill x",
        "e2e x",
        "FLOPs ratio",
        "FLOPs ratio 7B",
        "KV ratio",
        "scoring ovh",
    ]
    speed = _shaped_speed(recipe, vs, mm.device) if cfg.shape else None
    return {
        "header": header,
        "rows": rows,
        "results": results,
        "shaped_speed": speed,
        "timing_protocol": {"warmup": cfg.warmup, "repeats": cfg.repeats, "samples": len(timing_samples)},
    }


def _accounting(summary: dict[str, Any]) -> dict[str, float]:
    """Means over the samples the variant's evaluation scored (its summary's ``accounting``: the
    planned samples of this run only, never records a run with another ``--limit`` left in the folder)."""
    keys = (
        "n_vision_tokens",
        "vision_tokens_layer_avg",
        "kv_bytes_prefill",
        "kv_bytes_end",
        "flops_prefill",
        "flops_prefill_7b",
    )
    acc = summary["accounting"]
    return {k: acc[f"mean_{k}"] for k in keys}


@torch.inference_mode()
def _shaped_speed(recipe, vs: list[Variant], device: torch.device) -> dict[str, Any]:
    """LLM prefill speed on a LLaVA-1.5- or Qwen2.5-VL-shaped random model, same inputs for every variant.

    Variants a family refuses (IncompatibleRecipeError at apply) are listed as skipped with the reason.
    Trained parts (HICom's guide and global branch, Dynamic-LLaVA's predictors) are swapped for seeded
    random ones of the slice's sizes (``random_shape_params``), and calibrated budgets (MustDrop, ZipVL)
    are calibrated on the timed inputs themselves, so each timed prefill runs at its budget.

    The measured time is the LLM prefill (``timings.prefill_s``: what the FLOPs ratio counts) and,
    separately, the vision tower + feature stages (``vision_s``); medians over ``bench.repeats``.
    """
    import numpy as np
    from PIL import Image

    from ..model import MMModel
    from ..models.factory import QWEN_SHAPES, SHAPES, random_llava, random_qwen_vl

    cfg = recipe.bench
    logger.info("bench phase: prefill timing on the %s random-weight model (building it)", cfg.shape)
    if cfg.shape not in SHAPES and cfg.shape in QWEN_SHAPES:  # Qwen2.5-VL shapes: the shape's image size
        model, processor = random_qwen_vl("qwen2_5_vl", cfg.shape, init_std=0.02)
        height, width = QWEN_SHAPES[cfg.shape].bench_image
    else:
        model, processor = random_llava(cfg.shape, dtype=torch.float32)
        height = width = model.config.vision_config.image_size
    mm = MMModel(model.to(device), processor, cfg.shape)  # where the benchmarked model runs
    rng = np.random.default_rng(0)
    n = int(cfg.params.get("shaped_samples", 2))
    images = [Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)) for _ in range(n)]
    prompt = "Is there a dog in the image?\nAnswer the question using a single word or phrase."
    batches = [mm.prepare([im], [prompt]) for im in images]
    timed = tempfile.TemporaryDirectory(prefix="mmfast-shaped-")
    paths = []
    for i, im in enumerate(images):
        paths.append(str(Path(timed.name) / f"timed{i}.png"))
        im.save(paths[-1])
    calibration = CalibrationSet(tuple(paths), (prompt,) * n)
    wanted = set(cfg.params.get("shaped_variants", [v.name for v in vs]))
    out: dict[str, Any] = {
        "shape": cfg.shape,
        "rows": [],
        "skipped": [],
        "warmup": cfg.warmup,
        "repeats": cfg.repeats,
        "samples": n,
    }
    base = None
    for v in vs:
        if v.name != "baseline" and v.name not in wanted:
            continue
        logger.info("bench phase: %s prefill timing of %s", cfg.shape, v.name)
        try:
            session_cm = apply(mm, _untrained(v.recipe), calibration=calibration)
        except MMFastError as exc:  # e.g. a layer schedule the shallow slice cannot hold
            logger.warning("shaped speed: %s skipped: %s", v.name, exc)
            out["skipped"].append({"variant": v.name, "reason": str(exc)})
            continue
        with session_cm as session:  # warmup and repeats as the embedded model's timing (common.warm_repeats)
            runs = [
                rs
                for _, rs in warm_repeats(
                    lambda: [session.run(b, max_new_tokens=1)[0] for b in batches], cfg.warmup, cfg.repeats
                )
            ]
        prefill = float(np.median([sum(r.timings.prefill_s for r in rs) for rs in runs]))
        vision = float(np.median([sum(r.timings.vision_s for r in rs) for rs in runs]))
        flops = sum(r.flops_prefill for r in runs[0])
        row = {
            "variant": v.name,
            "vision_tokens": sum(r.n_vision_tokens for r in runs[0]) / n,
            "layer_avg_tokens": sum(r.vision_tokens_layer_avg for r in runs[0]) / n,
            "prefill_s": prefill,
            "vision_s": vision,
            "flops": flops,
        }
        if base is None:
            base = row
        row["speedup"] = base["prefill_s"] / prefill
        row["e2e_speedup"] = (base["prefill_s"] + base["vision_s"]) / (prefill + vision)
        row["flops_ratio"] = flops / base["flops"]
        out["rows"].append(row)
    del model, mm
    timed.cleanup()
    return out


def _untrained(recipe):
    """``recipe`` with every pruning stage's trained parts swapped for seeded random ones
    (``random_shape_params``): what a random-weight model shape can run."""
    from ..config import load_recipe
    from ..registry import PRUNERS

    data = recipe.to_dict()
    for stage in data["pruning"]:
        stand_in = PRUNERS.get(stage["method"]).cls.random_shape_params()
        if stand_in:
            stage["params"] = {**(stage.get("params") or {}), **stand_in}
    return load_recipe(data)


def hicom_modes(result: dict[str, Any]) -> str:
    """Which global-branch mode each HICom variant ran (``coarse`` unless the recipe says ``direct``)."""
    parts = []
    for name, r in result.get("results", {}).items():
        for st in r.get("pruning", []):
            if st.get("method") == "hicom":
                params = st.get("params") or {}
                mode = "none (local only)" if params.get("global_queries") == 0 else params.get("global_mode", "coarse")
                parts.append(f"{name} {mode}")
    return ", ".join(parts)


def _command_timing(command: str) -> dict[str, int]:
    """``bench.warmup`` / ``bench.repeats`` set on a recorded command line (``--set bench.repeats=1``):
    what a bench that predates ``timing_protocol`` ran with, where its command says so."""
    import re

    return {k: int(v) for k, v in re.findall(r"--set bench\.(warmup|repeats)=(\d+)", command)}


def write_pruning_report(result: dict[str, Any], out: Path, command: str) -> None:
    notes = [
        "All variants ran in one process on the same samples; ratios are against the baseline row.",
        "FLOPs: 4nd^2 + 2n^2d + 3ndm per LLM layer (the papers' convention); 7B = the same token schedule on LLaVA-1.5-7B's shape.",
        "layer-avg tok: vision tokens averaged over LLM layers (the papers' 'equivalent tokens').",
    ]
    modes = hicom_modes(result)
    if modes:
        notes.append(
            "hicom global branch: " + modes + " (coarse: the paper's FiLM-modulated learned queries; "
            "direct: the release's, queries = the projected instruction; see docs/methods.md)."
        )
    with_slice_speedup(result)
    speed = result.get("shaped_speed")
    model = (result.get("model") or {}).get("name", "the embedded model")
    overrides = _command_timing(command)
    if len(overrides) == 2:  # recorded before warmup/repeats were: the command line says what ran
        result.setdefault("timing_protocol", dict(overrides))
        if speed:
            speed.setdefault("warmup", overrides["warmup"])
            speed.setdefault("repeats", overrides["repeats"])
    if speed:
        notes.append(
            f"Which model each column comes from: the accuracy columns (POPE, CHAIR), token counts, FLOPs, KV and the "
            f"[embedded] timings come from the embedded model ({model}, LLaVA architecture); {slice_label(speed['shape'])} "
            f"is the LLM prefill speedup on the {speed['shape']} (random weights, the same schedule; the same figure as "
            "speed_shaped.md), empty where the slice skipped the variant."
        )
        notes.append(timing_protocol_note(f"{speed['shape']} timings", speed.get("warmup"), speed.get("repeats")))
    tp = result.get("timing_protocol") or {}
    notes.append(
        timing_protocol_note(
            "Timings on the embedded model" + (" ([embedded])" if speed else ""), tp.get("warmup"), tp.get("repeats")
        )
    )
    if has_budgets(result):
        notes.append("Per budget, the best variant and its margins over VisionZip and random drop: leaders.md.")
    with_budget_column(result)
    notes.append(
        "budget: what the variant's recipe asked for, per image (tokens N: N kept; ratio r: round(r N_i) of an image's "
        "N_i); vision tok @LLM / layer-avg tok: what it kept (layer-averaged for in-LLM methods)."
    )
    intervals = write_results(
        result, out, "pruning", "Vision-token pruning on the embedded world", command, notes, timing_labels(result)
    )
    if has_budgets(result):
        write_markdown(
            out / "leaders.md",
            "Best pruning method per token budget",
            command,
            *budget_leaders(out, result),
            model=result.get("model"),
        )
    speed = result.get("shaped_speed")
    if speed:
        res = result["results"]
        rows = [
            [
                r["variant"],
                budget_text((res.get(r["variant"]) or {}).get("pruning")),
                r["vision_tokens"],
                r["layer_avg_tokens"],
                r["prefill_s"],
                r["vision_s"],
                r["speedup"],
                r["e2e_speedup"],
                r["flops_ratio"],
                1 / r["flops_ratio"],
                r["speedup"] * r["flops_ratio"],
            ]
            for r in speed["rows"]
        ]
        write_markdown(
            out / "speed_shaped.md",
            f"Prefill speed on a random-weight model of real shape ({speed['shape']})",
            command,
            [
                "variant",
                "budget",
                "vision tok @LLM",
                "layer-avg tok",
                "LLM prefill s",
                "vision s",
                slice_label(speed["shape"]),
                "prefill+vision speedup",
                "FLOPs ratio",
                "ideal speedup",
                "measured / ideal",
            ],
            rows,
            [
                timing_protocol_note("Timings", speed.get("warmup"), speed.get("repeats")),
                f"{slice_label(speed['shape'])}: the LLM prefill speedup (baseline's LLM prefill s / the variant's); the same "
                "figure as results.md's column of that name.",
                "LLM prefill = the language model's prefill forward (what the FLOPs ratio counts); vision = tower + feature stages.",
                "measured / ideal = LLM prefill speedup x FLOPs ratio (1.0 = every FLOP saved is time saved).",
                "Random weights: token selections are not meaningful here, only their cost. Trained parts run on seeded "
                "random stand-ins of the same sizes (random_shape_params: HICom's global branch, and a 2-layer guide "
                "text tower in place of CLIP-L's; Dynamic-LLaVA's predictors). Token budgets of threshold methods (MustDrop, "
                "ZipVL) are calibrated on the timed sample, so their layer average is the budget here too; fixed "
                "thresholds (a preset, a tau) keep another count on random weights than on the embedded model.",
            ]
            + [f"skipped {r['variant']}: {r['reason']}" for r in speed.get("skipped", [])],
        )
    pruning_plots(result, out, out.name, intervals)
    dump(out / "summary.json", result)
