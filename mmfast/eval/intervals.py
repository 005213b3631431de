"""95% intervals for the accuracy and hallucination figures, from per-sample records.

* **Proportions** (POPE accuracy, precision, recall per split; CHAIR_s = the fraction of captions
  with a hallucinated object): the Wilson score interval, closed form.
* **Everything else** (POPE F1 per split, the POPE means over splits, CHAIR_i = hallucinated
  mentions / all mentions, CHAIR recall = recalled ground-truth objects / all ground-truth objects):
  a seeded percentile bootstrap (:data:`RESAMPLES` resamples, :data:`SEED`, numpy's PCG64) that
  resamples the independent unit:

  - POPE: the **image**, jointly across splits. POPE's splits ask about the same images and share
    their positive questions, so an image's questions in every split move together: one draw per
    image carries all its questions of all splits into the replicate (a cluster bootstrap). Records
    without an image name fall back to their question as the unit (one per split). Resampling each
    split on its own (as before) made the mean-F1 intervals 1.6-1.7x too narrow on world POPE.
  - paired differences (:func:`paired_mean_f1_difference`): the same image draw scores both systems.
  - CHAIR: the caption (one per image); CHAIR_i and recall are ratios of sums, as the point estimates.

  Where the percentile bootstrap degenerates (every replicate the same value, e.g. 6 of 6 correct
  gives ``[1, 1]``), the interval falls back to a Wilson interval of the pooled counts and says so
  (``method`` ``"wilson"``): accuracy k correct of n; F1 through the Jaccard index J = tp / (tp + fp +
  fn), a proportion with F1 = 2J / (1 + J) monotone in it; CHAIR_i and recall as k of n mentions /
  objects. These pooled counts treat questions (mentions) as independent, so a fallback interval is
  the narrower side of honest; it only appears where the bootstrap had no spread at all.

The point estimate of every interval is the metric as the task computes it (an undefined ratio is
0.0, as in :mod:`mmfast.eval.pope` and :mod:`mmfast.eval.chair`); with the same inputs, seed and
resample count an interval is reproduced exactly.
"""

from __future__ import annotations

import gzip
import json
import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from .records import digest_of, parse_line, write_atomic

