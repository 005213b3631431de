"""``mmfast bench`` for anti-hallucination decoders: POPE + CHAIR per decoder, cost per token, memory.

Every decoder runs the recipe's evaluation on the same samples (one protocol per recipe: greedy-family
or sampling-family, with the matching baseline first). A timing pass on a fixed subset measures the
decode time per generated token (first token excluded, so one-off costs such as VHR's head selection
are reported separately) relative to the baseline, and the process's peak RSS while each variant
generates (Linux ``VmHWM``, reset per variant).
"""

from __future__ import annotations

import json
import logging
import statistics
from pathlib import Path
from typing import Any

from ..model import MMModel
from ..pipeline import apply
from .common import Variant, dump, evaluate_variant, peak_rss_bytes, peak_rss_reset, timing_samples_of, variants
from .render import decoding_plots, write_results

logger = logging.getLogger(__name__)


def cost_per_token(
    mm: MMModel, v: Variant, samples, new_tokens: int, repeats: int, warmup: int = 1
) -> dict[str, float]:
    """Decode seconds per generated token after the first, and the first-token (prefill) time, over ``repeats``
    passes after ``warmup`` untimed short runs (``bench.warmup``)."""
    peak_rss_reset()
    with apply(mm, v.recipe) as session:
        batches = [mm.prepare([s.image], [s.prompt]) for s in samples]
        for _ in range(warmup):
            session.run(batches[0], max_new_tokens=2)
        per_tok, first = [], []
        for _ in range(repeats):
            for b in batches:
                r = session.run(b, max_new_tokens=new_tokens)[0]
                # tokens decoded after the first: an answer cut at max_new_tokens has n - 1; one that ended on a stop
                # token also decoded that token (stripped from token_ids), so n
                n = len(r.token_ids)
                steps = n if n < new_tokens else n - 1
                if steps > 0:
                    per_tok.append(r.timings.decode_s / steps)
                first.append(r.timings.prefill_s)
    return {  # medians (of an even count, the mean of the middle two)
        "decode_s_per_token": statistics.median(per_tok) if per_tok else float("nan"),
        "first_token_s": statistics.median(first),
        "peak_rss_bytes": peak_rss_bytes(),
    }


def run_decoding_bench(recipe, mm: MMModel, out: Path, limit: int | None) -> dict[str, Any]:
    cfg = recipe.bench
    vs = variants(recipe)
    samples = timing_samples_of(recipe, cfg.n_samples, tasks=("chair",))
    new_tokens = int(cfg.params.get("cost_new_tokens", 48))
    results = {}
    for i, v in enumerate(vs, 1):
        logger.info("bench variant %d/%d %s: evaluation, then cost per token", i, len(vs), v.name)
        summary = evaluate_variant(v, out, limit, mm)
        results[v.name] = {
            "decoding": v.recipe.decoding._to_recipe(),
            "metrics": summary["metrics"],
            "cost": cost_per_token(mm, v, samples, new_tokens, cfg.repeats, cfg.warmup),
            "protocol": summary["protocol"]["tasks"],
        }
    base = results["baseline"]
    rows = []
    for name, r in results.items():
        pope, chair, cost = r["metrics"].get("pope", {}), r["metrics"].get("chair", {}), r["cost"]
        r["ratios"] = {
            "cost_per_token": cost["decode_s_per_token"] / base["cost"]["decode_s_per_token"],
            "pope_mean_f1_delta": (pope.get("mean_f1", 0) - base["metrics"].get("pope", {}).get("mean_f1", 0))
            if pope
            else None,
            "chair_i_delta": (chair.get("chair_i", 0) - base["metrics"].get("chair", {}).get("chair_i", 0))
            if chair
            else None,
        }
        rows.append(
            [
                name,
                r["decoding"]["method"],
                *(pope.get(s, {}).get("f1") for s in ("random", "popular", "adversarial")),
                pope.get("mean_f1"),
                chair.get("chair_s"),
                chair.get("chair_i"),
                chair.get("recall"),
                chair.get("len"),
                r["ratios"]["cost_per_token"],
                (cost["peak_rss_bytes"] or 0) / 2**20,
            ]
        )
    header = [
        "variant",
        "decoder",
        "POPE F1 rand",
        "pop",
        "adv",
        "mean F1",
        "CHAIR_s",
        "CHAIR_i",
        "recall",
        "len",
        "cost/token x",
        "peak RSS MiB",
    ]
    return {"header": header, "rows": rows, "results": results}


def preset_notes(result: dict[str, Any]) -> str:
    """Which preset each OPERA / beam variant ran (``exact`` unless the recipe says ``release``)."""
    parts = []
    for name, r in result["results"].items():
        dec = r["decoding"]
        if dec.get("method") in ("opera", "beam"):
            parts.append(f"{name} ({dec['method']}) {(dec.get('params') or {}).get('preset', 'exact')}")
    return ", ".join(parts)


def write_decoding_report(result: dict[str, Any], out: Path, command: str) -> None:
    base = result["results"]["baseline"]
    proto = base["protocol"]
    notes = [
        "All decoders ran in one process on the same samples; the baseline row is this protocol's own baseline.",
        f"POPE: prompt {json.dumps(proto.get('pope', {}).get('prompt'))}, parser {proto.get('pope', {}).get('parser')}, "
        f"max_new_tokens {proto.get('pope', {}).get('max_new_tokens')}.",
        f"CHAIR: prompt {json.dumps(proto.get('chair', {}).get('prompt'))}, max_new_tokens {proto.get('chair', {}).get('max_new_tokens')}, "
        f"{proto.get('chair', {}).get('n_images')} images ({proto.get('chair', {}).get('sampling')}, seed {proto.get('chair', {}).get('seed')}).",
        "cost/token x: median decode seconds per generated token after the first, relative to the baseline.",
        "peak RSS: the process's peak resident memory while the variant generated (VmHWM reset per variant; the model's weights included).",
    ]
    presets = preset_notes(result)
    if presets:
        notes.append(
            "Beam-search presets (exact: fp32 log-space penalty and transformers 5's scorer; release: the OPERA "
            "release's fp16 score and transformers 4.29.2's scorer, prompt + generated length): " + presets + "."
        )
    intervals = write_results(
        result, out, "decoding", "Anti-hallucination decoders on the embedded world", command, notes
    )
    decoding_plots(result, out, out.name, intervals)
    dump(out / "summary.json", result)
