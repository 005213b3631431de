"""Rendering a benchmark's results: n and 95% intervals beside its accuracy and CHAIR columns, its
plots (each titled with the benchmark it belongs to, each with a legend). The bench runners
(:mod:`.pruning`, :mod:`.decoding`, :mod:`.speculative`) import this module, never the reverse;
re-rendering a finished bench directory is :func:`mmfast.bench.rerender.rerender_bench`.

Nothing here imports torch: the report uses it on any machine.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import InputError
from ..eval.intervals import RunIntervals, current_intervals, read_records, run_intervals
from ..eval.unparsed import UNPARSED_LIMIT, TaskUnparsed, Unparsed, count_unparsed
from .plots import bars, labelled_points, scatter_lines

logger = logging.getLogger(__name__)

INTERVAL_NOTE = (
    "95% CI: POPE mean F1 by a percentile bootstrap resampling images jointly across splits (one draw per image for all "
    "its questions in every split; 10000 resamples, seed 0), CHAIR_i by a percentile bootstrap over captions; Wilson of "
    "the pooled counts where every replicate is equal; n = POPE questions over all splits / CHAIR captions "
    "(mmfast.eval.intervals)."
)


INTERVAL_NOTE_PREFIX = "intervals of "
"""Starts every note about one variant's intervals (missing, or recorded by an older method)."""


def fmt_ci(ci: list[float] | tuple[float, float] | None) -> str:
    """``[lo, hi]`` with three decimals, or empty when there is no interval."""
    return "" if not ci else f"[{ci[0]:.3f}, {ci[1]:.3f}]"


def bench_kind(summary: dict[str, Any]) -> str:
    """``pruning``, ``decoding`` or ``speculative`` (recorded since intervals; inferred before)."""
    if summary.get("kind"):
        return str(summary["kind"])
    if "shaped_speed" in summary or any("accounting" in r for r in summary.get("results", {}).values()):
        return "pruning"
    if any("cost" in r for r in summary.get("results", {}).values()):
        return "decoding"
    if "shaped" in summary or "identical to greedy" in summary.get("header", []):
        return "speculative"
    raise InputError("summary.json is not from `mmfast bench` (no pruning, decoding or speculative results)")


def variant_intervals(bench_dir: Path, results: dict[str, Any]) -> dict[str, RunIntervals]:
    """Every variant's POPE / CHAIR intervals: from its recorded metrics, else from the records under
    ``variants/<name>/`` (see :func:`mmfast.eval.intervals.run_intervals`)."""
    out: dict[str, RunIntervals] = {}
    for name, r in results.items():
        metrics = r.get("metrics")
        if not isinstance(metrics, dict):
            continue
        stored = r.get("intervals")
        if (
            isinstance(stored, dict)
            and (current_intervals(stored.get("pope")) or not metrics.get("pope"))
            and (current_intervals(stored.get("chair")) or not metrics.get("chair"))
        ):
            out[name] = RunIntervals(stored.get("pope"), stored.get("chair"), tuple(stored.get("notes", ())))
            continue
        run = Path(bench_dir) / "variants" / name
        summary_path = run / "summary.json"
        if summary_path.is_file():
            summary = json.loads(summary_path.read_text())
            summary["metrics"] = metrics  # the bench's record of what it reported is the reference
        else:
            summary = {"metrics": metrics}
        out[name] = run_intervals(run, summary)
    return out


@dataclass(frozen=True)
class IntervalColumns:
    """Where the interval columns go: after ``after`` insert ``[95% CI]`` of ``metric`` and its n."""

    after: str
    task: str
    metric: str
    ci_header: str
    n_header: str


PRUNING_DECODING_COLUMNS = (
    IntervalColumns("mean F1", "pope", "mean_f1", "mean F1 [95% CI]", "n POPE"),
    IntervalColumns("CHAIR_i", "chair", "chair_i", "CHAIR_i [95% CI]", "n CHAIR"),
)


def with_intervals(
    header: list[str],
    rows: list[list[Any]],
    intervals: dict[str, RunIntervals],
    columns: tuple[IntervalColumns, ...] = PRUNING_DECODING_COLUMNS,
) -> tuple[list[str], list[list[Any]]]:
    """The table with a ``[95% CI]`` and an ``n`` column after each of ``columns`` (rows keyed by
    their first cell, the variant name); a table that already has them is returned unchanged."""
    header, rows = list(header), [list(r) for r in rows]
    for col in columns:
        if col.after not in header or col.ci_header in header:
            continue
        at = header.index(col.after) + 1
        header[at:at] = [col.ci_header, col.n_header]
        for row in rows:
            iv = intervals.get(row[0])
            part = getattr(iv, col.task, None) if iv else None
            row[at:at] = [fmt_ci(part.get(f"{col.metric}_ci95")) if part else "", part.get("n") if part else None]
    return header, rows


