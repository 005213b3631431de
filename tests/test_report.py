"""mmfast report: markdown + HTML with tables and plots from eval and bench run directories."""

from __future__ import annotations

import json
import re

import pytest

from mmfast.cli import main
from mmfast.errors import InputError
from mmfast.report import EVAL_HEADER, write_report


def _eval_summary(tmp_path, name, tokens, f1, chair_i, decoding="greedy", fingerprint="aaaa"):
    d = tmp_path / name
    d.mkdir()
    pope = {s: {"f1": f1, "accuracy": f1} for s in ("random", "popular", "adversarial")}
    (d / "summary.json").write_text(
        json.dumps(
            {
                "metrics": {
                    "pope": {**pope, "mean_f1": f1},
                    "chair": {"chair_s": 0.3, "chair_i": chair_i, "recall": 0.6, "len": 40, "n": 5},
                },
                "accounting": {"mean_n_vision_tokens": tokens, "mean_vision_tokens_layer_avg": tokens},
                "protocol": {
                    "pruning": [{"method": "fastv", "params": {"keep": tokens}}],
                    "decoding": {"method": decoding, "params": {}},
                    "weights_fingerprint": fingerprint,
                },
            }
        )
    )
    return d


def test_report_from_eval_and_bench_dirs(tmp_path, capsys):
    a = _eval_summary(tmp_path, "fastv-64", 64, 0.8, 0.12)
    b = _eval_summary(tmp_path, "fastv-192", 192, 0.86, 0.10, decoding="vcd")
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "summary.json").write_text(
        json.dumps(
            {
                "header": ["variant", "x"],
                "rows": [["baseline", 1.0], ["fastv-64", 2.5]],
                "results": {
                    "baseline": {"ratios": {"prefill_speedup": 1.0}},
                    "fastv-64": {"ratios": {"prefill_speedup": 2.5}},
                },
            }
        )
    )
    assert main(["-q", "report", str(a), str(b), str(bench), "--output", str(tmp_path / "rep")]) == 0
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "fastv-64" in md and "vcd" in md and "| baseline | 1.000 |" in md
    html = (tmp_path / "rep" / "report.html").read_text()
    assert "<table>" in html and "<img" in html
    pngs = sorted(p.name for p in (tmp_path / "rep").glob("*.png"))
    assert "accuracy_vs_tokens.png" in pngs and "chair_by_run.png" in pngs and "speedup_bench.png" in pngs
    # the bars are prefill speedups, titled so (a stacked bench's OPERA row: 0.87x prefill, 0.14x end to end)
    from mmfast.bench.plots import plot_title

    assert plot_title(tmp_path / "rep" / "speedup_bench.png") == "Prefill speedup per method (bench)"


def test_report_bad_dir(tmp_path):
    with pytest.raises(InputError, match="no summary.json"):
        write_report([str(tmp_path)], str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()  # refused before the output directory is made


def test_report_names_the_weights_of_every_run(tmp_path):
    """Runs of two versions of a model stay distinguishable in one report."""
    a = _eval_summary(tmp_path, "old", 576, 0.7, 0.5, fingerprint="1111")
    b = _eval_summary(tmp_path, "new", 576, 0.8, 0.3, fingerprint="2222")
    recorded = tmp_path / "bench_new"
    recorded.mkdir()
    (recorded / "summary.json").write_text(
        json.dumps(
            {
                "header": ["variant"],
                "rows": [["baseline"]],
                "results": {},
                "model": {"name": "mmfast/tiny-world", "weights_fingerprint": "2222"},
            }
        )
    )
    legacy = tmp_path / "bench_old"  # written before benches recorded their model: read the variants
    (legacy / "variants" / "baseline").mkdir(parents=True)
    (legacy / "summary.json").write_text(json.dumps({"header": ["variant"], "rows": [["baseline"]], "results": {}}))
    (legacy / "variants" / "baseline" / "summary.json").write_text(
        json.dumps({"protocol": {"weights_fingerprint": "1111"}})
    )
    md = write_report([str(a), str(b), str(recorded), str(legacy)], str(tmp_path / "rep")).read_text()
    assert "| 1111 |" in md and "| 2222 |" in md
    assert "Model: `mmfast/tiny-world` (weights `2222`)" in md
    assert "Model: weights `1111` (from its variant runs)" in md


def test_report_names_a_local_checkpoint_by_its_weights_not_its_path(tmp_path):
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "summary.json").write_text(
        json.dumps(
            {
                "header": ["variant"],
                "rows": [["baseline"]],
                "results": {},
                "model": {"name": ".dev/r12B", "weights_fingerprint": "2222"},
            }
        )
    )
    (bench / "projected_7b.md").write_text("# P\n\nCommand: `mmfast bench b.yaml --set model.name=.dev/r12B`\n")
    md = write_report([str(bench)], str(tmp_path / "rep")).read_text()
    assert ".dev/r12B" not in md and ".dev/r12B" not in (tmp_path / "rep" / "report.html").read_text()
    assert "Model: a local checkpoint (weights `2222`)" in md and "--set model.name=<local checkpoint>`" in md


