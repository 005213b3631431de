"""``mmfast report RUN_DIR...``: one markdown + HTML page, with PNG plots, from evaluation and
benchmark run directories (each holds a ``summary.json``).

Evaluation runs become one row each (method settings, token accounting, POPE, CHAIR with n and 95%
intervals, the weights fingerprint, so that results of two versions of a model are never read as one
table; a run of the ``video_pope`` task adds its rows to a table of its own: per split F1, accuracy,
precision, recall with 95% intervals, yes ratio, n and unparsed answers) and feed three plots: POPE mean F1 against vision tokens, CHAIR_i per run, and CHAIR_i against
recall (fewer hallucinations vs shorter captions). Benchmark directories contribute their result
tables (n and intervals beside POPE mean F1 and CHAIR_i), their protocol notes, their side tables
(``speed_shaped.md``, ``projected_7b.md``), their plots drawn again with titles naming the bench, and
a speedup-per-method plot from their ratios. Runs written before intervals existed get them from
their per-sample records (:func:`mmfast.eval.intervals.run_intervals`).
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from markdown_it import MarkdownIt

from .bench.plots import bars, labelled_points, plot_title, scatter_lines
from .bench.render import (
    INTERVAL_NOTE_PREFIX,
    VIDEO_POPE_NOTE,
    bench_kind,
    bench_plots,
    budget_text,
    fmt_ci,
    interval_notes,
    timing_labels,
    unparsed_cell,
    variant_intervals,
    variant_unparsed,
    with_intervals,
    with_unparsed,
)
from .errors import InputError
from .eval.intervals import RunIntervals, read_records, run_intervals
from .eval.unparsed import TaskUnparsed, count_pope_unparsed, count_unparsed

logger = logging.getLogger(__name__)


def _load(run: Path) -> dict[str, Any]:
    path = run / "summary.json"
    if not path.is_file():
        raise InputError(f"{run}: no summary.json (is it an `mmfast eval` or `mmfast bench` output directory?)")
    return _read_json(path)


def _read_json(path: Path) -> dict[str, Any]:
    """A run's JSON summary as a mapping; a damaged file is an InputError naming it."""
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(
            f"{path}: not valid JSON ({exc}); rerun the evaluation or remove the directory from the report"
        ) from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected a JSON object, got {type(data).__name__}; is this an mmfast summary?")
    return data


def _method_label(protocol: dict[str, Any]) -> str:
    parts = [  # a budgeted stage shows what it asked for beside its params (the row's token columns: what it kept)
        f"{p['method']}({_short(p.get('params', {}))})" + (f"[{budget_text([p])}]" if p.get("budget") else "")
        for p in protocol.get("pruning", [])
    ]
    dec = protocol.get("decoding", {})
    parts.append(f"{dec.get('method', 'greedy')}({_short(dec.get('params', {}))})")
    if protocol.get("speculative"):
        parts.append(f"spec:{protocol['speculative']['method']}")
    return " + ".join(parts)


def _short(params: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in list(params.items())[:3])


EVAL_HEADER = [
    "run",
    "methods",
    "vision tok",
    "layer-avg tok",
    "POPE F1 rand",
    "pop",
    "adv",
    "mean F1 [95% CI]",
    "n POPE",
    "POPE unparsed",
    "POPE files",
    "CHAIR_s [95% CI]",
    "CHAIR_i [95% CI]",
    "recall [95% CI]",
    "n CHAIR",
    "CHAIR degenerate",
    "weights",
]


EVAL_INTERVAL_NOTE = (
    "[95% CI]: POPE mean F1 by a percentile bootstrap resampling images jointly across splits (10000 resamples, seed 0); "
    "CHAIR_s by the Wilson score interval, CHAIR_i and recall by a percentile bootstrap over captions; Wilson of the pooled "
    "counts where every replicate is equal; n POPE = questions over all splits, n CHAIR = captions (mmfast.eval.intervals). "
    "POPE files: the question files a run answered (the same model scores differently on two versions): world "
    "files by version (`eval.pope.world_version`; runs that predate it used `v1`), others by their known "
    "release, else by the first 8 hex digits of each file's sha256. "
    "POPE unparsed / CHAIR degenerate: answers read as neither yes nor no by the official rule / empty, wordless or looping "
    "captions (mmfast.eval.unparsed); over 5% the cell says 'not ranked'."
)


