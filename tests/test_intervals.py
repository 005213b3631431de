"""95% intervals (mmfast.eval.intervals): Wilson against its closed form, bootstrap reproducible and
centred on the tasks' own metrics, summaries and old run directories carrying n and intervals."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from mmfast.eval.intervals import (
    CaptionCounts,
    chair_intervals,
    pope_cells,
    pope_intervals,
    read_records,
    run_intervals,
    wilson,
)
from mmfast.eval.pope import PopeRecord, score_pope, summarize_pope


def test_wilson_matches_the_closed_form():
    # Wilson (1927) / Agresti & Coull (1998): 81 of 263 -> [0.2553, 0.3662] (z = 1.96)
    iv = wilson(81, 263)
    assert iv.estimate == pytest.approx(81 / 263)
    assert iv.lo == pytest.approx(0.2553, abs=1e-4) and iv.hi == pytest.approx(0.3662, abs=1e-4)
    for k, n in [(0, 10), (10, 10), (3, 7), (91, 200)]:
        p, z = k / n, 1.959963984540054
        c = (p + z * z / (2 * n)) / (1 + z * z / n)
        h = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
        got = wilson(k, n)
        assert got.lo == pytest.approx(max(0, c - h), abs=1e-12) and got.hi == pytest.approx(min(1, c + h), abs=1e-12)
        assert got.contains(p) and got.n == n
    assert wilson(0, 0).as_list() == [0.0, 0.0]
    with pytest.raises(ValueError):
        wilson(5, 3)


def _pope_records(rng, n, p_correct, answer_yes="Yes", answer_no="No"):
    recs = []
    for i in range(n):
        label = "yes" if i % 2 == 0 else "no"
        right = rng.random() < p_correct
        pred_yes = (label == "yes") == right
        text = answer_yes if pred_yes else answer_no
        if i % 37 == 0:
            text = "I cannot tell"  # no yes/no word: the parser's default
        recs.append({"doc_id": f"q{i}", "target": label, "resps": [[text]], "meta": {"question_id": i}})
    return recs


@pytest.mark.parametrize("mode", ["pope", "lmms"])
def test_pope_point_estimates_are_the_task_metrics(mode):
    rng = np.random.default_rng(1)
    splits = {s: _pope_records(rng, 150, p) for s, p in [("random", 0.9), ("popular", 0.8), ("adversarial", 0.7)]}
    scored = summarize_pope(
        {
            s: score_pope([PopeRecord(r["meta"]["question_id"], r["target"], r["resps"][0][0]) for r in rs], mode)
            for s, rs in splits.items()
        }
    )
    iv = pope_intervals({s: pope_cells(rs, mode) for s, rs in splits.items()})
    assert iv.mean_f1.estimate == pytest.approx(scored["mean_f1"], abs=1e-12)
    assert iv.mean_accuracy.estimate == pytest.approx(scored["mean_accuracy"], abs=1e-12)
    assert iv.n == 450
    for s in splits:
        m, si = scored[s], iv.splits[s]
        assert si.f1.estimate == pytest.approx(m["f1"], abs=1e-12)
        for k in ("accuracy", "precision", "recall", "f1"):
            got = getattr(si, k)
            assert got.estimate == pytest.approx(m[k], abs=1e-12) and got.contains(m[k]), (s, k)
            assert 0 <= got.lo < got.hi <= 1
    assert iv.mean_f1.contains(scored["mean_f1"])
    # the mean over three splits is tighter than one split of the three
    assert iv.mean_f1.hi - iv.mean_f1.lo < min(s.f1.hi - s.f1.lo for s in iv.splits.values())


def test_bootstrap_is_deterministic_given_the_seed_and_shrinks_with_n():
    cells = ["tp"] * 40 + ["fp"] * 8 + ["tn"] * 42 + ["fn"] * 10
    a, b = pope_intervals({"random": cells}), pope_intervals({"random": cells})
    assert a == b
    c = pope_intervals({"random": cells}, seed=1)
    assert c.splits["random"].f1 != a.splits["random"].f1
    assert c.splits["random"].f1.estimate == a.splits["random"].f1.estimate
    big = pope_intervals({"random": cells * 10})
    wa, wb = (x.splits["random"].f1 for x in (a, big))
    assert wb.hi - wb.lo < 0.5 * (wa.hi - wa.lo)
    # the bootstrap by hand: the same generator draws the same resamples (10 blocks of 1000)
    rng = np.random.default_rng(0)
    idx = np.concatenate([rng.integers(0, len(cells), size=(1000, len(cells))) for _ in range(10)])
    arr = np.array(cells)[idx]
    tp, fp, fn = ((arr == k).sum(1) for k in ("tp", "fp", "fn"))
    f1 = 2 * tp / (2 * tp + fp + fn)
    assert [wa.lo, wa.hi] == pytest.approx(list(np.percentile(f1, [2.5, 97.5])), abs=1e-12)


def test_degenerate_bootstraps_fall_back_to_wilson():
    """6 of 6 right: every replicate is 1.0, and the percentile bootstrap's [1, 1] claims certainty.
    The fallback is Wilson of the pooled counts (F1 through the Jaccard index J = tp/(tp+fp+fn))."""
    six = pope_intervals(
        {s: ["tp", "tn"] for s in ("random", "popular", "adversarial")},
        {s: ["a.png", "a.png"] for s in ("random", "popular", "adversarial")},
    )
    w = wilson(6, 6)
    assert six.mean_accuracy.estimate == 1.0 and six.mean_accuracy.method == "wilson"
    assert six.mean_accuracy.as_list() == pytest.approx(w.as_list()) and six.mean_accuracy.lo < 0.7
    j = wilson(3, 3)  # 3 tp, no fp / fn over the splits
    assert six.mean_f1.as_list() == pytest.approx([2 * j.lo / (1 + j.lo), 1.0]) and six.mean_f1.lo < 1
    all_right = pope_intervals({"random": ["tp"] * 20 + ["tn"] * 20}).splits["random"]
    assert all_right.f1.estimate == 1.0 and all_right.f1.method == "wilson" and all_right.f1.hi == 1.0
    j = wilson(20, 20)
    assert all_right.f1.lo == pytest.approx(2 * j.lo / (1 + j.lo)) and all_right.f1.lo < 1
    never_yes = pope_intervals({"random": ["tn"] * 20 + ["fn"] * 20}).splits["random"]
    j = wilson(0, 20)  # 20 fn, no tp
    assert never_yes.f1.estimate == 0.0 and never_yes.f1.lo == 0.0 and never_yes.precision.n == 0
    assert never_yes.f1.hi == pytest.approx(2 * j.hi / (1 + j.hi)) and never_yes.f1.hi > 0
    # CHAIR_i with no hallucination at all: not [0, 0]
    clean = chair_intervals([CaptionCounts(3, 0, 4, 2)] * 10)
    assert clean.chair_i.method == "wilson" and clean.chair_i.as_list() == pytest.approx(wilson(0, 30).as_list())
    # a bootstrap with spread stays a bootstrap
    assert pope_intervals({"random": ["tp", "fn", "tn", "fp"] * 5}).mean_f1.method == "bootstrap"
    with pytest.raises(ValueError, match="unknown POPE cell"):
        pope_intervals({"random": ["tp", "yes"]})


def test_chair_intervals_against_direct_computation():
    rng = np.random.default_rng(3)
    caps = []
    for _ in range(120):
        m = int(rng.integers(0, 8))
        gt = int(rng.integers(1, 6))
        caps.append(CaptionCounts(m, int(rng.integers(0, m + 1)), gt, int(rng.integers(0, gt + 1))))
    iv = chair_intervals(caps)
    n_m = sum(c.mentions for c in caps)
    assert iv.chair_i.estimate == pytest.approx(sum(c.hallucinated for c in caps) / n_m)
    assert iv.recall.estimate == pytest.approx(sum(c.recalled for c in caps) / sum(c.gt_objects for c in caps))
    assert iv.chair_s.estimate == pytest.approx(sum(c.hallucinated > 0 for c in caps) / len(caps))
    assert iv.chair_s.as_list() == wilson(sum(c.hallucinated > 0 for c in caps), len(caps)).as_list()
    for k in ("chair_s", "chair_i", "recall"):
        assert getattr(iv, k).contains(getattr(iv, k).estimate) and getattr(iv, k).hi > getattr(iv, k).lo
    assert iv.n == 120 and iv.n_mentions == n_m
    assert chair_intervals(caps) == iv


def test_chair_task_metrics_carry_n_and_intervals(tmp_path):
    """The CHAIR task's summary entry: the old keys and values, plus the intervals of its captions."""
    pytest.importorskip("nltk")
    from mmfast.eval.chair import ChairEvaluator
    from mmfast.eval.tasks.chair import ChairTask

    task = ChairTask.__new__(ChairTask)
    task.evaluator = ChairEvaluator({1: ["dog", "person"], 2: ["car"], 3: ["cat"]})
    captions = {
        1: "A man walks a dog past a car.",
        2: "A red car next to a bus and a tree.",
        3: "A cat sleeps on a bed.",
    }
    recs = {"chair": [{"target": i, "resps": [[c]]} for i, c in captions.items()]}
    got = task.metrics(recs)
    plain = task.evaluator.evaluate([{"image_id": i, "caption": c} for i, c in captions.items()]).as_dict()
    assert {k: got[k] for k in plain} == plain
    for k in ("chair_s", "chair_i", "recall"):
        lo, hi = got[f"{k}_ci95"]
        assert lo <= got[k] <= hi
    assert got["n"] == 3 and got["n_mentions"] >= 5


