"""95% intervals for the accuracy and hallucination figures, from per-sample records.

* **Proportions** (POPE accuracy, precision, recall; CHAIR_s = the fraction of captions with a
  hallucinated object): the Wilson score interval, closed form.
* **Everything else** (POPE F1 per split, the POPE mean F1 over splits, CHAIR_i = hallucinated
  mentions / all mentions, CHAIR recall = recalled ground-truth objects / all ground-truth objects):
  a seeded percentile bootstrap (:data:`RESAMPLES` resamples, :data:`SEED`, numpy's PCG64). F1
  resamples the split's questions; the mean F1 resamples within every split independently, then
  averages the splits' F1 (the splits are separate question sets); CHAIR_i and recall resample
  captions and take the ratio of sums, as the point estimate does.

The point estimate of every interval is the metric as the task computes it (an undefined ratio is
0.0, as in :mod:`mmfast.eval.pope` and :mod:`mmfast.eval.chair`); with the same inputs, seed and
resample count an interval is reproduced exactly.
"""

from __future__ import annotations

import gzip
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

logger = logging.getLogger(__name__)

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile
RESAMPLES = 1000
SEED = 0
POPE_CELLS = ("tp", "fp", "tn", "fn", "unscored")
METHODS = {
    "wilson": "Wilson score interval (binomial proportion), z = 1.96",
    "bootstrap": f"percentile bootstrap, {RESAMPLES} resamples, numpy default_rng(seed {SEED})",
}
"""How each interval is computed, as a summary's protocol records it."""


@dataclass(frozen=True)
class Interval:
    """A point estimate with its 95% interval ``[lo, hi]``, the sample size ``n`` it rests on
    (questions, captions; for CHAIR_i the captions resampled) and how it was computed."""

    estimate: float
    lo: float
    hi: float
    n: int
    method: str  # "wilson" | "bootstrap"

    def as_list(self) -> list[float]:
        """``[lo, hi]`` as stored in ``summary.json`` (``<metric>_ci95``)."""
        return [self.lo, self.hi]

    def contains(self, value: float, tol: float = 1e-12) -> bool:
        return self.lo - tol <= value <= self.hi + tol


