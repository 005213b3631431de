"""``mmfast report RUN_DIR...``: one markdown + HTML page, with PNG plots, from evaluation and
benchmark run directories (each holds a ``summary.json``).

Evaluation runs become one row each (method settings, token accounting, POPE, CHAIR, the weights
fingerprint, so that results of two versions of a model are never read as one table) and feed two
plots: POPE mean F1 against vision tokens, and CHAIR_i per decoder. Benchmark directories contribute
their own result tables, their plots, and a speedup-per-method plot from their ratios.
"""

from __future__ import annotations

import html
import json
import logging
import shutil
from pathlib import Path
from typing import Any

from .bench.plots import bars, scatter_lines
from .errors import InputError

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
        raise InputError(f"{path}: not valid JSON ({exc}); rerun the evaluation or remove the directory from the report") from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected a JSON object, got {type(data).__name__}; is this an mmfast summary?")
    return data


def _method_label(protocol: dict[str, Any]) -> str:
    parts = [f"{p['method']}({_short(p.get('params', {}))})" for p in protocol.get("pruning", [])]
    dec = protocol.get("decoding", {})
    parts.append(f"{dec.get('method', 'greedy')}({_short(dec.get('params', {}))})")
    if protocol.get("speculative"):
        parts.append(f"spec:{protocol['speculative']['method']}")
    return " + ".join(parts)


def _short(params: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in list(params.items())[:3])


def _eval_row(name: str, s: dict[str, Any]) -> list[Any]:
    m, acc, proto = s.get("metrics", {}), s.get("accounting", {}), s.get("protocol", {})
    pope, chair = m.get("pope", {}), m.get("chair", {})
    return [
        name,
        _method_label(proto),
        acc.get("mean_n_vision_tokens"),
        acc.get("mean_vision_tokens_layer_avg"),
        *(pope.get(k, {}).get("f1") for k in ("random", "popular", "adversarial")),
        pope.get("mean_f1"),
        chair.get("chair_s"),
        chair.get("chair_i"),
        chair.get("recall"),
        proto.get("weights_fingerprint"),
    ]


def _bench_model(run: Path, s: dict[str, Any]) -> str | None:
    """The model a benchmark measured: its own record, else the fingerprints of its variant runs."""
    if s.get("model"):
        return f"`{s['model']['name']}` (weights `{s['model']['weights_fingerprint']}`)"
    fps = set()
    for sub in sorted(run.glob("variants/*/summary.json")):
        fp = _read_json(sub).get("protocol", {}).get("weights_fingerprint")
        if fp:
            fps.add(fp)
    return "weights " + ", ".join(f"`{f}`" for f in sorted(fps)) + " (from its variant runs)" if fps else None


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}"
    return "" if v is None else str(v)


def _md_table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(_fmt(v) for v in r) + " |" for r in rows]


def _html_table(header: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(v))}</td>" for v in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def write_report(runs: list[str], output: str) -> Path:
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    evals, benches = [], []
    for r in runs:
        run = Path(r)
        s = _load(run)
        (benches if "results" in s else evals).append((run, s))
    md = ["# mmfast report", ""]
    parts_html = ["<h1>mmfast report</h1>"]
    images: list[Path] = []
    if evals:
        header = ["run", "methods", "vision tok", "layer-avg tok", "POPE F1 rand", "pop", "adv", "mean F1", "CHAIR_s", "CHAIR_i", "recall", "weights"]
        rows = [_eval_row(run.name, s) for run, s in evals]
        md += ["## Evaluation runs", "", *_md_table(header, rows), ""]
        parts_html += ["<h2>Evaluation runs</h2>", _html_table(header, rows)]
        pts = [(r[0], r[3], r[7]) for r in rows if r[3] is not None and r[7] is not None]
        if pts and (p := scatter_lines(out / "accuracy_vs_tokens.png", pts, "layer-averaged vision tokens", "POPE mean F1", "Accuracy vs vision tokens")):
            images.append(p)
        chair = [(r[0], r[9]) for r in rows if r[9] is not None]
        if chair and (p := bars(out / "chair_by_run.png", [c[0] for c in chair], [c[1] for c in chair], "CHAIR_i", "CHAIR_i by run (decoder)")):
            images.append(p)
    for run, s in benches:
        md += [f"## Benchmark: {run.name}", ""]
        parts_html.append(f"<h2>Benchmark: {html.escape(run.name)}</h2>")
        if model := _bench_model(run, s):
            md += [f"Model: {model}", ""]
            parts_html.append(f"<p>Model: {html.escape(model)}</p>")
        if "header" in s and "rows" in s:
            md += [*_md_table(s["header"], s["rows"]), ""]
            parts_html.append(_html_table(s["header"], s["rows"]))
        speed = [(n, r["ratios"].get("prefill_speedup") or r["ratios"].get("speedup")) for n, r in s["results"].items() if r.get("ratios")]
        speed = [(n, v) for n, v in speed if v is not None]
        if speed and (p := bars(out / f"speedup_{run.name}.png", [n for n, _ in speed], [v for _, v in speed], "speedup (x)", f"Speedup per method ({run.name})")):
            images.append(p)
        for png in sorted(run.glob("*.png")):
            dest = out / f"{run.name}_{png.name}"
            shutil.copyfile(png, dest)
            images.append(dest)
    for img in images:
        md += [f"![{img.stem}]({img.name})", ""]
        parts_html.append(f'<p><img src="{html.escape(img.name)}" alt="{html.escape(img.stem)}"></p>')
    (out / "report.md").write_text("\n".join(md) + "\n")
    style = "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:3px 6px;font-size:13px}"
    (out / "report.html").write_text(f"<!doctype html><html><head><meta charset='utf-8'><style>{style}</style></head><body>{''.join(parts_html)}</body></html>")
    logger.info("wrote %s", out / "report.md")
    return out / "report.md"