def test_run_intervals_of_a_run_without_them(tmp_path):
    """A summary written before intervals existed: POPE intervals from its records (gzipped too)."""
    import gzip

    rng = np.random.default_rng(2)
    recs, per_split = [], {}
    for s in ("random", "popular"):
        rs = _pope_records(rng, 60, 0.85)
        for r in rs:
            r.update(doc_id=f"pope_{s}/{r['doc_id']}", task=f"pope_{s}")
        recs += rs
        per_split[s] = score_pope([PopeRecord(r["meta"]["question_id"], r["target"], r["resps"][0][0]) for r in rs])
    summary = {"metrics": {"pope": summarize_pope(per_split)}, "protocol": {"tasks": {"pope": {"parser": "pope"}}}}
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps(summary))
    recs.append({"doc_id": "pope_random/bad", "task": "pope_random", "error": "boom"})
    with gzip.open(run / "samples.jsonl.gz", "wt") as f:
        f.write("\n".join(json.dumps(r) for r in recs) + "\n")
    assert len(read_records(run)) == 120
    iv = run_intervals(run)
    lo, hi = iv.pope["mean_f1_ci95"]
    assert lo <= summary["metrics"]["pope"]["mean_f1"] <= hi and iv.pope["n"] == 120
    assert iv.chair is None and not iv.notes
    # records that do not reproduce the summary's figure give no interval, and say why
    summary["metrics"]["pope"]["mean_f1"] += 0.01
    (run / "summary.json").write_text(json.dumps(summary))
    iv = run_intervals(run)
    assert iv.pope is None and "differs" in iv.notes[0]