UNPARSED_COLUMNS = (("n POPE", "pope", "POPE unparsed"), ("n CHAIR", "chair", "CHAIR degenerate"))
VIDEO_UNPARSED_COLUMN = "video POPE unparsed"
"""The last column of a table where a variant ran ``video_pope`` (no bench table has its figures)."""
NOT_RANKED = "not ranked"
VIDEO_POPE_NOTE = (
    "video_pope (POPE over the video world's clips): no model shipped with mmfast saw video in training, so its "
    "figures from the embedded or random models measure exactness and cost, not accuracy, and are not a result."
)


def variant_unparsed(bench_dir: Path, results: dict[str, Any]) -> dict[str, Unparsed]:
    """Every variant's unparsed POPE answers and degenerate CHAIR captions, counted from its records
    under ``variants/<name>/`` (:func:`mmfast.eval.unparsed.count_unparsed`); where there are none, the
    counts stored by an earlier rendering (``results.<variant>.unparsed``), else nothing."""
    out: dict[str, Unparsed] = {}
    for name, r in results.items():
        if not isinstance(r.get("metrics"), dict):
            continue
        records = read_records(Path(bench_dir) / "variants" / name)
        if records:
            out[name] = count_unparsed(records)
        elif isinstance(r.get("unparsed"), dict):
            out[name] = Unparsed.from_dict(r["unparsed"])
    return out


def unparsed_cell(t: TaskUnparsed | None) -> str:
    """``k/n (p%)``, and "not ranked" over :data:`UNPARSED_LIMIT`; empty where the task did not run."""
    return "" if t is None else t.cell() + (f" {NOT_RANKED}" if t.over_limit else "")


def with_unparsed(
    header: list[str], rows: list[list[Any]], unparsed: dict[str, Unparsed]
) -> tuple[list[str], list[list[Any]]]:
    """The table with a ``POPE unparsed`` / ``CHAIR degenerate`` column (``k/n``) after each task's n
    column, and a last ``video POPE unparsed`` one where a variant ran ``video_pope``; a task over
    :data:`UNPARSED_LIMIT` is marked "not ranked" in its cell. Idempotent."""
    header, rows = list(header), [list(r) for r in rows]
    for after, task, title in UNPARSED_COLUMNS:
        if after not in header or title in header:
            continue
        at = header.index(after) + 1
        header.insert(at, title)
        for row in rows:
            row.insert(at, unparsed_cell(getattr(unparsed.get(row[0]), task, None)))
    if VIDEO_UNPARSED_COLUMN not in header and any(u.video_pope for u in unparsed.values()):
        header.append(VIDEO_UNPARSED_COLUMN)
        for row in rows:
            row.append(unparsed_cell(getattr(unparsed.get(row[0]), "video_pope", None)))
    return header, rows


def unparsed_notes(unparsed: dict[str, Unparsed]) -> list[str]:
    notes = [
        f"POPE unparsed: answers the official POPE rule reads as neither yes nor no (it scores them 'yes' by default); "
        f"CHAIR degenerate: empty captions, captions without words or caught in a repetition loop (mmfast.eval.unparsed). "
        f"Over {UNPARSED_LIMIT:.0%} in a task: that task's figures are marked and not ranked."
    ]
    if any(u.video_pope for u in unparsed.values()):
        notes.append(f"video POPE unparsed: the same rule over the video_pope answers. {VIDEO_POPE_NOTE}")
    return notes + [
        f"{name}: {why}; those figures are not ranked" for name, u in unparsed.items() for why in u.reasons()
    ]


def store_unparsed(results: dict[str, Any], unparsed: dict[str, Unparsed]) -> None:
    """Keep every variant's counts in its result (``results.<variant>.unparsed`` in summary.json)."""
    for name, u in unparsed.items():
        results[name]["unparsed"] = u.as_dict()