VIDEO_POPE_HEADER = [
    "run",
    "split",
    "n",
    "F1 [95% CI]",
    "accuracy [95% CI]",
    "precision [95% CI]",
    "recall [95% CI]",
    "yes ratio",
    "unparsed",
]

VIDEO_POPE_REPORT_NOTE = (
    "Video POPE: the `video_pope` task (docs/video_world.md), scored by the official POPE rule; F1 and the means by a "
    "percentile bootstrap resampling clips jointly across splits, accuracy, precision and recall by the Wilson score "
    "interval; n = questions. unparsed: answers the official rule reads as neither yes nor no, per split, and on the "
    "mean row for the whole task, where over 5% the cell says 'not ranked'. " + VIDEO_POPE_NOTE
)


@dataclass(frozen=True)
class EvalRow:
    """One evaluation run: its figures (for the plots) and its table row (figures with 95% intervals)."""

    name: str
    tokens_layer_avg: float | None
    mean_f1: float | None
    chair_i: float | None
    recall: float | None
    intervals: RunIntervals
    cells: list[Any]
    video_pope: list[list[Any]]


def incomplete_note(label: str, counts: dict[str, Any]) -> str | None:
    """A note for a run whose figures cover fewer samples than it planned (failures accepted by
    ``eval.max_failures`` / ``--allow-failures``, or samples not run), else None: the table alone would read
    as a complete run."""
    failed, not_run = int(counts.get("failed") or 0), int(counts.get("not_run") or 0)
    if not failed and not not_run:
        return None
    parts = [f"{failed} failed"] * bool(failed) + [f"{not_run} not run"] * bool(not_run)
    return (
        f"**{label} is incomplete**: of its {counts.get('planned', '?')} planned samples {' and '.join(parts)}; its "
        f"figures cover the {counts.get('finished', '?')} finished ones (the failures are listed in its summary.json)"
    )


def _with_ci(value: Any, part: dict[str, Any] | None, key: str) -> str:
    if value is None:
        return ""
    ci = (part or {}).get(f"{key}_ci95")
    return f"{value:.3f} {fmt_ci(ci)}" if ci else f"{value:.3f}"


def run_labels(runs: list[Path]) -> list[str]:
    """A label per run that tells it apart from the others: its folder's name, or, where two runs share
    it, the shortest tail of their paths that differs (``cpu/bench``, ``gpu/bench``)."""
    parts = [run.resolve().parts for run in runs]
    labels = []
    for i, own in enumerate(parts):
        depth = 1
        while depth < len(own) and any(
            other[-depth:] == own[-depth:] for j, other in enumerate(parts) if j != i and other != own
        ):
            depth += 1
        labels.append("/".join(own[-depth:]))
    return labels


def _file_label(label: str) -> str:
    """A run's label as part of a file name."""
    return label.replace("/", "_")