def test_chair_intervals_of_a_run_whose_recorded_methods_no_longer_validate(tmp_path):
    """A committed run recorded ``random`` with both ``fraction`` and a budget, which today's config refuses:
    its CHAIR is re-scored from the recipe's eval section alone, and the intervals of today's method are
    written (CHAIR_s by Wilson over its captions), the figures unchanged."""
    import shutil
    from pathlib import Path

    from mmfast.config import load_recipe
    from mmfast.errors import ConfigError
    from mmfast.eval.intervals import CI_METHOD, refresh_intervals

    run = tmp_path / "random-64"
    shutil.copytree(Path(__file__).resolve().parents[1] / "benchmarks/pruning/variants/random-64", run)
    before = json.loads((run / "summary.json").read_text())
    with pytest.raises(ConfigError, match="fraction"):
        load_recipe(before["protocol"]["recipe"])
    committed = dict(before["metrics"]["chair"])  # re-rendered: today's intervals
    assert committed["ci_method"] == CI_METHOD
    stale = json.loads(json.dumps(before))  # as the run recorded it: intervals of the retired method
    del stale["metrics"]["chair"]["ci_method"]
    stale["metrics"]["chair"]["chair_i_ci95"] = [0.1, 0.5]
    (run / "summary.json").write_text(json.dumps(stale))
    refresh_intervals(run)
    chair = json.loads((run / "summary.json").read_text())["metrics"]["chair"]
    assert chair["ci_method"] == CI_METHOD
    assert {k: chair[k] for k in ("chair_s", "chair_i", "recall", "n")} == {
        k: before["metrics"]["chair"][k] for k in ("chair_s", "chair_i", "recall", "n")
    }
    k = round(chair["chair_s"] * chair["n"])
    assert chair["chair_s_ci95"] == wilson(k, chair["n"]).as_list()
    assert chair["chair_i_ci95"] == committed["chair_i_ci95"] != [0.1, 0.5]