def _pope_run(tmp_path, name, p_right, n=40, with_ci=False):
    """An eval run dir with POPE records (and a summary from the task's own scoring)."""
    import random

    from mmfast.eval.pope import PopeRecord, score_pope, summarize_pope

    rnd = random.Random(name)
    d = tmp_path / name
    d.mkdir()
    recs, per_split = [], {}
    for split in ("random", "popular", "adversarial"):
        rs = []
        for i in range(n):
            label = "yes" if i % 2 else "no"
            right = rnd.random() < p_right
            ans = label if right else ("no" if label == "yes" else "yes")
            rs.append(
                {
                    "doc_id": f"pope_{split}/{i}",
                    "task": f"pope_{split}",
                    "target": label,
                    "resps": [[ans.capitalize()]],
                    "meta": {"question_id": i},
                }
            )
        per_split[split] = score_pope([PopeRecord(r["meta"]["question_id"], r["target"], r["resps"][0][0]) for r in rs])
        recs += rs
    (d / "samples.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    pope = summarize_pope(per_split)
    summary = {
        "metrics": {"pope": pope},
        "accounting": {"mean_n_vision_tokens": 576, "mean_vision_tokens_layer_avg": 576},
        "protocol": {
            "pruning": [],
            "decoding": {"method": "greedy", "params": {}},
            "weights_fingerprint": "aaaa",
            "tasks": {"pope": {"parser": "pope"}},
        },
    }
    (d / "summary.json").write_text(json.dumps(summary))
    return d, pope


def test_report_tables_carry_n_and_intervals(tmp_path):
    """A run whose summary predates intervals gets them from its records; the interval holds the figure."""
    run, pope = _pope_run(tmp_path, "old_run", 0.85)
    md = write_report([str(run)], str(tmp_path / "rep")).read_text()
    assert "| mean F1 [95% CI] | n POPE |" in md
    row = next(ln for ln in md.splitlines() if ln.startswith("| old_run"))
    cell = row.split("|")[8].strip()
    value, lo, hi = (float(x) for x in cell.replace("[", "").replace("]", "").replace(",", "").split())
    assert value == pytest.approx(pope["mean_f1"], abs=5e-4) and lo <= value <= hi and hi - lo > 0.02
    assert row.split("|")[9].strip() == "120"
    assert "| n POPE | POPE unparsed |" in md and row.split("|")[10].strip() == "0/120"  # every answer a yes or a no
    assert "percentile bootstrap" in md


def test_report_names_the_pope_files_counts_tokens_and_renders_markdown_in_html(tmp_path):
    """The same model on two POPE file versions gives two rows that say which; token counts are counts;
    the HTML renders the markdown (code spans, no raw backticks) and escapes raw HTML."""
    old, _ = _pope_run(tmp_path, "on_v1", 0.9)
    new, _ = _pope_run(tmp_path, "on_official", 0.8)
    coco, _ = _pope_run(tmp_path, "on_coco", 0.8)
    files = {"random": {"sha256": "16bd38e487d12aded", "known_version": None}}
    for run, pope in (
        (old, {"files": files}),
        (new, {"files": files, "world_version": "official"}),
        (coco, {"files": files}),
    ):
        s = json.loads((run / "summary.json").read_text())
        s["protocol"]["tasks"]["pope"].update(pope)
        s["protocol"]["recipe"] = {"eval": {"data": {"dataset": "coco" if run is coco else "world"}}}
        s["accounting"]["mean_vision_tokens_layer_avg"] = 319.5
        (run / "summary.json").write_text(json.dumps(s))
    bench = _bench_dir(tmp_path, [("baseline", 0.9), ("vcd", 0.8)])
    out = tmp_path / "rep"
    md = write_report([str(old), str(new), str(coco), str(bench)], str(out)).read_text()
    rows = {
        ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")[1:-1]]
        for ln in md.splitlines()
        if ln.startswith("| on_")
    }
    col = EVAL_HEADER.index("POPE files")
    assert (rows["on_v1"][col], rows["on_official"][col], rows["on_coco"][col]) == (
        "world v1",
        "world official",
        "random 16bd38e4",
    )
    assert rows["on_v1"][2:4] == ["576", "319.5"]  # not 576.000
    html = (out / "report.html").read_text()
    assert "<p>Command: <code>x</code></p>" in html and "`" not in html  # projected_7b.md
    assert "<td>576</td><td>319.5</td>" in html.replace("\n", "")


def test_report_html_escapes_raw_html(tmp_path):
    run, _ = _pope_run(tmp_path, "x<script>", 0.9)
    html = (write_report([str(run)], str(tmp_path / "rep")).parent / "report.html").read_text()
    assert "<script>" not in html and "x&lt;script&gt;" in html


def _bench_dir(tmp_path, runs):
    """A decoding-bench directory written before intervals: summary.json, results.md notes, a side table."""
    bench = tmp_path / "bench_dec"
    (bench / "variants").mkdir(parents=True)
    results, rows = {}, []
    for name, p in runs:
        run, pope = _pope_run(bench / "variants", name, p)
        chair = {"chair_s": 0.5, "chair_i": 0.2 + p / 10, "recall": p / 2, "len": 50, "n": 10}
        results[name] = {
            "decoding": {"method": name},
            "metrics": {"pope": pope, "chair": chair},
            "cost": {"decode_s_per_token": 0.01},
            "ratios": {"cost_per_token": 1.0 + p},
            "protocol": {},
        }
        rows.append(
            [
                name,
                name,
                pope["random"]["f1"],
                pope["popular"]["f1"],
                pope["adversarial"]["f1"],
                pope["mean_f1"],
                chair["chair_s"],
                chair["chair_i"],
                chair["recall"],
                50,
                1.0 + p,
                100.0,
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
    (bench / "summary.json").write_text(json.dumps({"header": header, "rows": rows, "results": results}))
    (bench / "results.md").write_text(
        "# Decoders\n\nCommand: `mmfast bench decoding.yaml --output bench_dec`\n\n| variant |\n|---|\n| baseline |\n\n"
        "- All decoders ran in one process on the same samples.\n- peak RSS: the process's peak.\n"
    )
    (bench / "projected_7b.md").write_text(
        "# Projected 7B speedup\n\nCommand: `x`\n\n| drafter | projected 7B speedup |\n|---|---|\n"
        "| msd | 2.590 |\n\n- projected speedup = tau / (1 + c + v).\n"
    )
    return bench


def test_report_keeps_bench_notes_side_tables_and_titles_every_plot(tmp_path):
    from mmfast.bench.plots import plot_title

    bench = _bench_dir(tmp_path, [("baseline", 0.9), ("vcd", 0.8)])
    ev, _ = _pope_run(tmp_path, "eval_run", 0.9)
    s = json.loads((ev / "summary.json").read_text())
    s["metrics"]["chair"] = {
        "chair_s": 0.5,
        "chair_i": 0.25,
        "recall": 0.5,
        "len": 50,
        "n": 10,
        "chair_s_ci95": [0.24, 0.76],
        "chair_i_ci95": [0.2, 0.3],
        "recall_ci95": [0.4, 0.6],
    }
    (ev / "summary.json").write_text(json.dumps(s))
    out = tmp_path / "rep"
    md = write_report([str(ev), str(bench)], str(out)).read_text()
    # the bench's table: n and intervals computed from each variant's records (CHAIR has none to re-score here)
    assert "| mean F1 | mean F1 [95% CI] | n POPE |" in md and "| 120 |" in md
    assert "0.250 [0.200, 0.300]" in md  # CHAIR figures carry the recorded interval
    # protocol notes and the projection table survive
    assert "- All decoders ran in one process on the same samples." in md
    assert "| msd | 2.590 |" in md and "projected speedup = tau / (1 + c + v)" in md
    html = (out / "report.html").read_text()
    assert "<h3>Projected 7B speedup</h3>" in html and "<li>All decoders ran in one process" in html
    # CHAIR_i vs recall, from the eval runs and from the bench's variants
    assert (out / "chair_i_vs_recall.png").is_file() and (out / "bench_dec_chair_i_vs_recall.png").is_file()
    pngs = sorted(out.glob("*.png"))
    titles = [plot_title(p) for p in pngs]
    assert all(titles) and len(set(titles)) == len(titles), titles
    assert "CHAIR_i vs recall (evaluation runs)" in titles and "CHAIR_i vs recall (bench_dec)" in titles


def test_rerender_bench_dir_adds_intervals_without_running(tmp_path):
    from mmfast.eval.intervals import CI_METHOD

    bench = _bench_dir(tmp_path, [("baseline", 0.9), ("vcd", 0.8)])
    before = json.loads((bench / "summary.json").read_text())
    assert main(["-q", "rerender", str(bench)]) == 0
    md = (bench / "results.md").read_text()
    assert "Command: `mmfast bench decoding.yaml --output bench_dec`" in md
    assert "| mean F1 | mean F1 [95% CI] | n POPE |" in md and "95% CI: POPE mean F1 by a percentile bootstrap" in md
    after = json.loads((bench / "summary.json").read_text())
    assert after["kind"] == "decoding"
    iv_of = {}
    for name, r in after["results"].items():
        iv = r.pop("intervals")
        iv_of[name] = iv["pope"]["mean_f1_ci95"]
        lo, hi = iv["pope"]["mean_f1_ci95"]
        assert lo <= r["metrics"]["pope"]["mean_f1"] <= hi
        bad = r.pop("unparsed")  # counted from the records: every POPE answer there is a yes or a no
        assert bad["pope"]["k"] == 0 and bad["pope"]["n"] > 0
    assert "| n POPE | POPE unparsed |" in md
    after.pop("kind")
    assert after == before  # nothing else changes
    assert {"chair_i.png", "cost_per_token.png", "chair_i_vs_recall.png"} <= {p.name for p in bench.glob("*.png")}
    for name in ("baseline", "vcd"):  # each variant's own summary.json carries today's intervals too
        variant = json.loads((bench / "variants" / name / "summary.json").read_text())["metrics"]["pope"]
        assert variant["ci_method"] == CI_METHOD
        assert variant["mean_f1_ci95"] == iv_of[name]


def test_rerender_rewrites_an_eval_runs_intervals_of_an_older_method_and_nothing_else(tmp_path):
    """An eval run whose summary.json holds intervals of the retired method (no ``ci_method``) gets
    today's, equal to a direct computation from its records; every other key is kept, and a second
    rerender leaves the file as it is."""
    from mmfast.eval.intervals import CI_METHOD, pope_cells, pope_intervals, pope_units, read_records

    run, pope = _pope_run(tmp_path, "old", 0.8)
    stale = json.loads((run / "summary.json").read_text())
    stale["metrics"]["pope"]["mean_f1_ci95"] = [0.5, 0.6]
    stale["metrics"]["pope"]["random"]["f1_ci95"] = [0.5, 0.6]
    (run / "summary.json").write_text(json.dumps(stale))
    assert main(["-q", "rerender", str(run)]) == 0
    after = json.loads((run / "summary.json").read_text())
    recs = read_records(run)
    by_split = {s: [r for r in recs if r["task"] == f"pope_{s}"] for s in ("random", "popular", "adversarial")}
    want = pope_intervals(
        {s: pope_cells(rs, "pope") for s, rs in by_split.items()}, {s: pope_units(rs) for s, rs in by_split.items()}
    )
    got = after["metrics"].pop("pope")
    assert got["mean_f1_ci95"] == want.mean_f1.as_list() != [0.5, 0.6]
    assert got["random"]["f1_ci95"] == want.splits["random"].f1.as_list() and got["ci_method"] == CI_METHOD

    def figures(part):  # the metrics without their intervals
        return {
            k: figures(v) if isinstance(v, dict) else v
            for k, v in part.items()
            if not k.endswith("_ci95") and k not in ("n", "n_units", "ci_method")
        }

    assert figures(got) == figures(pope) and got["n"] == 120
    stale["metrics"].pop("pope")
    assert after == stale  # nothing but POPE's intervals changed
    text = (run / "summary.json").read_text()
    assert main(["-q", "rerender", str(run)]) == 0 and (run / "summary.json").read_text() == text


def test_pruning_budget_leaders_pick_the_best_at_each_budget_with_paired_margins(tmp_path):
    """leaders.md's rows: per budget the best POPE mean F1 among the variants at that budget (layer
    average within 5%), its margin over VisionZip and random as a paired interval; a variant off its
    budget by more than 5% is left out, and the note says so."""
    import numpy as np

    from mmfast.bench.render import budget_leaders
    from mmfast.eval.intervals import (
        paired_mean_f1_difference,
        paired_pope_cells,
        pope_cells,
        pope_intervals,
        read_records,
    )

    rng = np.random.default_rng(0)
    labels = ["yes" if i % 2 == 0 else "no" for i in range(120)]
    results = {}

    def variant(name, method, budget, avg, p_right, yes="Yes"):
        cells, recs = {}, []
        for s in ("random", "popular"):
            for i, lab in enumerate(labels):
                right = rng.random() < p_right
                ans = yes if (lab == "yes") == right else "No"
                recs.append({"doc_id": f"pope_{s}/{i}", "task": f"pope_{s}", "target": lab, "resps": [[ans]]})
        run = tmp_path / "variants" / name
        run.mkdir(parents=True)
        (run / "samples.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
        for s in ("random", "popular"):
            cells[s] = pope_cells([r for r in recs if r["task"] == f"pope_{s}"], "pope")
        iv = pope_intervals(cells)
        results[name] = {
            "metrics": {"pope": {"mean_f1": iv.mean_f1.estimate}},
            "intervals": {"pope": {"mean_f1_ci95": iv.mean_f1.as_list()}},
            "accounting": {"vision_tokens_layer_avg": avg},
            "pruning": [{"method": method, "params": {}, "budget": {"tokens": budget}}] if method else [],
        }
        return recs

    variant("baseline", None, None, 576.0, 0.95)
    c_div = variant("divprune-64", "divprune", 64, 64.0, 0.9)
    c_vz = variant("visionzip-64", "visionzip", 64, 64.0, 0.8)
    c_rnd = variant("random-64", "random", 64, 64.0, 0.7)
    variant("mustdrop-64", "mustdrop", 64, 70.0, 0.99)  # 9% over its budget: not compared
    # the best F1 of all, but its "yes" is "inYes": the official rule's default, not a reading (about half its answers)
    variant("zipvl-64", "zipvl", 64, 64.0, 1.0, yes="inYes")
    assert results["zipvl-64"]["metrics"]["pope"]["mean_f1"] == 1.0
    # every answer right, but every token still computed in prefill (FLOPs ratio 1): not at the same budget
    variant("zipvl-tau", "zipvl", 64, 64.0, 1.0)
    results["zipvl-tau"]["ratios"] = {"flops_ratio": 1.0}
    results["divprune-64"]["ratios"] = {"flops_ratio": 0.13}
    header, rows, notes = budget_leaders(tmp_path, {"results": results})
    assert len(rows) == 1 and rows[0][0] == 64 and rows[0][1] == "divprune-64"
    assert rows[0][3].startswith("visionzip-64")
    want = paired_mean_f1_difference(*paired_pope_cells(c_div, c_vz, "pope"))
    assert (
        rows[0][header.index("margin over visionzip [paired 95% CI]")]
        == f"{want.estimate:+.3f} [{want.lo:+.3f}, {want.hi:+.3f}]"
    )
    want = paired_mean_f1_difference(*paired_pope_cells(c_div, c_rnd, "pope"))
    assert read_records(tmp_path / "variants" / "divprune-64")
    assert (
        rows[0][header.index("margin over random [paired 95% CI]")]
        == f"{want.estimate:+.3f} [{want.lo:+.3f}, {want.hi:+.3f}]"
    )
    assert any("mustdrop-64 left out of budget 64" in n for n in notes)
    assert any(
        n.startswith("zipvl-64 not ranked at budget 64: 120/240 (50.0%) POPE answers neither yes nor no")
        and "'inYes'" in n
        for n in notes
    ), notes
    assert any(
        n.startswith("zipvl-tau not ranked at budget 64: it computes every vision token in prefill") for n in notes
    ), notes


def test_budget_leaders_margin_uses_the_parser_the_ranked_f1s_were_scored_with(tmp_path):
    """A bench scored with ``eval.pope.parser: opera``: 'Yes. It is not small.' is a no under OPERA's rule
    (any 'not') and a yes under the official one; the margin is the difference of the two ranked F1s."""
    from mmfast.bench.render import budget_leaders
    from mmfast.eval.intervals import pope_cells, pope_intervals

    labels = ["yes" if i % 2 == 0 else "no" for i in range(40)]
    results = {}

    def variant(name, method, yes_answer):
        recs = [
            {"doc_id": f"pope_{s}/{i}", "task": f"pope_{s}", "target": lab, "image": f"img{i // 4}.png",
             "resps": [[yes_answer if lab == "yes" else "No"]]}
            for s in ("random", "popular") for i, lab in enumerate(labels)
        ]  # fmt: skip
        run = tmp_path / "variants" / name
        run.mkdir(parents=True)
        (run / "samples.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
        (run / "summary.json").write_text(json.dumps({"protocol": {"tasks": {"pope": {"parser": "opera"}}}}))
        cells = {s: pope_cells([r for r in recs if r["task"] == f"pope_{s}"], "opera") for s in ("random", "popular")}
        results[name] = {
            "metrics": {"pope": {"mean_f1": pope_intervals(cells, resamples=200).mean_f1.estimate}},
            "accounting": {"vision_tokens_layer_avg": 64.0},
            "pruning": [{"method": method, "params": {}, "budget": {"tokens": 64}}],
            "ratios": {"flops_ratio": 0.13},
        }

    variant("divprune-64", "divprune", "Yes")
    variant("visionzip-64", "visionzip", "Yes. It is not small.")
    header, rows, _ = budget_leaders(tmp_path, {"results": results})
    assert rows[0][1] == "divprune-64"
    assert rows[0][header.index("margin over visionzip [paired 95% CI]")].startswith("+1.000")


def test_bench_table_counts_unparsed_answers_and_marks_a_task_over_the_limit():
    from mmfast.bench.render import unparsed_notes, with_unparsed
    from mmfast.eval.unparsed import TaskUnparsed, Unparsed

    header = ["variant", "mean F1", "n POPE", "CHAIR_i", "n CHAIR"]
    rows = [["a", 0.8, 900, 0.2, 100], ["zipvl-64", 0.667, 900, 0.3, 100]]
    u = {
        "a": Unparsed(TaskUnparsed(0, 900), TaskUnparsed(2, 100)),
        "zipvl-64": Unparsed(TaskUnparsed(900, 900, ("inNo",)), TaskUnparsed(0, 100)),
    }
    h, r = with_unparsed(header, rows, u)
    assert h == ["variant", "mean F1", "n POPE", "POPE unparsed", "CHAIR_i", "n CHAIR", "CHAIR degenerate"]
    assert r[0][3] == "0/900" and r[0][6] == "2/100 (2.0%)"
    assert r[1][3] == "900/900 (100.0%) not ranked" and r[1][6] == "0/100"
    assert with_unparsed(h, r, u) == (h, r)  # idempotent
    assert any(
        n.startswith("zipvl-64: 900/900 (100.0%) POPE answers neither yes nor no") and "'inNo'" in n
        for n in unparsed_notes(u)
    )


def test_unparsed_cell_over_the_limit_never_reads_as_at_the_limit():
    """A share just over the 5% limit (451 of 9000 POPE answers: 5.011%) is not ranked; its cell must not
    print 5.0%, which is what an exactly-5% (ranked) task prints."""
    from mmfast.bench.render import unparsed_cell
    from mmfast.eval.unparsed import TaskUnparsed

    assert unparsed_cell(TaskUnparsed(100, 2000)) == "100/2000 (5.0%)"  # at the limit: ranked
    assert unparsed_cell(TaskUnparsed(451, 9000)) == "451/9000 (5.01%) not ranked"
    assert unparsed_cell(TaskUnparsed(151, 3000)) == "151/3000 (5.03%) not ranked"
    assert unparsed_cell(TaskUnparsed(1501, 30000)) == "1501/30000 (5.003%) not ranked"
    assert unparsed_cell(TaskUnparsed(101, 2000)) == "101/2000 (5.1%) not ranked"  # one decimal when it shows


def test_runs_with_the_same_folder_name_keep_their_own_sections_plots_and_rows(tmp_path):
    """Two benches both called ``bench_dec`` (one under cpu/, one under gpu/) and two eval runs both called
    ``run``: each is labelled by the shortest path tail that tells it apart, and no plot overwrites another."""
    from mmfast.report import run_labels

    cpu = _bench_dir(tmp_path / "cpu", [("baseline", 0.9), ("vcd", 0.8)])
    gpu = _bench_dir(tmp_path / "gpu", [("baseline", 0.7), ("vcd", 0.6)])
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    a, _ = _pope_run(tmp_path / "a", "run", 0.9)
    b, _ = _pope_run(tmp_path / "b", "run", 0.6)
    assert run_labels([cpu, gpu, a, b]) == ["cpu/bench_dec", "gpu/bench_dec", "a/run", "b/run"]
    assert run_labels([cpu, a]) == ["bench_dec", "run"]
    out = tmp_path / "rep"
    md = write_report([str(cpu), str(gpu), str(a), str(b)], str(out)).read_text()
    assert "## Benchmark: cpu/bench_dec" in md and "## Benchmark: gpu/bench_dec" in md
    assert "| a/run |" in md and "| b/run |" in md
    images = re.findall(r"\]\((.*?\.png)\)", md)
    assert len(images) == len(set(images)) and all((out / i).is_file() for i in images)
    assert {"cpu_bench_dec_chair_i_vs_recall.png", "gpu_bench_dec_chair_i_vs_recall.png"} <= set(images)


def test_pruning_report_names_the_model_of_every_timing_and_flags_cold_single_runs(tmp_path):
    """results.md's timing columns say which model they come from, the slice's column carries the
    same label and the same figures as speed_shaped.md, and a timing that is not the median of >= 5
    warm repeats is flagged (the Qwen slice bench was committed from one cold run)."""
    from mmfast.bench.pruning import write_pruning_report

    def variant(name, tokens, prefill, slice_speedup):
        return {
            "metrics": {"pope": {"mean_f1": 0.8}},
            "accounting": {"vision_tokens_layer_avg": tokens},
            "ratios": {"prefill_speedup": prefill},
            "pruning": [],
        }

    result = {
        "header": ["variant", "layer-avg tok", "mean F1", "prefill x", "e2e x", "scoring ovh"],
        "rows": [["baseline", 576.0, 0.8, 1.0, 1.0, 0.0], ["random-64", 64.0, 0.7, 1.49, 1.2, 0.01]],
        "results": {
            "baseline": variant("baseline", 576.0, 1.0, 1.0),
            "random-64": variant("random-64", 64.0, 1.49, 3.47),
        },
        "shaped_speed": {
            "shape": "qwen2.5-vl-7b-slice",
            "skipped": [],
            "warmup": 0,
            "repeats": 1,
            "rows": [
                {
                    "variant": "baseline",
                    "vision_tokens": 999,
                    "layer_avg_tokens": 999,
                    "prefill_s": 15.3,
                    "vision_s": 49.0,
                    "speedup": 1.0,
                    "e2e_speedup": 1.0,
                    "flops_ratio": 1.0,
                    "flops": 1.0,
                },
                {
                    "variant": "random-64",
                    "vision_tokens": 111,
                    "layer_avg_tokens": 111,
                    "prefill_s": 4.41,
                    "vision_s": 58.6,
                    "speedup": 3.469,
                    "e2e_speedup": 1.02,
                    "flops_ratio": 0.162,
                    "flops": 0.162,
                },
            ],
        },
        "timing_protocol": {"warmup": 1, "repeats": 5, "samples": 8},
        "model": {"name": "mmfast/tiny-world", "weights_fingerprint": "f"},
    }
    write_pruning_report(result, tmp_path, "mmfast bench x.yaml")
    md = (tmp_path / "results.md").read_text()
    head = next(line for line in md.splitlines() if line.startswith("| variant"))
    assert "| prefill x [embedded] | prefill x [qwen2.5-vl-7b-slice] | e2e x [embedded] |" in head
    assert "| random-64 |" in md and "| 1.490 | 3.469 |" in md
    assert "accuracy columns (POPE, CHAIR)" in md and "mmfast/tiny-world, LLaVA architecture" in md
    assert "qwen2.5-vl-7b-slice timings: median of 1 repeat(s) after 0 warmup run(s); NOT a reliable speed" in md
    assert "Timings on the embedded model ([embedded]): median of 5 repeat(s) after 1 warmup run(s)." in md
    report = write_report([str(tmp_path)], str(tmp_path / "rep")).read_text()  # the report labels them alike
    assert "| prefill x [embedded] | prefill x [qwen2.5-vl-7b-slice] | e2e x [embedded] |" in report
    shaped = (tmp_path / "speed_shaped.md").read_text()
    assert (
        "| prefill+vision speedup |" in shaped
        and "| prefill x [qwen2.5-vl-7b-slice] |" in shaped
        and "| 3.469 |" in shaped
    )
    assert "NOT a reliable speed" in shaped
    # a bench recorded before warmup/repeats were: its command line says what ran
    import copy

    legacy = copy.deepcopy(result)
    for key in ("warmup", "repeats"):
        legacy["shaped_speed"].pop(key)
    legacy.pop("timing_protocol")
    for r in legacy["results"].values():
        r.pop("intervals", None), r.pop("unparsed", None)
    write_pruning_report(legacy, tmp_path, "mmfast bench x.yaml --set bench.warmup=0 --set bench.repeats=1")
    md = (tmp_path / "results.md").read_text()
    assert "qwen2.5-vl-7b-slice timings: median of 1 repeat(s) after 0 warmup run(s); NOT a reliable speed" in md
    assert "Timings on the embedded model ([embedded]): median of 1 repeat(s) after 0 warmup run(s); NOT" in md


def test_eval_metrics_table_shows_unparsed_answers():
    from mmfast.report import metrics_table

    table = metrics_table(
        {
            "pope": {
                "random": {"f1": 0.667, "accuracy": 0.5, "yes_ratio": 1.0, "n": 100, "n_unknown": 100},
                "mean_f1": 0.667,
                "n": 100,
            },
            "chair": {"chair_s": 0.6, "chair_i": 0.21, "recall": 0.55, "n": 50, "n_degenerate": 7},
        }
    )
    assert "unparsed 100" in next(line for line in table.splitlines() if line.startswith("pope random"))
    assert "degenerate 7" in next(line for line in table.splitlines() if line.startswith("chair"))


def test_sixteen_plot_series_all_look_different(tmp_path, monkeypatch):
    """The pruning plot has 16 method families; matplotlib's 10 default colours drew DivPrune and VisionZip alike."""
    import matplotlib.axes

    from mmfast.bench.plots import labelled_points, scatter_lines

    drawn = []
    plot, errorbar = matplotlib.axes.Axes.plot, matplotlib.axes.Axes.errorbar

    def record(self, *args, **kwargs):
        lines = plot(self, *args, **kwargs)
        drawn.extend((ln.get_label(), ln.get_color(), ln.get_marker(), ln.get_linestyle()) for ln in lines)
        return lines

    def record_points(self, *args, **kwargs):
        c = errorbar(self, *args, **kwargs)
        drawn.append((kwargs["label"], c.lines[0].get_color(), c.lines[0].get_marker(), "points"))
        return c

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", record)
    names = [f"method{i:02d}" for i in range(16)]
    assert scatter_lines(
        tmp_path / "a.png",
        [(f"{n}-{k}", k, i + k / 1000) for i, n in enumerate(names) for k in (64, 128)],
        "tokens",
        "F1",
        "t",
    )
    lines = [d for d in drawn if d[0] in names]
    assert len(lines) == 16 and len({d[1:] for d in lines}) == 16
    drawn.clear()
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", plot)
    monkeypatch.setattr(matplotlib.axes.Axes, "errorbar", record_points)
    assert labelled_points(tmp_path / "b.png", [(n, i, i, None, None) for i, n in enumerate(names)], "x", "y", "t")
    assert len(drawn) == 16 and len({d[1:3] for d in drawn}) == 16


# video_pope: 5 clips, one yes- and one no-question per clip and split; "inNo" is read by no rule
# (the official one defaults it to "yes")
_VIDEO_ANSWERS = {
    "random": ["Yes", "No", "Yes", "Yes", "No", "No", "inNo", "No", "inNo", "inNo"],
    "adversarial": ["Yes", "Yes", "No", "No", "Yes", "No", "Yes", "Yes", "No", "No"],
}
_VIDEO_LABELS = ["yes", "no"] * 5


def _video_pope_records() -> list[dict]:
    return [
        {
            "doc_id": f"video_pope_{split}/{i}",
            "task": f"video_pope_{split}",
            "video": f"clip_{i // 2}",
            "target": _VIDEO_LABELS[i],
            "resps": [[answer]],
            "meta": {"question_id": i},
        }
        for split, answers in _VIDEO_ANSWERS.items()
        for i, answer in enumerate(answers)
    ]


def _video_pope_run(tmp_path, name: str = "vpope"):
    """A run directory of the video_pope task: its records and the summary the task writes from them."""
    from types import SimpleNamespace

    from mmfast.eval.tasks.video_pope import VideoPopeTask

    records = _video_pope_records()
    task = SimpleNamespace(questions=dict.fromkeys(_VIDEO_ANSWERS), options=SimpleNamespace(parser="pope"))
    by_task = {t: [r for r in records if r["task"] == t] for t in {r["task"] for r in records}}
    metrics = VideoPopeTask.metrics(task, by_task)
    run = tmp_path / name
    run.mkdir()
    (run / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = {
        "metrics": {"video_pope": metrics},
        "accounting": {"mean_n_vision_tokens": 32.0, "mean_vision_tokens_layer_avg": 32.0},
        "protocol": {"pruning": [], "decoding": {"method": "greedy", "params": {}}, "weights_fingerprint": "vvvv"},
    }
    (run / "summary.json").write_text(json.dumps(summary))
    return run, metrics


def _wilson(k: int, n: int) -> str:
    z = 1.959963984540054
    p, d = k / n, 1 + z * z / n
    c, h = (p + z * z / (2 * n)) / d, z * (p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5 / d
    return f"[{max(0.0, c - h):.3f}, {min(1.0, c + h):.3f}]"


def test_report_has_a_video_pope_table_with_intervals_and_unparsed_answers(tmp_path):
    run, metrics = _video_pope_run(tmp_path)
    write_report([str(run)], str(tmp_path / "rep"))
    md = (tmp_path / "rep" / "report.md").read_text()
    lines = md.splitlines()
    at = lines.index("## Video POPE (video_pope)")
    assert lines[at + 2] == (
        "| run | split | n | F1 [95% CI] | accuracy [95% CI] | precision [95% CI] | recall [95% CI] | yes ratio | unparsed |"
    )
    rows = {ln.split(" | ")[1]: ln for ln in lines[at + 4 : at + 7]}
    official = {"Yes": "yes", "No": "no", "inNo": "yes"}  # the official rule; "inNo" falls through to "yes"
    for split, answers in _VIDEO_ANSWERS.items():
        pred = [official[a] for a in answers]
        tp = sum(p == t == "yes" for p, t in zip(pred, _VIDEO_LABELS))
        tn = sum(p == t == "no" for p, t in zip(pred, _VIDEO_LABELS))
        fp = sum(p == "yes" and t == "no" for p, t in zip(pred, _VIDEO_LABELS))
        fn = sum(p == "no" and t == "yes" for p, t in zip(pred, _VIDEO_LABELS))
        prec, rec = tp / (tp + fp), tp / (tp + fn)
        f1 = 2 * prec * rec / (prec + rec)
        k = answers.count("inNo")
        unparsed = f"{k}/10" + (f" ({10 * k:.1f}%)" if k else "")
        f1_ci = metrics[split]["f1_ci95"]  # the clips' bootstrap, as the summary recorded it
        assert rows[split] == (
            f"| vpope | {split} | 10 | {f1:.3f} [{f1_ci[0]:.3f}, {f1_ci[1]:.3f}] | {(tp + tn) / 10:.3f} "
            f"{_wilson(tp + tn, 10)} | {prec:.3f} {_wilson(tp, tp + fp)} | {rec:.3f} {_wilson(tp, tp + fn)} | "
            f"{pred.count('yes') / 10:.3f} | {unparsed} |"
        )
    assert (tp, fp, tn, fn) == (3, 2, 3, 2)  # the adversarial split (a hand count of the answers above)
    mean_f1 = (metrics["random"]["f1"] + metrics["adversarial"]["f1"]) / 2
    assert rows["mean"].startswith(f"| vpope | mean | 20 | {mean_f1:.3f} [")
    assert rows["mean"].endswith("|  |  |  | 3/20 (15.0%) not ranked |")  # 3 of 20 > 5%
    assert "no model shipped with mmfast saw video" in md and "not a result" in md
    # the runs table: the run is there, without image POPE figures
    run_row = next(ln for ln in lines if ln.startswith("| vpope |") and "greedy" in ln)
    assert run_row.count("|") == len(EVAL_HEADER) + 1


def test_report_counts_video_pope_unparsed_from_the_summary_without_records(tmp_path):
    run, metrics = _video_pope_run(tmp_path)
    (run / "samples.jsonl").unlink()
    write_report([str(run)], str(tmp_path / "rep"))
    md = (tmp_path / "rep" / "report.md").read_text()
    assert metrics["unparsed"]["k"] == 3
    assert "| vpope | random | 10 |" in md and "| 3/20 (15.0%) not ranked |" in md


def test_eval_metrics_table_shows_video_pope_with_its_unparsed_answers(tmp_path):
    from mmfast.report import metrics_table

    _, metrics = _video_pope_run(tmp_path)
    table = metrics_table({"video_pope": metrics}).splitlines()
    random = next(line for line in table if line.startswith("video_pope random"))
    d = metrics["random"]
    for label, key in (("F1", "f1"), ("acc", "accuracy"), ("prec", "precision"), ("rec", "recall")):
        assert f"{label} {d[key]:.3f} [{d[key + '_ci95'][0]:.3f}, {d[key + '_ci95'][1]:.3f}]" in random
    assert f"yes {d['yes_ratio']:.3f}" in random
    unparsed = next(line for line in table if line.startswith("video_pope unparsed"))
    assert unparsed.split()[2:] == ["20", "3/20", "(15.0%)", "not", "ranked"]
    assert "not a result" in table[-1]


def test_bench_table_counts_video_pope_unparsed_answers(tmp_path):
    from mmfast.bench.render import unparsed_notes, variant_unparsed, with_unparsed
    from mmfast.eval.unparsed import Unparsed

    for name, records in (("a", []), ("v", _video_pope_records())):
        d = tmp_path / "variants" / name
        d.mkdir(parents=True)
        image = [{"doc_id": "pope_random/1", "task": "pope_random", "target": "yes", "resps": [["Yes"]]}]
        (d / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in image + records))
    u = variant_unparsed(tmp_path, {"a": {"metrics": {}}, "v": {"metrics": {}}})
    assert u["a"].video_pope is None and u["v"].video_pope.cell() == "3/20 (15.0%)"
    assert u["v"].pope.cell() == "0/1"  # the image POPE answers are counted apart
    assert Unparsed.from_dict(u["v"].as_dict()) == u["v"]
    h, r = with_unparsed(["variant", "mean F1", "n POPE"], [["a", 0.8, 1], ["v", 0.8, 1]], u)
    assert h == ["variant", "mean F1", "n POPE", "POPE unparsed", "video POPE unparsed"]
    assert r[0][4] == "" and r[1][4] == "3/20 (15.0%) not ranked"
    assert with_unparsed(h, r, u) == (h, r)  # idempotent
    notes = unparsed_notes(u)
    assert any("not a result" in n for n in notes)
    assert any(n.startswith("v: 3/20 (15.0%) video POPE answers neither yes nor no") for n in notes)


def _scored_pope_run(tmp_path, name):
    """A finished eval run as ``mmfast eval`` leaves it: records with fingerprints, the scored ones first,
    and a summary naming them (``counts``, ``protocol.samples_digest``)."""
    from mmfast.eval.records import digest_of

    run, pope = _pope_run(tmp_path, name, 0.85)
    recs = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    for i, r in enumerate(recs):
        r["fingerprint"] = f"{i:024x}"
    (run / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    summary = json.loads((run / "summary.json").read_text())
    summary["counts"] = {"planned": len(recs), "finished": len(recs), "failed": 0, "not_run": 0}
    summary["protocol"]["samples_digest"] = digest_of(r["fingerprint"] for r in recs)
    (run / "summary.json").write_text(json.dumps(summary))
    return run, recs


def test_report_reads_a_run_whose_last_line_was_cut_inside_a_character(tmp_path):
    """A run killed while writing a record cuts its line anywhere, also inside a multi-byte UTF-8 character
    (records are written with ensure_ascii=False): the report skips that line, as any cut line."""
    from mmfast.eval.intervals import read_records

    run, recs = _scored_pope_run(tmp_path, "torn")
    with open(run / "samples.jsonl", "ab") as fh:
        fh.write('{"doc_id": "pope_random/0", "resps": [["Oui, il y a un caf\u00e9'.encode()[:-1])
    assert len(read_records(run)) == len(recs)
    md = write_report([str(run)], str(tmp_path / "rep")).read_text()
    row = next(ln for ln in md.splitlines() if ln.startswith("| torn"))
    assert row.split("|")[9].strip() == "120" and row.split("|")[10].strip() == "0/120"


def test_report_reads_the_scored_records_of_a_run_resumed_and_stopped_before_its_end(tmp_path, caplog):
    """A finished run is resumed (a question or image changed under the same path), recomputes a scored
    sample and is stopped before it finishes: its summary is still the first run's, so the report reads the
    records that summary scored (the first lines), not the newer one appended after them."""
    from mmfast.eval.intervals import read_records

    run, recs = _scored_pope_run(tmp_path, "resumed")
    newer = {**recs[0], "fingerprint": "f" * 24, "resps": [["inNo"]]}  # not a yes or a no
    with open(run / "samples.jsonl", "a") as fh:
        fh.write(json.dumps(newer) + "\n")
    assert read_records(run) == recs
    assert "do not match" not in caplog.text
    md = write_report([str(run)], str(tmp_path / "rep")).read_text()
    row = next(ln for ln in md.splitlines() if ln.startswith("| resumed"))
    assert row.split("|")[10].strip() == "0/120"


def test_report_says_which_runs_are_incomplete(tmp_path):
    """A run accepted with failures (eval.max_failures, --allow-failures) or with samples not run read as complete in
    the report (its table row has no such column); a note names it and its counts. A complete run gets none."""
    full = _eval_summary(tmp_path, "full", 64, 0.8, 0.1)
    part = _eval_summary(tmp_path, "part", 64, 0.8, 0.1)
    for run, counts in (
        (full, {"planned": 10, "finished": 10, "failed": 0, "not_run": 0}),
        (part, {"planned": 10, "finished": 7, "failed": 2, "not_run": 1}),
    ):
        s = json.loads((run / "summary.json").read_text())
        (run / "summary.json").write_text(json.dumps({**s, "counts": counts}))
    md = write_report([str(full), str(part)], str(tmp_path / "rep")).read_text()
    assert "**part is incomplete**: of its 10 planned samples 2 failed and 1 not run" in md
    assert "the 7 finished ones" in md and "full is incomplete" not in md


@pytest.mark.parametrize("name", ["speculative", "speculative_h100"])
def test_committed_speculative_results_are_what_rerender_writes(tmp_path, name):
    """A committed speculative bench's results.md is what ``mmfast rerender`` writes today from its
    summary.json (its notes included): a renderer change re-renders the committed tables with it."""
    import shutil
    from pathlib import Path

    src = Path(__file__).resolve().parents[1] / "benchmarks" / name
    bench = tmp_path / name
    shutil.copytree(src, bench, ignore=shutil.ignore_patterns("*.png"))
    assert main(["-q", "rerender", str(bench)]) == 0
    assert (bench / "results.md").read_text() == (src / "results.md").read_text()


@pytest.mark.parametrize("kind", ["gpu_speed", "video_cost"])
def test_report_refuses_a_bench_it_cannot_render(tmp_path, kind):
    """A gpu_speed / video_cost bench (rows, no results) was read as an eval run: an empty 'greedy()' row."""
    a = _eval_summary(tmp_path, "fastv-64", 64, 0.8, 0.12)
    b = tmp_path / kind
    b.mkdir()
    (b / "summary.json").write_text(json.dumps({"kind": kind, "device": "cpu", "dtype": "float32", "rows": []}))
    with pytest.raises(InputError, match=f"{kind} bench"):
        write_report([str(a), str(b)], str(tmp_path / "report"))
    assert not (tmp_path / "report").exists()