def _eval_row(run: Path, label: str, s: dict[str, Any]) -> EvalRow:
    m, acc, proto = s.get("metrics", {}), s.get("accounting", {}), s.get("protocol", {})
    pope, chair = m.get("pope", {}), m.get("chair", {})
    iv = run_intervals(run, s)
    records = read_records(run)
    bad = count_unparsed(records)
    cells = [
        label,
        _method_label(proto),
        acc.get("mean_n_vision_tokens"),
        acc.get("mean_vision_tokens_layer_avg"),
        *(pope.get(k, {}).get("f1") for k in ("random", "popular", "adversarial")),
        _with_ci(pope.get("mean_f1"), iv.pope, "mean_f1"),
        (iv.pope or {}).get("n") or (sum(v.get("n", 0) for v in pope.values() if isinstance(v, dict)) or None),
        unparsed_cell(bad.pope),
        _pope_files(proto),
        _with_ci(chair.get("chair_s"), iv.chair, "chair_s"),
        _with_ci(chair.get("chair_i"), iv.chair, "chair_i"),
        _with_ci(chair.get("recall"), iv.chair, "recall"),
        chair.get("n"),
        unparsed_cell(bad.chair),
        proto.get("weights_fingerprint"),
    ]
    return EvalRow(
        label,
        acc.get("mean_vision_tokens_layer_avg"),
        pope.get("mean_f1"),
        chair.get("chair_i"),
        chair.get("recall"),
        iv,
        cells,
        _video_pope_rows(label, m.get("video_pope"), records, bad.video_pope),
    )


def _video_pope_rows(
    name: str, m: dict[str, Any] | None, records: list[dict[str, Any]], total: TaskUnparsed | None
) -> list[list[Any]]:
    """A run's ``video_pope`` rows: one per split and a mean row; unparsed answers counted from the
    records (else the count its summary recorded, on the mean row)."""
    if not isinstance(m, dict):
        return []
    if total is None and isinstance(m.get("unparsed"), dict):
        total = TaskUnparsed(int(m["unparsed"]["k"]), int(m["unparsed"]["n"]))
    rows = []
    for split, d in m.items():
        if not isinstance(d, dict) or "f1" not in d:
            continue
        answers = [r["resps"][0][0] for r in records if r.get("task") == f"video_pope_{split}"]
        rows.append(
            [
                name,
                split,
                d.get("n"),
                *(_with_ci(d.get(k), d, k) for k in ("f1", "accuracy", "precision", "recall")),
                d.get("yes_ratio"),
                count_pope_unparsed(answers).cell() if answers else "",
            ]
        )
    mean = [_with_ci(m.get("mean_f1"), m, "mean_f1"), _with_ci(m.get("mean_accuracy"), m, "mean_accuracy")]
    return rows + [[name, "mean", m.get("n"), *mean, "", "", None, unparsed_cell(total)]]


def _pope_files(protocol: dict[str, Any]) -> str:
    """Which POPE question files a run answered: ``world official`` / ``world v1``, a known release, or
    each split's file by the first 8 hex digits of its sha256; empty for a run without POPE."""
    pope = (protocol.get("tasks") or {}).get("pope")
    if not pope:
        return ""
    if pope.get("world_version"):
        return f"world {pope['world_version']}"
    dataset = ((protocol.get("recipe") or {}).get("eval") or {}).get("data", {}).get("dataset")
    if dataset == "world":  # written before world_version existed: the v1 files
        return "world v1"
    files = pope.get("files") or {}
    known = [f.get("known_version") for f in files.values()]
    if known and all(known):
        return ", ".join(sorted({f"{k['dataset']}@{str(k['commit'])[:8]}" for k in known}))
    return ", ".join(f"{split} {str(f.get('sha256', ''))[:8]}" for split, f in files.items())


