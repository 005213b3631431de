"""mmfast report: markdown + HTML with tables and plots from eval and bench run directories."""

from __future__ import annotations

import json

import pytest

from mmfast.cli import main
from mmfast.errors import InputError
from mmfast.report import write_report


def _eval_summary(tmp_path, name, tokens, f1, chair_i, decoding="greedy", fingerprint="aaaa"):
    d = tmp_path / name
    d.mkdir()
    pope = {s: {"f1": f1, "accuracy": f1} for s in ("random", "popular", "adversarial")}
    (d / "summary.json").write_text(json.dumps({
        "metrics": {"pope": {**pope, "mean_f1": f1}, "chair": {"chair_s": 0.3, "chair_i": chair_i, "recall": 0.6, "len": 40, "n": 5}},
        "accounting": {"mean_n_vision_tokens": tokens, "mean_vision_tokens_layer_avg": tokens},
        "protocol": {"pruning": [{"method": "fastv", "params": {"keep": tokens}}], "decoding": {"method": decoding, "params": {}},
                     "weights_fingerprint": fingerprint},
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


def test_report_names_the_weights_of_every_run(tmp_path):
    """Runs of two versions of a model stay distinguishable in one report."""
    a = _eval_summary(tmp_path, "old", 576, 0.7, 0.5, fingerprint="1111")
    b = _eval_summary(tmp_path, "new", 576, 0.8, 0.3, fingerprint="2222")
    recorded = tmp_path / "bench_new"
    recorded.mkdir()
    (recorded / "summary.json").write_text(json.dumps({
        "header": ["variant"], "rows": [["baseline"]], "results": {},
        "model": {"name": "mmfast/tiny-world", "weights_fingerprint": "2222"}}))
    legacy = tmp_path / "bench_old"  # written before benches recorded their model: read the variants
    (legacy / "variants" / "baseline").mkdir(parents=True)
    (legacy / "summary.json").write_text(json.dumps({"header": ["variant"], "rows": [["baseline"]], "results": {}}))
    (legacy / "variants" / "baseline" / "summary.json").write_text(json.dumps({"protocol": {"weights_fingerprint": "1111"}}))
    md = write_report([str(a), str(b), str(recorded), str(legacy)], str(tmp_path / "rep")).read_text()
    assert "| 1111 |" in md and "| 2222 |" in md
    assert "Model: `mmfast/tiny-world` (weights `2222`)" in md
    assert "Model: weights `1111` (from its variant runs)" in md