def store_intervals(results: dict[str, Any], intervals: dict[str, RunIntervals]) -> None:
    """Keep every variant's intervals in its result (``results.<variant>.intervals`` in summary.json)."""
    for name, iv in intervals.items():
        results[name]["intervals"] = {"pope": iv.pope, "chair": iv.chair, "notes": list(iv.notes)}


def interval_notes(intervals: dict[str, RunIntervals]) -> list[str]:
    missing = [f"{name}: {n}" for name, iv in intervals.items() for n in iv.notes]
    return [INTERVAL_NOTE] + [f"{INTERVAL_NOTE_PREFIX}{m}" for m in missing]


def write_results(
    result: dict[str, Any],
    out: Path,
    kind: str,
    title: str,
    command: str,
    notes: list[str],
    labels: dict[str, str] | None = None,
) -> dict[str, RunIntervals]:
    """A bench's ``results.md`` with n and 95% intervals from its variant records (also stored in
    ``result``), its columns shown under ``labels`` (e.g. which model a timing comes from; the stored
    header keeps its names); returns the intervals for the plots."""
    from .common import write_markdown

    result["kind"] = kind
    intervals = variant_intervals(out, result["results"])
    store_intervals(result["results"], intervals)
    unparsed = variant_unparsed(out, result["results"])
    store_unparsed(result["results"], unparsed)
    header, rows = with_unparsed(*with_intervals(result["header"], result["rows"], intervals), unparsed)
    header = [(labels or {}).get(h, h) for h in header]
    write_markdown(
        out / "results.md",
        title,
        command,
        header,
        rows,
        notes + interval_notes(intervals) + unparsed_notes(unparsed),
        model=result.get("model"),
    )
    return intervals


SLICE_COLUMN = "prefill x 7B slice"
RELIABLE_REPEATS = 5
"""A timing is the median of at least this many repeats after a warmup; fewer is flagged."""


def timing_labels(result: dict[str, Any]) -> dict[str, str]:
    """Column labels that name the model each timing comes from: ``[embedded]`` (the model the
    accuracy columns come from) and ``[<slice shape>]`` (the random-weight slice, as speed_shaped.md)."""
    speed = result.get("shaped_speed")
    if not speed:
        return {}
    return {
        "prefill x": "prefill x [embedded]",
        "e2e x": "e2e x [embedded]",
        "scoring ovh": "scoring ovh [embedded]",
        SLICE_COLUMN: slice_label(speed["shape"]),
    }


def slice_label(shape: str) -> str:
    return f"prefill x [{shape}]"


def timing_protocol_note(what: str, warmup: int | None, repeats: int | None) -> str:
    """How a timing was taken, flagged when it is not the median of >= RELIABLE_REPEATS warm repeats."""
    if warmup is None or repeats is None:
        return f"{what}: warmup and repeats not recorded (see the command); not known to be the median of {RELIABLE_REPEATS} warm repeats."
    text = f"{what}: median of {repeats} repeat(s) after {warmup} warmup run(s)"
    if repeats < RELIABLE_REPEATS or warmup < 1:
        return (
            text
            + f"; NOT a reliable speed (fewer than {RELIABLE_REPEATS} warm repeats: a cold run can be off by 2x); re-run before quoting it."
        )
    return text + "."


def with_slice_speedup(result: dict[str, Any]) -> None:
    """Put each variant's LLM prefill speedup on the real-shape slice (``shaped_speed``) into the main
    table, after ``prefill x``; empty for variants the slice skipped. Idempotent."""
    speed = result.get("shaped_speed")
    header = result["header"]
    if not speed or SLICE_COLUMN in header or "prefill x" not in header:
        return
    by_name = {r["variant"]: r["speedup"] for r in speed["rows"]}
    at = header.index("prefill x") + 1
    header.insert(at, SLICE_COLUMN)
    for row in result["rows"]:
        row.insert(at, by_name.get(row[0]))


BUDGET_TOLERANCE = 0.05
"""A variant is compared at budget B when its layer-averaged vision tokens are within 5% of B."""


def _stage_budget(r: dict[str, Any], n_vision: float | None = None) -> tuple[str, int] | None:
    """(method, budget tokens) of a variant's budgeted pruning stage, from its recorded stages: its
    ``tokens``, or for ``ratio: r`` round(r x ``n_vision``) (the unpruned model's mean vision tokens per
    sample; the accuracy model's images all have one count, so this is what each image kept)."""
    for st in r.get("pruning") or []:
        budget = st.get("budget") or {}
        if budget.get("tokens") is not None:
            return str(st["method"]), int(budget["tokens"])
        if budget.get("ratio") is not None and n_vision:
            return str(st["method"]), max(1, round(float(budget["ratio"]) * n_vision))
    return None