def metrics_table(metrics: dict[str, Any]) -> str:
    """The metrics of an ``mmfast eval`` run as an aligned plain-text table (the end of ``mmfast eval``):
    one row per POPE split (image or video) and one for CHAIR, with n and 95% intervals where the run
    has them; a task that counted its unparsed answers (``video_pope``) gets a row for them, and
    ``video_pope`` a closing note that its figures are not a result."""

    def cell(d: dict[str, Any], key: str) -> str:
        v = d.get(key)
        if not isinstance(v, (int, float)):
            return ""
        ci = d.get(f"{key}_ci95")
        return f"{v:.3f}" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if isinstance(ci, (list, tuple)) and len(ci) == 2 else "")

    rows: list[list[str]] = []
    for task, m in metrics.items():
        if not isinstance(m, dict):
            continue
        splits = {k: v for k, v in m.items() if isinstance(v, dict) and "f1" in v}
        for split, d in splits.items():
            rows.append(
                [
                    f"{task} {split}",
                    str(d.get("n", "")),
                    "F1 " + cell(d, "f1"),
                    "acc " + cell(d, "accuracy"),
                    "prec " + cell(d, "precision"),
                    "rec " + cell(d, "recall"),
                    "yes " + cell(d, "yes_ratio"),
                    f"unparsed {d['n_unknown']}" if "n_unknown" in d else "",
                ]
            )
        if "mean_f1" in m:
            rows.append(
                [f"{task} mean", str(m.get("n", "")), "F1 " + cell(m, "mean_f1"), "acc " + cell(m, "mean_accuracy"), ""]
            )
        if isinstance(u := m.get("unparsed"), dict) and {"k", "n"} <= set(u):
            rows.append([f"{task} unparsed", str(u["n"]), unparsed_cell(TaskUnparsed(int(u["k"]), int(u["n"])))])
        if "chair_i" in m:
            rows.append(
                [
                    task,
                    str(m.get("n", "")),
                    "CHAIR_s " + cell(m, "chair_s"),
                    "CHAIR_i " + cell(m, "chair_i"),
                    "recall " + cell(m, "recall"),
                    f"degenerate {m['n_degenerate']}" if "n_degenerate" in m else "",
                ]
            )
        if not splits and "chair_i" not in m and "mean_f1" not in m:  # another task: its scalar metrics
            rows.append([task, str(m.get("n", "")), *(f"{k} {v:.3f}" for k, v in m.items() if isinstance(v, float))])
    if not rows:
        return "(no metrics)"
    width = max(len(r) for r in rows)
    rows = [r + [""] * (width - len(r)) for r in [["task", "n", *[""] * (width - 2)], *rows]]
    cols = [max(len(r[i]) for r in rows) for i in range(width)]
    table = "\n".join("  ".join(c.ljust(w) for c, w in zip(r, cols)).rstrip() for r in rows)
    return table + (f"\n{VIDEO_POPE_NOTE}" if "video_pope" in metrics else "")


def _bench_model(run: Path, s: dict[str, Any]) -> str | None:
    """The model a benchmark measured: its own record, else the fingerprints of its variant runs. A
    checkpoint loaded from a local path is named by its weights only (the path was the machine's)."""
    if s.get("model"):
        name = "a local checkpoint" if _local_model(s) else f"`{s['model']['name']}`"
        return f"{name} (weights `{s['model']['weights_fingerprint']}`)"
    fps = set()
    for sub in sorted(run.glob("variants/*/summary.json")):
        fp = _read_json(sub).get("protocol", {}).get("weights_fingerprint")
        if fp:
            fps.add(fp)
    return "weights " + ", ".join(f"`{f}`" for f in sorted(fps)) + " (from its variant runs)" if fps else None


def _is_count(column: str) -> bool:
    """A column of token counts ("vision tok", "layer-avg tok", "new tokens"): no three decimals."""
    return any(w in ("tok", "tokens") for w in column.lower().replace("@", " ").split())


def _local_model(s: dict[str, Any]) -> str | None:
    """The local path a bench loaded its model from (``./ckpt``, ``/data/m``), or None for a hub id or an
    embedded name."""
    name = str((s.get("model") or {}).get("name") or "")
    return name if name.startswith((".", "/", "~")) else None


def _fmt(v: Any, column: str = "") -> str:
    if isinstance(v, float) and _is_count(column):
        return f"{v:.0f}" if v.is_integer() else f"{v:.1f}"  # 576, 319.5
    if isinstance(v, float):
        return f"{v:.3f}"
    return "" if v is None else str(v)


def _md_table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(_fmt(v, h) for v, h in zip(r, header)) + " |" for r in rows]


