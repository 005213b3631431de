"""mmfast report: markdown + HTML with tables and plots from eval and bench run directories."""

from __future__ import annotations

import json

import pytest

from mmfast.cli import main
from mmfast.errors import InputError
from mmfast.report import write_report


def _eval_summary(tmp_path, name, tokens, f1, chair_i, decoding="greedy"):
    d = tmp_path / name
    d.mkdir()
    pope = {s: {"f1": f1, "accuracy": f1} for s in ("random", "popular", "adversarial")}
    (d / "summary.json").write_text(json.dumps({
        "metrics": {"pope": {**pope, "mean_f1": f1}, "chair": {"chair_s": 0.3, "chair_i": chair_i, "recall": 0.6, "len": 40, "n": 5}},
        "accounting": {"mean_n_vision_tokens": tokens, "mean_vision_tokens_layer_avg": tokens},
        "protocol": {"pruning": [{"method": "fastv", "params": {"keep": tokens}}], "decoding": {"method": decoding, "params": {}}},
    }))
    return d


def test_report_from_eval_and_bench_dirs(tmp_path, capsys):
    a = _eval_summary(tmp_path, "fastv-64", 64, 0.8, 0.12)
    b = _eval_summary(tmp_path, "fastv-192", 192, 0.86, 0.10, decoding="vcd")
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "summary.json").write_text(json.dumps({
        "header": ["variant", "x"], "rows": [["baseline", 1.0], ["fastv-64", 2.5]],
        "results": {"baseline": {"ratios": {"prefill_speedup": 1.0}}, "fastv-64": {"ratios": {"prefill_speedup": 2.5}}},
    }))
    assert main(["-q", "report", str(a), str(b), str(bench), "--output", str(tmp_path / "rep")]) == 0
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "fastv-64" in md and "vcd" in md and "| baseline | 1.000 |" in md
    html = (tmp_path / "rep" / "report.html").read_text()
    assert "<table>" in html and "<img" in html
    pngs = sorted(p.name for p in (tmp_path / "rep").glob("*.png"))
    assert "accuracy_vs_tokens.png" in pngs and "chair_by_run.png" in pngs and "speedup_bench.png" in pngs


def test_report_bad_dir(tmp_path):
    with pytest.raises(InputError, match="no summary.json"):
        write_report([str(tmp_path)], str(tmp_path / "out"))