def with_budget_column(result: dict[str, Any]) -> None:
    """Insert a "budget" column after "variant" (in place): the budget each variant's recipe asked for
    (:func:`budget_text` of its recorded stages), beside the vision tokens it kept; results recorded
    before the column get it on re-rendering."""
    header = result["header"]
    if "budget" in header or "variant" not in header:
        return
    at = header.index("variant") + 1
    header.insert(at, "budget")
    for row in result["rows"]:
        row.insert(at, budget_text((result["results"].get(row[0]) or {}).get("pruning")))


def _unpruned_vision_tokens(result: dict[str, Any]) -> float | None:
    """The baseline variant's mean vision tokens at the LLM input (None without a baseline)."""
    base = result["results"].get("baseline") or {}
    return (base.get("accounting") or {}).get("n_vision_tokens")


def budget_text(stages: list[dict[str, Any]] | None) -> str:
    """The budget a variant's recipe asked for, as written (``tokens 192``, ``ratio 0.3333``, ``flops
    0.2``; stages joined by ``+``), or "" without one: the tables' "budget" column beside the kept tokens."""
    parts = []
    for st in stages or []:
        for key, value in (st.get("budget") or {}).items():
            parts.append(f"{key} {value:g}" if isinstance(value, float) else f"{key} {value}")
    return " + ".join(parts)


LEADER_REFERENCES = ("visionzip", "random")
FULL_PREFILL_FLOPS = 0.99
"""A variant at this prefill FLOPs ratio or above removed no token from the LLM's computation (ZipVL keeps
every token and spends its budget on sparse attention and low-bit KV): it is not at the same budget as
the methods that drop tokens, so the leaders table lists it in a note instead of ranking it."""


def has_budgets(result: dict[str, Any], references: tuple[str, ...] = LEADER_REFERENCES) -> bool:
    """Whether a reference method ran at some budget (budgeted stages are recorded in
    ``results.<variant>.pruning``): the condition for a leaders table."""
    n_vision = _unpruned_vision_tokens(result)
    return any(
        (sb := _stage_budget(r, n_vision)) is not None and sb[0] in references for r in result["results"].values()
    )