def _bench_notes(run: Path) -> list[str]:
    """The protocol notes under a bench's ``results.md`` table (its ``- `` lines after the table)."""
    md = run / "results.md"
    if not md.is_file():
        return []
    lines = md.read_text().splitlines()
    last_table = max((i for i, ln in enumerate(lines) if ln.startswith("|")), default=-1)
    return [ln[2:] for ln in lines[last_table + 1 :] if ln.startswith("- ")]


def _side_tables(run: Path) -> list[tuple[str, list[str]]]:
    """A bench's other markdown files (``speed_shaped.md``, ``projected_7b.md``, ...): name and lines."""
    return [
        (p.name, p.read_text().splitlines())
        for p in sorted(run.glob("*.md"))
        if p.name not in ("results.md", "README.md")
    ]


def _to_html(markdown: str) -> str:
    """The report's markdown as HTML (CommonMark and tables, by markdown-it-py): code spans, emphasis and
    links render as they do on a forge; raw HTML in the text is escaped, not passed through."""

    return MarkdownIt("commonmark", {"html": False}).enable("table").render(markdown)


def _demote(lines: list[str]) -> list[str]:
    """A side file's headings under its bench's section ('# T' -> '### T')."""
    return ["##" + ln if ln.startswith("#") else ln for ln in lines]