def test_paired_mean_f1_difference_against_direct_computation():
    """The point estimate is the difference of the two mean F1s; identical systems give exactly 0;
    two systems that differ on a handful of questions get a narrow paired interval even though their
    separate intervals overlap almost entirely; each replicate scores both systems on one draw."""
    from mmfast.eval.intervals import _f1_from_counts, paired_mean_f1_difference

    rng = np.random.default_rng(3)
    a = {s: pope_cells(_pope_records(rng, 200, 0.85), "pope") for s in ("random", "popular")}
    same = paired_mean_f1_difference(a, a)
    assert (same.estimate, same.lo, same.hi) == (0.0, 0.0, 0.0) and same.n == 400
    # b: a with 6 correct answers per split turned wrong
    b = {}
    for s, cells in a.items():
        cells = list(cells)
        flipped = 0
        for j, c in enumerate(cells):
            if c in ("tp", "tn") and flipped < 6:
                cells[j] = "fn" if c == "tp" else "fp"
                flipped += 1
        b[s] = cells
    d = paired_mean_f1_difference(a, b)
    assert math.isclose(
        d.estimate, pope_intervals(a).mean_f1.estimate - pope_intervals(b).mean_f1.estimate, abs_tol=1e-12
    )
    assert 0 < d.lo <= d.estimate <= d.hi
    sep_a, sep_b = pope_intervals(a).mean_f1, pope_intervals(b).mean_f1
    assert sep_b.hi > sep_a.lo  # unpaired: the intervals overlap; paired: the difference is clear
    # direct re-computation of the paired bootstrap: without images every question is its own unit
    # (splits in sorted order, one draw of all units, both systems scored on it)
    codes = {"tp": 0, "fp": 1, "tn": 2, "fn": 3, "unscored": 4}
    names = sorted(a)
    sizes = [len(a[s]) for s in names]
    ca, cb = (np.concatenate([[codes[c] for c in x[s]] for s in names]) for x in (a, b))
    split_of = np.repeat(np.arange(len(names)), sizes)
    gen = np.random.default_rng(0)
    idx = np.concatenate([gen.integers(0, len(ca), size=(1000, len(ca))) for _ in range(10)])
    f = []
    for c in (ca, cb):
        per = [
            _f1_from_counts(*(((c[idx] == k) & (split_of[idx] == j)).sum(axis=1) for k in (0, 1, 3)))
            for j in range(len(names))
        ]
        f.append(np.mean(per, axis=0))
    lo, hi = np.percentile(f[0] - f[1], [2.5, 97.5])
    assert math.isclose(d.lo, lo, abs_tol=1e-12) and math.isclose(d.hi, hi, abs_tol=1e-12)
    with pytest.raises(ValueError, match="same"):
        paired_mean_f1_difference(a, {"random": a["random"]})


def _shared_image_splits(n_images=40, seed=5):
    """Three POPE splits over the same images, 3 positive + 3 negative questions per image and split;
    the positive questions (and so their answers) are the same in every split, as in POPE."""
    rng = np.random.default_rng(seed)
    cells, units = (
        {s: [] for s in ("random", "popular", "adversarial")},
        {s: [] for s in ("random", "popular", "adversarial")},
    )
    for i in range(n_images):
        hard = rng.random() < 0.3  # an image the model gets wrong more often, in every split
        pos = ["tp" if rng.random() < (0.5 if hard else 0.9) else "fn" for _ in range(3)]
        for s, p_fp in (("random", 0.05), ("popular", 0.15), ("adversarial", 0.3)):
            neg = ["fp" if rng.random() < p_fp * (2 if hard else 1) else "tn" for _ in range(3)]
            cells[s] += pos + neg
            units[s] += [f"img{i}.png"] * 6
    return cells, units


def test_pope_mean_f1_interval_matches_scipy_bootstrap_over_images():
    """The interval of the mean F1 is scipy.stats.bootstrap's percentile interval with the image as the
    unit (all its questions of all splits resampled together); resampling questions within each split
    instead (the old method) is far narrower on splits that share their positive answers."""
    stats = pytest.importorskip("scipy.stats")
    from mmfast.eval.intervals import _f1_from_counts

    cells, units = _shared_image_splits()
    iv = pope_intervals(cells, units)
    codes = {"tp": 0, "fp": 1, "tn": 2, "fn": 3}
    per_image = np.zeros((40, 3, 4))  # [image, split, cell]
    for j, s in enumerate(cells):
        for c, u in zip(cells[s], units[s]):
            per_image[int(u[3:-4]), j, codes[c]] += 1

    def mean_f1(idx):
        c = per_image[idx.astype(int)].sum(axis=0)  # [split, cell]
        return float(np.mean(_f1_from_counts(c[:, 0], c[:, 1], c[:, 3])))

    assert iv.mean_f1.estimate == pytest.approx(mean_f1(np.arange(40)), abs=1e-12)
    ref = stats.bootstrap(
        (np.arange(40),),
        mean_f1,
        vectorized=False,
        n_resamples=10_000,
        method="percentile",
        rng=np.random.default_rng(123),
    ).confidence_interval
    assert iv.mean_f1.method == "bootstrap" and iv.n_units == 40 and iv.n == 720
    assert iv.mean_f1.lo == pytest.approx(ref.low, abs=0.006) and iv.mean_f1.hi == pytest.approx(ref.high, abs=0.006)
    by_question = pope_intervals(cells)  # every question its own unit, splits independent
    assert by_question.n_units == 720
    assert (by_question.mean_f1.hi - by_question.mean_f1.lo) < 0.75 * (iv.mean_f1.hi - iv.mean_f1.lo)