def budget_leaders(
    out: Path, result: dict[str, Any], references: tuple[str, ...] = LEADER_REFERENCES
) -> tuple[list[str], list[list[Any]], list[str]]:
    """Per token budget: the variant with the best POPE mean F1 among those at that budget (declared
    ``budget.tokens`` B, layer-averaged tokens within 5% of B), and its margin over each reference
    method at the same budget as a paired-bootstrap 95% interval on the same questions
    (:func:`mmfast.eval.intervals.paired_mean_f1_difference`)."""
    from ..eval.intervals import paired_mean_f1_difference, paired_pope_cells

    res = result["results"]
    at: dict[int, list[tuple[str, str]]] = {}
    notes: list[str] = []
    records: dict[str, list[dict[str, Any]]] = {}

    def recs(name: str) -> list[dict[str, Any]]:
        if name not in records:
            records[name] = read_records(out / "variants" / name)
        return records[name]

    def pope_unparsed(name: str) -> Unparsed:
        if recs(name):
            return Unparsed(count_unparsed(recs(name)).pope, None)
        stored = res[name].get("unparsed")
        return Unparsed(Unparsed.from_dict(stored).pope, None) if isinstance(stored, dict) else Unparsed(None, None)

    n_vision = _unpruned_vision_tokens(result)
    for name, r in res.items():
        sb = _stage_budget(r, n_vision)
        if sb is None or not (r.get("metrics") or {}).get("pope"):
            continue
        method, b = sb
        why = pope_unparsed(name).reasons()
        if why:  # its POPE F1 is the parser's default, not the model's answers
            notes.append(f"{name} not ranked at budget {b}: " + "; ".join(why))
            continue
        flops = (r.get("ratios") or {}).get("flops_ratio")
        if flops is not None and flops >= FULL_PREFILL_FLOPS:  # ZipVL: a budget of important tokens, not of tokens
            notes.append(
                f"{name} not ranked at budget {b}: it computes every vision token in prefill and caches them all "
                f"(FLOPs ratio {flops:.2f}); its budget counts the tokens its sparse attention treats as important, "
                f"not tokens removed (POPE mean F1 {r['metrics']['pope']['mean_f1']:.3f})"
            )
            continue
        avg = r["accounting"]["vision_tokens_layer_avg"]
        if abs(avg - b) > BUDGET_TOLERANCE * b:
            notes.append(f"{name} left out of budget {b}: {avg:.1f} layer-averaged tokens is more than 5% away")
            continue
        at.setdefault(b, []).append((name, method))

    parsers: dict[str, str] = {}

    def parser(name: str) -> str:
        """The POPE parser the variant's summary was scored with (its ranked F1's)."""
        if name not in parsers:
            path = out / "variants" / name / "summary.json"
            summary = json.loads(path.read_text()) if path.is_file() else {}
            parsers[name] = summary.get("protocol", {}).get("tasks", {}).get("pope", {}).get("parser", "pope")
        return parsers[name]

    def margin(a: str, b: str) -> str:
        mode, other = parser(a), parser(b)
        if mode != other:
            return f"parsers differ ({mode} vs {other})"
        paired = paired_pope_cells(recs(a), recs(b), mode)
        if not paired.a:
            return "no paired records"
        d = paired_mean_f1_difference(paired.a, paired.b, paired.units)
        return f"{d.estimate:+.3f} [{d.lo:+.3f}, {d.hi:+.3f}]"

    header = ["budget", "best (POPE mean F1)", "mean F1 [95% CI]", "runner-up"] + [
        f"margin over {m} [paired 95% CI]" for m in references
    ]
    rows = []
    for b in sorted(at, reverse=True):
        ranked = sorted(at[b], key=lambda nm: -res[nm[0]]["metrics"]["pope"]["mean_f1"])
        best = ranked[0][0]
        pope = res[best]["metrics"]["pope"]
        ci = ((res[best].get("intervals") or {}).get("pope") or {}).get("mean_f1_ci95")
        runner = f"{ranked[1][0]} ({res[ranked[1][0]]['metrics']['pope']['mean_f1']:.3f})" if len(ranked) > 1 else ""
        row = [b, best, f"{pope['mean_f1']:.3f} {fmt_ci(ci)}".strip(), runner]
        for ref in references:
            ref_names = [n for n, m in at[b] if m == ref]
            row.append(
                "" if not ref_names else ("(is the best)" if ref_names[0] == best else margin(best, ref_names[0]))
            )
        rows.append(row)
    notes = [
        "Compared at each budget: variants whose budgeted stage declares budget.tokens = B (or budget.ratio = r, "
        "B = round(r x the unpruned model's vision tokens)) and whose layer-averaged vision tokens are within 5% of B.",
        "margin: the best variant's POPE mean F1 minus the reference's on the same questions; 95% CI by a paired "
        "percentile bootstrap (10000 resamples, seed 0; images resampled jointly across splits, the same draw for both).",
        f"Not ranked: a variant with more than {UNPARSED_LIMIT:.0%} of its POPE answers read as neither yes nor no by the "
        "official rule (its F1 is then the rule's default 'yes', not the model's answers).",
        f"Not ranked either: a variant at prefill FLOPs ratio {FULL_PREFILL_FLOPS} or more (it removes no token from "
        "the LLM's computation, so its token budget is not comparable).",
    ] + notes
    return header, rows, notes


def _ci(iv: RunIntervals | None, task: str, key: str) -> tuple[float, float] | None:
    part = getattr(iv, task, None) if iv else None
    ci = part.get(f"{key}_ci95") if part else None
    return (ci[0], ci[1]) if ci else None


def chair_recall_plot(
    path: Path, results: dict[str, Any], intervals: dict[str, RunIntervals], title: str
) -> Path | None:
    """CHAIR_i against CHAIR recall per variant: fewer hallucinations at the same recall is a better
    decoder; lower CHAIR_i with lower recall may only be shorter captions."""
    pts = []
    for name, r in results.items():
        chair = (r.get("metrics") or {}).get("chair") or {}
        if "chair_i" in chair and "recall" in chair:
            iv = intervals.get(name)
            pts.append(
                (name, chair["recall"], chair["chair_i"], _ci(iv, "chair", "recall"), _ci(iv, "chair", "chair_i"))
            )
    if not pts:
        return None
    return labelled_points(
        path, pts, "CHAIR recall (ground-truth objects mentioned)", "CHAIR_i (hallucinated mentions)", title
    )