logger = logging.getLogger(__name__)

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile
RESAMPLES = 10_000
SEED = 0
POPE_CELLS = ("tp", "fp", "tn", "fn", "unscored")
CI_METHOD = f"images jointly across splits / captions, {RESAMPLES} resamples, Wilson where degenerate"
"""Stored next to the intervals (``ci_method``): intervals recorded by an older method are recomputed."""
_CHUNK = 1000  # replicates drawn per block (bounds the [block, units] weight matrix)
METHODS = {
    "wilson": "Wilson score interval (binomial proportion), z = 1.96; also the fallback where every bootstrap replicate is equal",
    "bootstrap": f"percentile bootstrap, {RESAMPLES} resamples, numpy default_rng(seed {SEED}); "
    "POPE resamples images jointly across splits, CHAIR resamples captions",
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


def _bootstrap_or(
    estimate: float, reps: np.ndarray, n: int, fallback: Callable[[], tuple[float, float]] | None
) -> Interval:
    """The percentile interval of ``reps`` [R]; where every replicate is equal (no spread: 6 of 6
    right gives [1, 1]) and a ``fallback`` exists, its Wilson interval instead."""
    if fallback is not None and np.ptp(reps) == 0:
        lo, hi = fallback()
        return Interval(estimate, min(lo, estimate), max(hi, estimate), n, "wilson")
    return Interval(estimate, *_percentile(reps), n, "bootstrap")


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _unit_weights(n_units: int, rng: np.random.Generator, resamples: int) -> Iterable[np.ndarray]:
    """Blocks of [B, U] draw counts: replicate r takes unit u ``w[r, u]`` times (U draws with
    replacement from U units, as ``rng.integers`` picks them)."""
    done = 0
    while done < resamples:
        b = min(_CHUNK, resamples - done)
        idx = rng.integers(0, n_units, size=(b, n_units))  # [B, U] drawn unit indices
        flat = (idx + np.arange(b)[:, None] * n_units).ravel()
        yield np.bincount(flat, minlength=b * n_units).reshape(b, n_units)  # [B, U]
        done += b


def _resample_sums(per_unit: np.ndarray, rng: np.random.Generator, resamples: int) -> np.ndarray:
    """[R, ...] sums over resampled units of ``per_unit`` [U, ...] (what a replicate adds up)."""
    flat = per_unit.reshape(per_unit.shape[0], -1).astype(np.float64)  # [U, K]
    out = np.concatenate([w @ flat for w in _unit_weights(len(flat), rng, resamples)])  # [R, K]
    return out.reshape((resamples,) + per_unit.shape[1:])


def _safe_ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """num / den elementwise, 0.0 where den is 0 (the tasks' convention for an undefined ratio)."""
    out = np.zeros(np.broadcast(num, den).shape, dtype=float)
    np.divide(num, den, out=out, where=den != 0)
    return out


def _f1_from_counts(tp: np.ndarray, fp: np.ndarray, fn: np.ndarray) -> np.ndarray:
    prec = _safe_ratio(tp, tp + fp)
    rec = _safe_ratio(tp, tp + fn)
    return _safe_ratio(2 * prec * rec, prec + rec)


def _f1_wilson(tp: int, fp: int, fn: int) -> tuple[float, float]:
    """F1's interval through the Jaccard index J = tp / (tp + fp + fn) (F1 = 2J / (1 + J))."""
    j = wilson(tp, tp + fp + fn)
    return 2 * j.lo / (1 + j.lo), 2 * j.hi / (1 + j.hi)


def _cell_codes(cells: Sequence[str]) -> np.ndarray:
    index = {c: i for i, c in enumerate(POPE_CELLS)}
    try:
        return np.fromiter((index[c] for c in cells), dtype=np.int64, count=len(cells))
    except KeyError as exc:
        raise ValueError(f"unknown POPE cell {exc.args[0]!r}; expected one of {POPE_CELLS}") from None


def _counts(codes: np.ndarray) -> np.ndarray:
    return np.bincount(codes, minlength=len(POPE_CELLS))


def _unit_keys(
    splits: Sequence[str], sizes: Mapping[str, int], units_by_split: Mapping[str, Sequence[Any] | None] | None
) -> tuple[dict[str, np.ndarray], int]:
    """Each question's unit index, by split, and the number of units: its image where the split
    has image names (shared across splits), else the question itself."""
    index: dict[Any, int] = {}
    out: dict[str, np.ndarray] = {}
    for s in splits:
        units = (units_by_split or {}).get(s)
        if units is not None and len(units) != sizes[s]:
            raise ValueError(f"POPE split {s!r}: {len(units)} image names for {sizes[s]} questions")
        keys = [("image", u) for u in units] if units is not None else [("question", s, j) for j in range(sizes[s])]
        out[s] = np.fromiter((index.setdefault(k, len(index)) for k in keys), dtype=np.int64, count=sizes[s])
    return out, len(index)


def _unit_cell_counts(codes: Mapping[str, np.ndarray], units: Mapping[str, np.ndarray], n_units: int) -> np.ndarray:
    """[U, S, 5]: how many questions of each unit fall in each cell, per split (in ``codes``' order)."""
    out = np.zeros((n_units, len(codes), len(POPE_CELLS)), dtype=np.int64)
    for j, (s, c) in enumerate(codes.items()):
        np.add.at(out, (units[s], j, c), 1)
    return out


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
    n_units: int  # images (or questions where no image is named) resampled

    @property
    def n(self) -> int:
        """Questions over all splits."""
        return sum(s.n for s in self.splits.values())

    def as_dict(self) -> dict[str, Any]:
        """``{"<split>": {...}, "mean_f1_ci95", "mean_accuracy_ci95", "n", "n_units"}`` (merged into the summary)."""
        out: dict[str, Any] = {name: s.as_dict() for name, s in self.splits.items()}
        out.update(
            mean_f1_ci95=self.mean_f1.as_list(),
            mean_accuracy_ci95=self.mean_accuracy.as_list(),
            n=self.n,
            n_units=self.n_units,
            ci_method=CI_METHOD,
        )
        return out


def pope_intervals(
    cells_by_split: Mapping[str, Sequence[str]],
    units_by_split: Mapping[str, Sequence[Any] | None] | None = None,
    *,
    resamples: int = RESAMPLES,
    seed: int = SEED,
) -> PopeIntervals:
    """Intervals from every question's confusion cell (``tp fp tn fn unscored``), by split.

    ``units_by_split[s][j]`` names question ``j``'s image (the resampled unit, shared across
    splits); without it every question is its own unit. Replicate ``r`` draws the units once, with
    replacement, and every split's F1 and accuracy, and their means, are computed on that one draw.
    """
    if not cells_by_split:
        raise ValueError("pope_intervals needs at least one split")
    codes = {s: _cell_codes(c) for s, c in cells_by_split.items()}
    for s, c in codes.items():
        if len(c) == 0:
            raise ValueError(f"POPE split {s!r} has no questions")
    units, n_units = _unit_keys(list(codes), {s: len(c) for s, c in codes.items()}, units_by_split)
    reps = _resample_sums(_unit_cell_counts(codes, units, n_units), _rng(seed), resamples)  # [R, S, 5]
    f1_reps = _f1_from_counts(reps[..., 0], reps[..., 1], reps[..., 3])  # [R, S]
    acc_reps = _safe_ratio(reps[..., 0] + reps[..., 2], reps.sum(axis=-1))  # [R, S]
    splits: dict[str, PopeSplitIntervals] = {}
    f1_points, acc_points = [], []
    for j, (name, c) in enumerate(codes.items()):
        n = len(c)
        tp, fp, tn, fn, _ = (int(x) for x in _counts(c))
        f1_point = float(_f1_from_counts(np.array(tp), np.array(fp), np.array(fn)))
        splits[name] = PopeSplitIntervals(
            n=n,
            accuracy=wilson(tp + tn, n),
            precision=wilson(tp, tp + fp),
            recall=wilson(tp, tp + fn),
            f1=_bootstrap_or(f1_point, f1_reps[:, j], n, lambda tp=tp, fp=fp, fn=fn: _f1_wilson(tp, fp, fn)),
        )
        f1_points.append(f1_point)
        acc_points.append((tp + tn) / n)
    total = sum(s.n for s in splits.values())
    pooled = sum((_counts(c) for c in codes.values()), np.zeros(len(POPE_CELLS), dtype=np.int64))
    tp, fp, tn, fn, _ = (int(x) for x in pooled)
    mean_f1 = _bootstrap_or(
        math.fsum(f1_points) / len(f1_points), f1_reps.mean(axis=1), total, lambda: _f1_wilson(tp, fp, fn)
    )
    mean_acc = _bootstrap_or(
        math.fsum(acc_points) / len(acc_points), acc_reps.mean(axis=1), total, lambda: wilson(tp + tn, total).as_list()
    )
    return PopeIntervals(splits, mean_f1, mean_acc, n_units)


def paired_mean_f1_difference(
    a_by_split: Mapping[str, Sequence[str]],
    b_by_split: Mapping[str, Sequence[str]],
    units_by_split: Mapping[str, Sequence[Any] | None] | None = None,
    *,
    resamples: int = RESAMPLES,
    seed: int = SEED,
) -> Interval:
    """POPE mean F1 of ``a`` minus that of ``b`` on the same questions, with a paired bootstrap interval.

    ``a_by_split[s][j]`` and ``b_by_split[s][j]`` are the confusion cells of the same question ``j``
    of split ``s`` under two systems, ``units_by_split[s][j]`` its image (as in
    :func:`pope_intervals`). Replicate ``r`` draws the images once for all splits and scores both
    systems on that draw, so the interval is that of the difference (two systems answering the same
    questions are correlated: their separate intervals overlap even when one is reliably better).
    """
    if set(a_by_split) != set(b_by_split) or not a_by_split:
        raise ValueError(f"paired POPE needs the same splits, got {sorted(a_by_split)} and {sorted(b_by_split)}")
    names = sorted(a_by_split)  # one draw order whatever order the splits come in
    a = {s: _cell_codes(a_by_split[s]) for s in names}
    b = {s: _cell_codes(b_by_split[s]) for s in names}
    for s in names:
        if len(a[s]) != len(b[s]) or len(a[s]) == 0:
            raise ValueError(
                f"POPE split {s!r}: {len(a[s])} and {len(b[s])} questions; a paired difference needs the same non-empty set"
            )
    units, n_units = _unit_keys(names, {s: len(a[s]) for s in names}, units_by_split)
    both = np.stack(
        [_unit_cell_counts(a, units, n_units), _unit_cell_counts(b, units, n_units)], axis=1
    )  # [U, 2, S, 5]
    reps = _resample_sums(both, _rng(seed), resamples)  # [R, 2, S, 5]
    f1 = _f1_from_counts(reps[..., 0], reps[..., 1], reps[..., 3]).mean(axis=-1)  # [R, 2]
    points = [_f1_from_counts(*(np.array(_counts(x[s])[k]) for k in (0, 1, 3))) for x in (a, b) for s in names]
    estimate = (math.fsum(map(float, points[: len(names)])) - math.fsum(map(float, points[len(names) :]))) / len(names)
    return Interval(estimate, *_percentile(f1[:, 0] - f1[:, 1]), sum(len(a[s]) for s in names), "bootstrap")


class PairedPope(NamedTuple):
    """Two runs' POPE cells on the questions both answered, in one order, and those questions'
    images (``paired_mean_f1_difference(*paired)``)."""

    a: dict[str, list[str]]
    b: dict[str, list[str]]
    units: dict[str, list[Any] | None]


def paired_pope_cells(a: Iterable[Mapping[str, Any]], b: Iterable[Mapping[str, Any]], mode: str) -> PairedPope:
    """Both runs' POPE cells by split (``task`` ``pope_<split>``), on the questions both answered, in
    one order (by ``doc_id``), with their images: the input of :func:`paired_mean_f1_difference`."""
    by_a = {r["doc_id"]: r for r in a if str(r.get("task", "")).startswith("pope_")}
    by_b = {r["doc_id"]: r for r in b if str(r.get("task", "")).startswith("pope_")}
    common = sorted(set(by_a) & set(by_b))
    out = PairedPope({}, {}, {})
    recs: dict[str, list[Mapping[str, Any]]] = {}
    for doc in common:
        split = by_a[doc]["task"][len("pope_") :]
        out.a.setdefault(split, []).extend(pope_cells([by_a[doc]], mode))
        out.b.setdefault(split, []).extend(pope_cells([by_b[doc]], mode))
        recs.setdefault(split, []).append(by_a[doc])
    for split, rs in recs.items():
        out.units[split] = pope_units(rs)
    return out


def pope_units(records: Sequence[Mapping[str, Any]], key: str = "image") -> list[Any] | None:
    """Every POPE record's image (the resampled unit; a video task's records: ``key="video"``, the
    clip), or None when a record names none."""
    units = [r.get(key) for r in records]
    return None if any(u is None for u in units) else units


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
        return {
            "chair_s_ci95": self.chair_s.as_list(),
            "chair_i_ci95": self.chair_i.as_list(),
            "recall_ci95": self.recall.as_list(),
            "n_mentions": self.n_mentions,
            "n_gt_objects": self.n_gt_objects,
            "ci_method": CI_METHOD,
        }


def chair_intervals(
    captions: Sequence[CaptionCounts], *, resamples: int = RESAMPLES, seed: int = SEED
) -> ChairIntervals:
    """Intervals from every caption's counts; CHAIR_i and recall from the same resampled captions."""
    n = len(captions)
    if n == 0:
        raise ValueError("chair_intervals needs at least one caption")
    mentions = np.array([c.mentions for c in captions], dtype=np.int64)
    hall = np.array([c.hallucinated for c in captions], dtype=np.int64)
    gt = np.array([c.gt_objects for c in captions], dtype=np.int64)
    rec = np.array([c.recalled for c in captions], dtype=np.int64)
    sums = _resample_sums(np.stack([hall, mentions, rec, gt], axis=1), _rng(seed), resamples)  # [R, 4]
    n_h, n_m, n_r, n_gt = int(hall.sum()), int(mentions.sum()), int(rec.sum()), int(gt.sum())
    return ChairIntervals(
        n=n,
        n_mentions=n_m,
        n_gt_objects=n_gt,
        chair_s=wilson(int((hall > 0).sum()), n),
        chair_i=_bootstrap_or(
            n_h / n_m if n_m else 0.0, _safe_ratio(sums[:, 0], sums[:, 1]), n, lambda: wilson(n_h, n_m).as_list()
        ),
        recall=_bootstrap_or(
            n_r / n_gt if n_gt else 0.0, _safe_ratio(sums[:, 2], sums[:, 3]), n, lambda: wilson(n_r, n_gt).as_list()
        ),
    )


def caption_counts(result: Any) -> list[CaptionCounts]:
    """Per-caption counts of a :class:`mmfast.eval.chair.ChairResult` (its ``captions``)."""
    return [
        CaptionCounts(len(c.mentions), len(c.hallucinated), len(c.gt_objects), len(c.recalled)) for c in result.captions
    ]


def pope_cells(records: Iterable[Mapping[str, Any]], mode: str) -> list[str]:
    """Every POPE record's confusion cell, by the task's parser (records as in ``samples.jsonl``)."""
    from .pope import pope_cell

    return [pope_cell(r["resps"][0][0], r["target"], mode) for r in records]


# ---------------------------------------------------------------------------------------------
# Intervals of a finished run directory
# ---------------------------------------------------------------------------------------------


def read_records(run: Path) -> list[dict[str, Any]]:
    """The successful records a run's ``summary.json`` scored, from ``samples.jsonl`` or ``samples.jsonl.gz``
    (``[]`` if neither).

    A finished run keeps its scored records first, in plan order (the planned samples' records: finished,
    then failed ones among them; its first lines, which a resumed run appends after), and records of samples
    it did not plan (kept for a later run with a larger ``--limit``) after them; the summary's ``counts`` say
    how many lead and ``protocol.samples_digest`` which ones, so those are returned once the digest confirms
    them. Where it does not (a run written before mmfast kept that order, or an edited file), every successful
    record is returned if they are what the summary scored, else every successful record with a warning that
    they may not be."""
    plain, packed = run / "samples.jsonl", run / "samples.jsonl.gz"
    if plain.is_file():
        raw = plain.read_bytes()
    elif packed.is_file():
        with gzip.open(packed, "rb") as f:
            raw = f.read()
    else:
        return []
    # a line cut off by a killed run (anywhere, inside a UTF-8 character too) is not a finished sample
    lines = [rec for rec in map(parse_line, raw.split(b"\n")) if not isinstance(rec, str)]
    by_id: dict[str, dict[str, Any]] = {}
    for rec in lines:
        by_id[rec["doc_id"]] = rec
    everything = list(by_id.values())
    successful = [r for r in everything if "error" not in r]
    try:
        text = (run / "summary.json").read_text()
    except OSError:
        return successful  # no summary to match: every successful record
    try:
        summary = json.loads(text)
        digest, counts = summary["protocol"]["samples_digest"], summary["counts"]
        # the scored records are the first lines as the run left them: a resumed run appends after them
        lead = [r for r in lines[: counts["finished"] + counts["failed"]] if "error" not in r]
    except (ValueError, KeyError, TypeError) as exc:
        logger.warning(
            "%s: summary.json names no scored data (%s: %s); every successful record is read",
            run,
            type(exc).__name__,
            exc,
        )
        return successful
    for scored in (lead, successful):
        if digest_of(r.get("fingerprint", "") for r in scored) == digest:
            return scored
    logger.warning(
        "%s: its records do not match what summary.json scored (protocol.samples_digest); intervals and counts "
        "from its records may include samples the summary left out",
        run,
    )
    return successful


@dataclass(frozen=True)
class RunIntervals:
    """The intervals of one eval run, keyed as the summary's metrics: ``pope`` and ``chair`` hold the
    ``*_ci95`` keys (and counts) the tasks add; absent when not computable (reason in ``notes``)."""

    pope: dict[str, Any] | None
    chair: dict[str, Any] | None
    notes: tuple[str, ...] = ()


def current_intervals(part: Mapping[str, Any] | None) -> bool:
    """Whether recorded intervals (a task's metrics or a bench's stored ones) are of this module's
    method (:data:`CI_METHOD`); older ones (questions resampled within each split, 1000 resamples)
    are recomputed from the records."""
    return bool(part) and part.get("ci_method") == CI_METHOD


def _has_pope_ci(m: Mapping[str, Any]) -> bool:
    return "mean_f1_ci95" in m and current_intervals(m)


def _has_chair_ci(m: Mapping[str, Any]) -> bool:
    return "chair_i_ci95" in m and current_intervals(m)


def run_intervals(run: Path, summary: Mapping[str, Any] | None = None, *, chair_rescore: bool = True) -> RunIntervals:
    """Intervals of an eval run directory: from its ``summary.json`` when the tasks recorded them by
    this module's method (:data:`CI_METHOD`), else computed from its per-sample records (POPE by the
    recorded parser; CHAIR by re-scoring the captions against the run's ground truth, only when the
    re-scored CHAIR_i equals the recorded one). CHAIR intervals recorded by the older method (the same
    unit, the caption; fewer resamples) are kept, with a note, where they cannot be recomputed; POPE
    ones are not (they resampled questions within each split and came out too narrow).
    """
    run = Path(run)
    if summary is None:
        summary = json.loads((run / "summary.json").read_text())
    metrics = summary.get("metrics", {})
    pope_m, chair_m = metrics.get("pope") or {}, metrics.get("chair") or {}
    pope = (
        {k: v for k, v in pope_m.items() if k.endswith("_ci95") or k in ("n", "n_units", "ci_method")}
        if _has_pope_ci(pope_m)
        else None
    )
    if pope is not None:
        for split, v in pope_m.items():
            if isinstance(v, dict):
                pope[split] = {k: x for k, x in v.items() if k.endswith("_ci95")}
    chair = (
        {
            k: v
            for k, v in chair_m.items()
            if k.endswith("_ci95") or k in ("n", "n_mentions", "n_gt_objects", "ci_method")
        }
        if _has_chair_ci(chair_m)
        else None
    )
    notes: list[str] = []
    need_pope, need_chair = pope_m and pope is None, chair_m and chair is None
    if not (need_pope or need_chair):
        return RunIntervals(pope, chair)
    records = read_records(run)
    if not records:
        notes.append(f"{run}: no per-sample records; intervals not computed")
    tasks = summary.get("protocol", {}).get("tasks", {})
    if need_pope and records:
        pope, note = _pope_from_records(records, pope_m, tasks.get("pope", {}))
        notes += [f"{run}: {note}"] if note else []
    if need_chair and chair_rescore and records:
        chair, note = _chair_from_records(records, chair_m, summary)
        notes += [f"{run}: {note}"] if note else []
    if chair is None and "chair_i_ci95" in chair_m:
        chair = {k: v for k, v in chair_m.items() if k.endswith("_ci95") or k in ("n", "n_mentions", "n_gt_objects")}
        notes.append(f"{run}: CHAIR intervals as recorded by an older method (captions resampled, fewer resamples)")
    for n in notes:
        logger.warning("%s", n)
    return RunIntervals(pope, chair, tuple(notes))


def refresh_intervals(run: Path) -> tuple[str, ...]:
    """Write this module's intervals into an eval run's ``summary.json`` where it recorded them by an older
    method (``ci_method``) or not at all, computed from its records as :func:`run_intervals` does; nothing
    else in the file changes. Returns the tasks rewritten (``pope``, ``chair``): none where every interval is current or
    cannot be recomputed (the warning :func:`run_intervals` logs says why)."""
    path = Path(run) / "summary.json"
    summary = json.loads(path.read_text())
    metrics = summary.get("metrics") or {}
    found = run_intervals(path.parent, summary)
    rewritten = []
    for task, new in (("pope", found.pope), ("chair", found.chair)):
        part = metrics.get(task)
        if not part or not new or current_intervals(part) or not current_intervals(new):
            continue
        for key, value in new.items():
            if isinstance(value, dict):  # a POPE split's intervals, next to its metrics
                part.setdefault(key, {}).update(value)
            else:
                part[key] = value
        rewritten.append(task)
    if rewritten:
        write_atomic(path, json.dumps(summary, indent=2).encode("utf-8"))
        logger.info("%s: %s intervals rewritten (%s)", path, " and ".join(rewritten), CI_METHOD)
    return tuple(rewritten)


def _pope_from_records(
    records: list[dict[str, Any]], recorded: Mapping[str, Any], proto: Mapping[str, Any]
) -> tuple[dict[str, Any] | None, str | None]:
    mode = proto.get("parser", "pope")
    splits = [s for s in recorded if isinstance(recorded[s], dict)]
    by_split = {s: [r for r in records if r.get("task") == f"pope_{s}"] for s in splits}
    if not splits or any(not v for v in by_split.values()):
        return None, "POPE records missing for some split; no POPE intervals"
    iv = pope_intervals(
        {s: pope_cells(rs, mode) for s, rs in by_split.items()}, {s: pope_units(rs) for s, rs in by_split.items()}
    )
    if not math.isclose(iv.mean_f1.estimate, recorded.get("mean_f1", float("nan")), abs_tol=1e-9):
        return None, (
            f"POPE mean F1 from the records ({iv.mean_f1.estimate:.6f}) differs from the summary's "
            f"({recorded.get('mean_f1')}); no POPE intervals"
        )
    return iv.as_dict(), None


def _chair_from_records(
    records: list[dict[str, Any]], recorded: Mapping[str, Any], summary: Mapping[str, Any]
) -> tuple[dict[str, Any] | None, str | None]:
    caps = [{"image_id": r["target"], "caption": r["resps"][0][0]} for r in records if r.get("task") == "chair"]
    if not caps:
        return None, "no CHAIR records; no CHAIR intervals"
    try:
        evaluator = _chair_evaluator(summary)
        result = evaluator.evaluate(caps)
    except Exception as exc:  # noqa: BLE001 - data moved, NLTK missing, ...: the table says why
        return None, f"CHAIR not re-scored ({type(exc).__name__}: {exc}); no CHAIR intervals"
    iv = chair_intervals(caption_counts(result))
    if not math.isclose(
        iv.chair_i.estimate, recorded.get("chair_i", float("nan")), abs_tol=1e-9
    ) or iv.n != recorded.get("n"):
        return None, (
            f"CHAIR re-scored from the records (CHAIR_i {iv.chair_i.estimate:.6f}, n {iv.n}) differs from the summary's "
            f"(CHAIR_i {recorded.get('chair_i')}, n {recorded.get('n')}); no CHAIR intervals"
        )
    return {"n": iv.n, **iv.as_dict()}, None


_EVALUATORS: dict[str, Any] = {}


def _chair_evaluator(summary: Mapping[str, Any]) -> Any:
    """The CHAIR evaluator of a run, rebuilt from its recorded recipe's ``eval`` section (cached ground truth
    reused); the methods' sections are not read, so a recipe recorded before a method's keys changed is read."""
    from ..config import load_recipe
    from .chair import ChairEvaluator
    from .data import cache_root, resolve_data

    recipe_dict = summary.get("protocol", {}).get("recipe")
    if not recipe_dict:
        raise ValueError("the summary records no recipe")
    cfg = load_recipe({"eval": recipe_dict.get("eval", {})}).eval
    key = json.dumps(recipe_dict.get("eval", {}).get("data", {}), sort_keys=True)
    if key not in _EVALUATORS:
        data = resolve_data(cfg, ["chair"])
        _EVALUATORS[key] = ChairEvaluator.from_coco(
            list(data.instances), list(data.captions), cache_dir=cache_root() / "chair"
        )
    return _EVALUATORS[key]