def wilson(k: int, n: int, z: float = Z95) -> Interval:
    """Wilson score interval for ``k`` successes in ``n`` trials (``[0, 0]`` when ``n`` is 0)."""
    if k < 0 or n < 0 or k > n:
        raise ValueError(f"wilson needs 0 <= k <= n, got k={k}, n={n}")
    if n == 0:
        return Interval(0.0, 0.0, 0.0, 0, "wilson")
    p = k / n
    z2 = z * z
    denom = 1 + z2 / n
    center = (p + z2 / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return Interval(p, max(0.0, center - half), min(1.0, center + half), n, "wilson")


def _percentile(stats: np.ndarray) -> tuple[float, float]:
    lo, hi = np.percentile(stats, [2.5, 97.5])
    return float(lo), float(hi)


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _safe_ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """num / den elementwise, 0.0 where den is 0 (the tasks' convention for an undefined ratio)."""
    out = np.zeros(np.broadcast(num, den).shape, dtype=float)
    np.divide(num, den, out=out, where=den != 0)
    return out


def _f1_from_counts(tp: np.ndarray, fp: np.ndarray, fn: np.ndarray) -> np.ndarray:
    prec = _safe_ratio(tp, tp + fp)
    rec = _safe_ratio(tp, tp + fn)
    return _safe_ratio(2 * prec * rec, prec + rec)


def _cell_codes(cells: Sequence[str]) -> np.ndarray:
    index = {c: i for i, c in enumerate(POPE_CELLS)}
    try:
        return np.fromiter((index[c] for c in cells), dtype=np.int64, count=len(cells))
    except KeyError as exc:
        raise ValueError(f"unknown POPE cell {exc.args[0]!r}; expected one of {POPE_CELLS}") from None


def _resampled_counts(codes: np.ndarray, rng: np.random.Generator, resamples: int) -> np.ndarray:
    """(resamples, 5) confusion counts of ``resamples`` with-replacement resamples of the questions."""
    n = len(codes)
    idx = rng.integers(0, n, size=(resamples, n))
    picked = codes[idx]
    return np.stack([(picked == i).sum(axis=1) for i in range(len(POPE_CELLS))], axis=1)


def _counts(codes: np.ndarray) -> np.ndarray:
    return np.bincount(codes, minlength=len(POPE_CELLS))


@dataclass(frozen=True)
class PopeSplitIntervals:
    """One POPE split: Wilson intervals for accuracy, precision and recall, a bootstrap one for F1."""

    n: int
    accuracy: Interval
    precision: Interval
    recall: Interval
    f1: Interval

    def as_dict(self) -> dict[str, Any]:
        """The keys added next to the split's metrics: ``<metric>_ci95``."""
        return {f"{k}_ci95": getattr(self, k).as_list() for k in ("accuracy", "precision", "recall", "f1")}


@dataclass(frozen=True)
class PopeIntervals:
    """Every split's intervals and the bootstrap intervals of the unweighted means over splits."""

    splits: dict[str, PopeSplitIntervals]
    mean_f1: Interval
    mean_accuracy: Interval

    @property
    def n(self) -> int:
        """Questions over all splits."""
        return sum(s.n for s in self.splits.values())

    def as_dict(self) -> dict[str, Any]:
        """``{"<split>": {...}, "mean_f1_ci95", "mean_accuracy_ci95", "n"}`` (merged into the summary)."""
        out: dict[str, Any] = {name: s.as_dict() for name, s in self.splits.items()}
        out.update(mean_f1_ci95=self.mean_f1.as_list(), mean_accuracy_ci95=self.mean_accuracy.as_list(), n=self.n)
        return out


def pope_intervals(cells_by_split: Mapping[str, Sequence[str]], *, resamples: int = RESAMPLES,
                   seed: int = SEED) -> PopeIntervals:
    """Intervals from every question's confusion cell (``tp fp tn fn unscored``), by split.

    Splits are resampled in the given order from one seeded generator; the mean F1's replicate ``b``
    is the mean over splits of each split's F1 in its own replicate ``b``.
    """
    if not cells_by_split:
        raise ValueError("pope_intervals needs at least one split")
    rng = _rng(seed)
    splits: dict[str, PopeSplitIntervals] = {}
    f1_reps, acc_reps, f1_points, acc_points = [], [], [], []
    for name, cells in cells_by_split.items():
        codes = _cell_codes(cells)
        n = len(codes)
        if n == 0:
            raise ValueError(f"POPE split {name!r} has no questions")
        tp, fp, tn, fn, _ = (int(c) for c in _counts(codes))
        f1_point = float(_f1_from_counts(np.array(tp), np.array(fp), np.array(fn)))
        reps = _resampled_counts(codes, rng, resamples)
        f1_rep = _f1_from_counts(reps[:, 0], reps[:, 1], reps[:, 3])
        acc_rep = (reps[:, 0] + reps[:, 2]) / n
        lo, hi = _percentile(f1_rep)
        splits[name] = PopeSplitIntervals(
            n=n,
            accuracy=wilson(tp + tn, n),
            precision=wilson(tp, tp + fp),
            recall=wilson(tp, tp + fn),
            f1=Interval(f1_point, lo, hi, n, "bootstrap"),
        )
        f1_reps.append(f1_rep)
        acc_reps.append(acc_rep)
        f1_points.append(f1_point)
        acc_points.append((tp + tn) / n)
    total = sum(s.n for s in splits.values())
    mean_f1 = Interval(math.fsum(f1_points) / len(f1_points), *_percentile(np.mean(f1_reps, axis=0)), total, "bootstrap")
    mean_acc = Interval(math.fsum(acc_points) / len(acc_points), *_percentile(np.mean(acc_reps, axis=0)), total, "bootstrap")
    return PopeIntervals(splits, mean_f1, mean_acc)


def paired_mean_f1_difference(a_by_split: Mapping[str, Sequence[str]], b_by_split: Mapping[str, Sequence[str]], *,
                              resamples: int = RESAMPLES, seed: int = SEED) -> Interval:
    """POPE mean F1 of ``a`` minus that of ``b`` on the same questions, with a paired bootstrap interval.

    ``a_by_split[s][j]`` and ``b_by_split[s][j]`` are the confusion cells of the same question ``j``
    of split ``s`` under two systems. Replicate ``b`` draws one set of question indices per split and
    scores both systems on it (splits in sorted order), so the interval is that of the difference (two systems answering the
    same questions are correlated: their separate intervals overlap even when one is reliably better).
    """
    if set(a_by_split) != set(b_by_split) or not a_by_split:
        raise ValueError(f"paired POPE needs the same splits, got {sorted(a_by_split)} and {sorted(b_by_split)}")

    def f1_rows(picked: np.ndarray) -> np.ndarray:  # [R, n] cell codes -> [R] F1
        counts = np.stack([(picked == i).sum(axis=1) for i in range(len(POPE_CELLS))], axis=1)  # [R, 5]
        return _f1_from_counts(counts[:, 0], counts[:, 1], counts[:, 3])

    rng = _rng(seed)
    diff_reps, diff_points, total = [], [], 0
    for name in sorted(a_by_split):  # one draw order whatever order the splits come in
        a, b = _cell_codes(a_by_split[name]), _cell_codes(b_by_split[name])
        if len(a) != len(b) or len(a) == 0:
            raise ValueError(f"POPE split {name!r}: {len(a)} and {len(b)} questions; a paired difference needs the same non-empty set")
        idx = rng.integers(0, len(a), size=(resamples, len(a)))  # [R, n]: the same questions for both systems
        diff_reps.append(f1_rows(a[idx]) - f1_rows(b[idx]))
        diff_points.append(float(f1_rows(a[None])[0] - f1_rows(b[None])[0]))
        total += len(a)
    return Interval(math.fsum(diff_points) / len(diff_points), *_percentile(np.mean(diff_reps, axis=0)), total, "bootstrap")


def paired_pope_cells(a: Iterable[Mapping[str, Any]], b: Iterable[Mapping[str, Any]], mode: str) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """Both runs' POPE cells by split (``task`` ``pope_<split>``), on the questions both answered, in
    one order (by ``doc_id``): the input of :func:`paired_mean_f1_difference`."""
    by_a = {r["doc_id"]: r for r in a if str(r.get("task", "")).startswith("pope_")}
    by_b = {r["doc_id"]: r for r in b if str(r.get("task", "")).startswith("pope_")}
    common = sorted(set(by_a) & set(by_b))
    out_a: dict[str, list[str]] = {}
    out_b: dict[str, list[str]] = {}
    for doc in common:
        split = by_a[doc]["task"][len("pope_"):]
        out_a.setdefault(split, []).extend(pope_cells([by_a[doc]], mode))
        out_b.setdefault(split, []).extend(pope_cells([by_b[doc]], mode))
    return out_a, out_b


@dataclass(frozen=True)
class CaptionCounts:
    """What one caption contributes to CHAIR: object mentions, hallucinated mentions, ground-truth
    objects of its image and those the caption recalled."""

    mentions: int
    hallucinated: int
    gt_objects: int
    recalled: int


@dataclass(frozen=True)
class ChairIntervals:
    """CHAIR_s (Wilson over captions), CHAIR_i and recall (bootstrap over captions)."""

    n: int
    n_mentions: int
    n_gt_objects: int
    chair_s: Interval
    chair_i: Interval
    recall: Interval

    def as_dict(self) -> dict[str, Any]:
        """The keys added next to CHAIR's metrics."""
        return {"chair_s_ci95": self.chair_s.as_list(), "chair_i_ci95": self.chair_i.as_list(),
                "recall_ci95": self.recall.as_list(), "n_mentions": self.n_mentions, "n_gt_objects": self.n_gt_objects}


def chair_intervals(captions: Sequence[CaptionCounts], *, resamples: int = RESAMPLES, seed: int = SEED) -> ChairIntervals:
    """Intervals from every caption's counts; CHAIR_i and recall from the same resampled captions."""
    n = len(captions)
    if n == 0:
        raise ValueError("chair_intervals needs at least one caption")
    mentions = np.array([c.mentions for c in captions], dtype=np.int64)
    hall = np.array([c.hallucinated for c in captions], dtype=np.int64)
    gt = np.array([c.gt_objects for c in captions], dtype=np.int64)
    rec = np.array([c.recalled for c in captions], dtype=np.int64)
    rng = _rng(seed)
    idx = rng.integers(0, n, size=(resamples, n))
    ci_i = _percentile(_safe_ratio(hall[idx].sum(axis=1), mentions[idx].sum(axis=1)))
    ci_r = _percentile(_safe_ratio(rec[idx].sum(axis=1), gt[idx].sum(axis=1)))
    n_m, n_gt = int(mentions.sum()), int(gt.sum())
    return ChairIntervals(
        n=n, n_mentions=n_m, n_gt_objects=n_gt,
        chair_s=wilson(int((hall > 0).sum()), n),
        chair_i=Interval(float(hall.sum() / n_m) if n_m else 0.0, *ci_i, n, "bootstrap"),
        recall=Interval(float(rec.sum() / n_gt) if n_gt else 0.0, *ci_r, n, "bootstrap"),
    )


def caption_counts(result: Any) -> list[CaptionCounts]:
    """Per-caption counts of a :class:`mmfast.eval.chair.ChairResult` (its ``captions``)."""
    return [CaptionCounts(len(c.mentions), len(c.hallucinated), len(c.gt_objects), len(c.recalled)) for c in result.captions]


def pope_cells(records: Iterable[Mapping[str, Any]], mode: str) -> list[str]:
    """Every POPE record's confusion cell, by the task's parser (records as in ``samples.jsonl``)."""
    from .pope import pope_cell

    return [pope_cell(r["resps"][0][0], r["target"], mode) for r in records]


# ---------------------------------------------------------------------------------------------
# Intervals of a finished run directory
# ---------------------------------------------------------------------------------------------


def read_records(run: Path) -> list[dict[str, Any]]:
    """The successful records of a run: ``samples.jsonl`` or ``samples.jsonl.gz`` (``[]`` if neither)."""
    plain, packed = run / "samples.jsonl", run / "samples.jsonl.gz"
    if plain.is_file():
        lines = plain.read_text().splitlines()
    elif packed.is_file():
        with gzip.open(packed, "rt") as f:
            lines = f.read().splitlines()
    else:
        return []
    recs = []
    for line in lines:
        if line.strip():
            try:
                recs.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut off by a killed run: not a finished sample
                continue
    by_id = {r["doc_id"]: r for r in recs if "error" not in r}
    return list(by_id.values())


@dataclass(frozen=True)
class RunIntervals:
    """The intervals of one eval run, keyed as the summary's metrics: ``pope`` and ``chair`` hold the
    ``*_ci95`` keys (and counts) the tasks add; absent when not computable (reason in ``notes``)."""

    pope: dict[str, Any] | None
    chair: dict[str, Any] | None
    notes: tuple[str, ...] = ()


def _has_pope_ci(m: Mapping[str, Any]) -> bool:
    return "mean_f1_ci95" in m


def _has_chair_ci(m: Mapping[str, Any]) -> bool:
    return "chair_i_ci95" in m


def run_intervals(run: Path, summary: Mapping[str, Any] | None = None, *, chair_rescore: bool = True) -> RunIntervals:
    """Intervals of an eval run directory: from its ``summary.json`` when the tasks recorded them,
    else computed from its per-sample records (POPE by the recorded parser; CHAIR by re-scoring the
    captions against the run's ground truth, only when the re-scored CHAIR_i equals the recorded one).
    """
    run = Path(run)
    if summary is None:
        summary = json.loads((run / "summary.json").read_text())
    metrics = summary.get("metrics", {})
    pope_m, chair_m = metrics.get("pope") or {}, metrics.get("chair") or {}
    pope = {k: v for k, v in pope_m.items() if k.endswith("_ci95") or k == "n"} if _has_pope_ci(pope_m) else None
    if pope is not None:
        for split, v in pope_m.items():
            if isinstance(v, dict):
                pope[split] = {k: x for k, x in v.items() if k.endswith("_ci95")}
    chair = {k: v for k, v in chair_m.items() if k.endswith("_ci95") or k in ("n", "n_mentions", "n_gt_objects")} if _has_chair_ci(chair_m) else None
    notes: list[str] = []
    need_pope, need_chair = pope_m and pope is None, chair_m and chair is None
    if not (need_pope or need_chair):
        return RunIntervals(pope, chair)
    records = read_records(run)
    if not records:
        return RunIntervals(pope, chair, (f"{run}: no per-sample records; intervals not computed",))
    tasks = summary.get("protocol", {}).get("tasks", {})
    if need_pope:
        pope, note = _pope_from_records(records, pope_m, tasks.get("pope", {}))
        notes += [f"{run}: {note}"] if note else []
    if need_chair and chair_rescore:
        chair, note = _chair_from_records(records, chair_m, summary)
        notes += [f"{run}: {note}"] if note else []
    for n in notes:
        logger.warning("%s", n)
    return RunIntervals(pope, chair, tuple(notes))


def _pope_from_records(records: list[dict[str, Any]], recorded: Mapping[str, Any], proto: Mapping[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    mode = proto.get("parser", "pope")
    splits = [s for s in recorded if isinstance(recorded[s], dict)]
    by_split = {s: [r for r in records if r.get("task") == f"pope_{s}"] for s in splits}
    if not splits or any(not v for v in by_split.values()):
        return None, "POPE records missing for some split; no POPE intervals"
    iv = pope_intervals({s: pope_cells(rs, mode) for s, rs in by_split.items()})
    if not math.isclose(iv.mean_f1.estimate, recorded.get("mean_f1", float("nan")), abs_tol=1e-9):
        return None, (f"POPE mean F1 from the records ({iv.mean_f1.estimate:.6f}) differs from the summary's "
                      f"({recorded.get('mean_f1')}); no POPE intervals")
    return iv.as_dict(), None


def _chair_from_records(records: list[dict[str, Any]], recorded: Mapping[str, Any], summary: Mapping[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    caps = [{"image_id": r["target"], "caption": r["resps"][0][0]} for r in records if r.get("task") == "chair"]
    if not caps:
        return None, "no CHAIR records; no CHAIR intervals"
    try:
        evaluator = _chair_evaluator(summary)
        result = evaluator.evaluate(caps)
    except Exception as exc:  # noqa: BLE001 - data moved, NLTK missing, ...: the table says why
        return None, f"CHAIR not re-scored ({type(exc).__name__}: {exc}); no CHAIR intervals"
    iv = chair_intervals(caption_counts(result))
    if not math.isclose(iv.chair_i.estimate, recorded.get("chair_i", float("nan")), abs_tol=1e-9) or iv.n != recorded.get("n"):
        return None, (f"CHAIR re-scored from the records (CHAIR_i {iv.chair_i.estimate:.6f}, n {iv.n}) differs from the summary's "
                      f"(CHAIR_i {recorded.get('chair_i')}, n {recorded.get('n')}); no CHAIR intervals")
    return {"n": iv.n, **iv.as_dict()}, None


_EVALUATORS: dict[str, Any] = {}


def _chair_evaluator(summary: Mapping[str, Any]) -> Any:
    """The CHAIR evaluator of a run, rebuilt from its recorded recipe (cached ground truth reused)."""
    from ..config import load_recipe
    from .chair import ChairEvaluator
    from .data import cache_root, resolve_data

    recipe_dict = summary.get("protocol", {}).get("recipe")
    if not recipe_dict:
        raise ValueError("the summary records no recipe")
    cfg = load_recipe(dict(recipe_dict)).eval
    key = json.dumps(recipe_dict.get("eval", {}).get("data", {}), sort_keys=True)
    if key not in _EVALUATORS:
        data = resolve_data(cfg, ["chair"])
        _EVALUATORS[key] = ChairEvaluator.from_coco(list(data.instances), list(data.captions), cache_dir=cache_root() / "chair")
    return _EVALUATORS[key]