def test_paired_difference_resamples_images_jointly():
    """Paired margins draw images once for both systems and all splits: the same as scipy's paired
    bootstrap of the per-image counts of both systems, and wider than a per-question draw."""
    stats = pytest.importorskip("scipy.stats")
    from mmfast.eval.intervals import _f1_from_counts, paired_mean_f1_difference

    a, units = _shared_image_splits(seed=5)
    b, _ = _shared_image_splits(seed=6)
    d = paired_mean_f1_difference(a, b, units)
    codes = {"tp": 0, "fp": 1, "tn": 2, "fn": 3}
    names = sorted(a)
    per_image = np.zeros((40, 2, 3, 4))
    for k, x in enumerate((a, b)):
        for j, s in enumerate(names):
            for c, u in zip(x[s], units[s]):
                per_image[int(u[3:-4]), k, j, codes[c]] += 1

    def diff(idx):
        c = per_image[idx.astype(int)].sum(axis=0)  # [system, split, cell]
        f1 = _f1_from_counts(c[..., 0], c[..., 1], c[..., 3]).mean(axis=-1)
        return float(f1[0] - f1[1])

    assert d.estimate == pytest.approx(diff(np.arange(40)), abs=1e-12)
    ref = stats.bootstrap(
        (np.arange(40),), diff, vectorized=False, n_resamples=10_000, method="percentile", rng=np.random.default_rng(7)
    ).confidence_interval
    assert d.lo == pytest.approx(ref.low, abs=0.006) and d.hi == pytest.approx(ref.high, abs=0.006)
    loose = paired_mean_f1_difference(a, b)
    assert (loose.hi - loose.lo) < 0.85 * (d.hi - d.lo)


def test_unparsed_answers_are_counted_by_the_official_rule_and_degenerate_captions_flagged():
    from mmfast.eval.unparsed import count_unparsed, degenerate_caption, pope_unparsed

    for bad in ("inNo", "inYes", "in theNo", "", "No!", "I can't tell", "A living room has a living room."):
        assert pope_unparsed(bad), bad
    for good in ("Yes", "No", "yes, there is a dog.", "No, there is not.", "There is no dog"):
        assert not pope_unparsed(good), good
    assert degenerate_caption("") == "empty" and degenerate_caption("  ... !") == "no words"
    assert degenerate_caption("This is a bedroom. You can You can You can see a bed.").startswith(
        "repetition loop ('you can'"
    )
    assert degenerate_caption("a red red red vase") is not None
    real = (
        "This is a photo of a dining room. You can see a woman dressed in green on the left and a white keyboard "
        "in the bottom left corner. There is also a white cup in the bottom left corner and a small knife"
    )
    assert degenerate_caption(real) is None
    recs = (
        [{"task": "pope_random", "resps": [["inNo"]]}] * 6
        + [{"task": "pope_random", "resps": [["Yes"]]}] * 94
        + [{"task": "chair", "resps": [["A dog. A dog. A dog."]]}, {"task": "chair", "resps": [[real]]}]
    )
    u = count_unparsed(recs)
    assert (u.pope.k, u.pope.n, u.pope.examples) == (6, 100, ("inNo",)) and u.pope.over_limit
    assert (u.chair.k, u.chair.n) == (1, 2) and u.chair.over_limit
    assert u.pope.cell() == "6/100 (6.0%)" and any("POPE answers neither yes nor no" in r for r in u.reasons())
    yes = {"task": "pope_random", "resps": [["Yes"]]}
    assert count_unparsed(recs[:5] + [yes] * 94).pope.over_limit  # 5 of 99: 5.05%
    assert not count_unparsed(recs[:5] + [yes] * 95).pope.over_limit  # 5 of 100: 5% is the limit
    assert count_unparsed([]).pope is None and type(u).from_dict(u.as_dict()) == u