def pruning_plots(
    result: dict[str, Any], out: Path, label: str, intervals: dict[str, RunIntervals], prefix: str = ""
) -> list[Path]:
    """The pruning bench's plots, titled with ``label`` (the bench they belong to)."""
    res = result["results"]
    base = res.get("baseline", {})
    made: list[Path | None] = []
    pts = [
        (n, r["accounting"]["vision_tokens_layer_avg"], r["metrics"].get("pope", {}).get("mean_f1"))
        for n, r in res.items()
        if n != "baseline"
    ]
    made.append(
        scatter_lines(
            out / f"{prefix}accuracy_vs_tokens.png",
            pts,
            "layer-averaged vision tokens",
            "POPE mean F1",
            f"POPE mean F1 vs vision tokens ({label})",
            base.get("metrics", {}).get("pope", {}).get("mean_f1"),
        )
    )
    pts = [
        (n, r["accounting"]["vision_tokens_layer_avg"], r["ratios"]["prefill_speedup"])
        for n, r in res.items()
        if n != "baseline" and r.get("ratios")
    ]
    made.append(
        scatter_lines(
            out / f"{prefix}speedup_vs_tokens.png",
            pts,
            "layer-averaged vision tokens",
            "prefill speedup (x)",
            f"Prefill speedup vs vision tokens ({label})",
            1.0,
        )
    )
    speed = result.get("shaped_speed")
    if speed:
        pts = [(r["variant"], r["vision_tokens"], r["speedup"]) for r in speed["rows"] if r["variant"] != "baseline"]
        made.append(
            scatter_lines(
                out / f"{prefix}speedup_vs_tokens_shaped.png",
                pts,
                "vision tokens at the LLM input",
                "prefill speedup (x)",
                f"Prefill speedup on {speed['shape']} ({label})",
                1.0,
            )
        )
    made.append(
        chair_recall_plot(out / f"{prefix}chair_i_vs_recall.png", res, intervals, f"CHAIR_i vs recall ({label})")
    )
    return [p for p in made if p is not None]


def decoding_plots(
    result: dict[str, Any], out: Path, label: str, intervals: dict[str, RunIntervals], prefix: str = ""
) -> list[Path]:
    """The decoding bench's plots, titled with ``label``."""
    res = result["results"]
    names = list(res)
    base_chair = res.get("baseline", {}).get("metrics", {}).get("chair", {}).get("chair_i")
    made = [
        bars(
            out / f"{prefix}chair_i.png",
            names,
            [res[n]["metrics"].get("chair", {}).get("chair_i", 0) for n in names],
            "CHAIR_i",
            f"CHAIR_i by decoder ({label})",
            intervals=[_ci(intervals.get(n), "chair", "chair_i") for n in names],
            baseline=base_chair,
            series="CHAIR_i (hallucinated mentions)",
        ),
        bars(
            out / f"{prefix}cost_per_token.png",
            names,
            [res[n]["ratios"]["cost_per_token"] for n in names],
            "x baseline",
            f"Cost per generated token ({label})",
            baseline=1.0,
            series="decode time per token / baseline's",
        ),
        chair_recall_plot(out / f"{prefix}chair_i_vs_recall.png", res, intervals, f"CHAIR_i vs recall ({label})"),
    ]
    return [p for p in made if p is not None]


def speculative_plots(result: dict[str, Any], out: Path, label: str, prefix: str = "") -> list[Path]:
    """The speculative bench's speedup plots (one per workload), titled with ``label``."""
    made = []
    for key, by in result["results"].items():
        names = [n for n in by if n != "baseline"]
        if names:
            made.append(
                bars(
                    out / f"{prefix}speedup_{key.replace('@', '_').replace('.', '')}.png",
                    names,
                    [by[n]["speedup"] for n in names],
                    "speedup (x)",
                    f"Wall-clock speedup, {key} ({label})",
                    baseline=1.0,
                    series="tokens/s vs plain decoding",
                )
            )
    return [p for p in made if p is not None]


def bench_plots(
    result: dict[str, Any], out: Path, label: str, intervals: dict[str, RunIntervals], prefix: str = ""
) -> list[Path]:
    kind = bench_kind(result)
    if kind == "pruning":
        return pruning_plots(result, out, label, intervals, prefix)
    if kind == "decoding":
        return decoding_plots(result, out, label, intervals, prefix)
    return speculative_plots(result, out, label, prefix)