def write_report(runs: list[str], output: str) -> Path:
    """Write ``report.md`` and ``report.html`` with their plots into ``output``.

    Every accuracy and CHAIR figure carries its n and 95% interval (from the summaries, else from the
    runs' per-sample records); bench directories keep their protocol notes and side tables
    (``speed_shaped.md``, ``projected_7b.md``); every plot is titled with the runs it shows.
    """
    out = Path(output)
    evals, benches = [], []
    paths = [Path(r) for r in runs]
    for run, label in zip(paths, run_labels(paths)):
        s = _load(run)
        if "results" not in s and "metrics" not in s:  # a gpu_speed / video_cost bench: rows, no results
            kind = s.get("kind") or "unknown"
            raise InputError(
                f"{run}: a {kind} bench's summary.json has no eval metrics or bench results to report; "
                "its results.md is its table (re-run its recorded command to re-render it): leave it out of "
                "`mmfast report`, which takes `mmfast eval` runs and pruning / decoding / speculative benches"
            )
        (benches if "results" in s else evals).append((run, label, s))
    out.mkdir(parents=True, exist_ok=True)  # after every run is read: a bad one leaves no empty directory
    md = ["# mmfast report", ""]
    images: list[Path] = []
    if evals:
        rows = [_eval_row(run, label, s) for run, label, s in evals]
        md += ["## Evaluation runs", "", *_md_table(EVAL_HEADER, [r.cells for r in rows]), ""]
        notes = [EVAL_INTERVAL_NOTE] + [n for r in rows for n in r.intervals.notes]
        notes += [n for (run, label, s) in evals if (n := incomplete_note(label, s.get("counts") or {}))]
        md += [f"- {n}" for n in notes] + [""]
        if video := [v for r in rows for v in r.video_pope]:
            md += ["## Video POPE (video_pope)", "", *_md_table(VIDEO_POPE_HEADER, video), ""]
            md += [f"- {VIDEO_POPE_REPORT_NOTE}", ""]
        pts = [
            (r.name, r.tokens_layer_avg, r.mean_f1)
            for r in rows
            if r.tokens_layer_avg is not None and r.mean_f1 is not None
        ]
        if pts and (
            p := scatter_lines(
                out / "accuracy_vs_tokens.png",
                pts,
                "layer-averaged vision tokens",
                "POPE mean F1",
                "POPE mean F1 vs vision tokens (evaluation runs)",
            )
        ):
            images.append(p)
        chair = [r for r in rows if r.chair_i is not None]
        if chair and (
            p := bars(
                out / "chair_by_run.png",
                [r.name for r in chair],
                [r.chair_i for r in chair],
                "CHAIR_i",
                "CHAIR_i by evaluation run",
                intervals=[_ci_of(r.intervals.chair, "chair_i") for r in chair],
                series="CHAIR_i (hallucinated mentions)",
            )
        ):
            images.append(p)
        both = [r for r in chair if r.recall is not None]
        if both and (
            p := labelled_points(
                out / "chair_i_vs_recall.png",
                [
                    (
                        r.name,
                        r.recall,
                        r.chair_i,
                        _ci_of(r.intervals.chair, "recall"),
                        _ci_of(r.intervals.chair, "chair_i"),
                    )
                    for r in both
                ],
                "CHAIR recall (ground-truth objects mentioned)",
                "CHAIR_i (hallucinated mentions)",
                "CHAIR_i vs recall (evaluation runs)",
            )
        ):
            images.append(p)
    for run, label, s in benches:
        md += [f"## Benchmark: {label}", ""]
        if model := _bench_model(run, s):
            md += [f"Model: {model}", ""]
        try:
            kind: str | None = bench_kind(s)
        except InputError:
            kind = None
        intervals = variant_intervals(run, s["results"]) if kind in ("pruning", "decoding") else {}
        if "header" in s and "rows" in s:
            header, rows = with_intervals(s["header"], s["rows"], intervals) if intervals else (s["header"], s["rows"])
            header, rows = (
                with_unparsed(header, rows, variant_unparsed(run, s["results"])) if intervals else (header, rows)
            )
            labels = timing_labels(s)  # which model each timing comes from, as results.md
            md += [*_md_table([labels.get(h, h) for h in header], rows), ""]
        notes = _bench_notes(run)
        if intervals:
            notes = [
                n for n in notes if not n.startswith("95% CI:") and not n.startswith(INTERVAL_NOTE_PREFIX)
            ] + interval_notes(intervals)
        if notes:
            md += [f"- {n}" for n in notes] + [""]
        local = _local_model(s)
        for _, lines in _side_tables(run):
            if local:  # its recorded command names the path
                lines = [ln.replace(local, "<local checkpoint>") for ln in lines]
            md += [*_demote(lines), ""]
        ratios = {n: r["ratios"] for n, r in s["results"].items() if r.get("ratios")}
        # the bars are the prefill speedup where the bench has one (pruning, stacked: not end to end)
        key = "prefill_speedup" if any(v.get("prefill_speedup") is not None for v in ratios.values()) else "speedup"
        speed = [(n, v[key]) for n, v in ratios.items() if v.get(key) is not None]
        what = "prefill speedup" if key == "prefill_speedup" else "speedup"
        if speed and (
            p := bars(
                out / f"speedup_{_file_label(label)}.png",
                [n for n, _ in speed],
                [v for _, v in speed],
                f"{what} (x)",
                f"{what[0].upper()}{what[1:]} per method ({label})",
                baseline=1.0,
                series="speedup vs the baseline",
            )
        ):
            images.append(p)
        if kind is not None:  # drawn again here, titled with this bench (two benches' plots never share a title)
            images += bench_plots(s, out, label, intervals, prefix=f"{_file_label(label)}_")
        else:
            for png in sorted(run.glob("*.png")):
                dest = out / f"{_file_label(label)}_{png.name}"
                shutil.copyfile(png, dest)
                images.append(dest)
    for img in images:
        alt = _title(img) or img.stem
        md += [f"![{alt}]({img.name})", ""]
    (out / "report.md").write_text("\n".join(md) + "\n")
    style = "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:3px 6px;font-size:13px}"
    body = _to_html("\n".join(md))
    (out / "report.html").write_text(
        f"<!doctype html><html><head><meta charset='utf-8'><style>{style}</style></head><body>{body}</body></html>"
    )
    logger.info("wrote %s", out / "report.md")
    return out / "report.md"


def _ci_of(part: dict[str, Any] | None, key: str) -> tuple[float, float] | None:
    ci = (part or {}).get(f"{key}_ci95")
    return (ci[0], ci[1]) if ci else None


def _title(png: Path) -> str | None:
    try:
        return plot_title(png)
    except Exception:  # noqa: BLE001 - a copied PNG from elsewhere: no stored title
        return None
