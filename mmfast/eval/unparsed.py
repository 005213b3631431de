"""Answers that do not parse as their task expects, counted so that no table scores them silently.

* **POPE**: an answer the official rule (RUCAIBox/POPE ``evaluate.py``, :func:`mmfast.eval.pope.parse_answer`
  mode ``"pope"``) cannot read as yes or no: its first sentence holds neither a no-word nor the word
  "yes", so the rule's "yes" is a default, not a reading ("inNo", "inYes", "No!", "", "I can't tell").
  Such answers still land in a confusion cell (the official rule counts them as "yes"): a model that
  answers "inNo" everywhere scores the all-yes F1 (0.667 on balanced POPE) without having answered.
* **CHAIR**: a degenerate caption (:func:`degenerate_caption`): empty, no words, or caught in a
  repetition loop (a word n-gram, n <= :data:`LOOP_MAX_NGRAM`, repeated :data:`LOOP_REPEATS` times back
  to back). CHAIR scores such captions (often with few mentions, so CHAIR_i looks good).

POPE over video clips (the ``video_pope`` task, records ``video_pope_<split>``) is counted by the POPE
rule as a task of its own (:attr:`Unparsed.video_pope`). A run with more than :data:`UNPARSED_LIMIT` of
such answers in a task is marked in every table and not ranked (the pruning bench's ``leaders.md`` leaves it out and says why).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

UNPARSED_LIMIT = 0.05
"""Above this fraction of unparsed answers in a task, a run is marked and not ranked."""
LOOP_MAX_NGRAM = 8
LOOP_REPEATS = 3
_WORD = re.compile(r"[a-z]+")


def degenerate_caption(text: str) -> str | None:
    """Why a caption cannot be read as a description (``"empty"``, ``"no words"``, ``"repetition loop
    ('a dog' x3)"``), or None when it can."""
    if not text.strip():
        return "empty"
    words = _WORD.findall(text.lower())
    if not words:
        return "no words"
    for n in range(1, LOOP_MAX_NGRAM + 1):
        for i in range(len(words) - n * LOOP_REPEATS + 1):
            gram = words[i : i + n]
            if all(words[i + k * n : i + (k + 1) * n] == gram for k in range(1, LOOP_REPEATS)):
                return f"repetition loop ({' '.join(gram)!r} x{LOOP_REPEATS})"
    return None


def pope_unparsed(answer: str) -> bool:
    """Whether the official POPE rule reads neither yes nor no in ``answer`` (its "yes" is a default)."""
    from .pope import parse_answer

    return parse_answer(answer, "pope").unknown


@dataclass(frozen=True)
class TaskUnparsed:
    """``k`` of ``n`` answers of one task did not parse; ``examples``: a few of them, as answered."""

    k: int
    n: int
    examples: tuple[str, ...] = ()

    @property
    def fraction(self) -> float:
        return self.k / self.n if self.n else 0.0

    @property
    def over_limit(self) -> bool:
        return self.fraction > UNPARSED_LIMIT

    def cell(self) -> str:
        """``k/n`` for a table, with the percentage when any: one decimal, more where one decimal would
        round a share over :data:`UNPARSED_LIMIT` onto it (5.011% reads 5.01%, not 5.0%, the ranked limit)."""
        if not self.k:
            return f"{self.k}/{self.n}"
        pct, digits = 100 * self.fraction, 1
        while self.over_limit and digits < 6 and float(f"{pct:.{digits}f}") <= 100 * UNPARSED_LIMIT:
            digits += 1
        return f"{self.k}/{self.n} ({pct:.{digits}f}%)"

    def as_dict(self) -> dict[str, Any]:
        return {"k": self.k, "n": self.n, "examples": list(self.examples)}


@dataclass(frozen=True)
class Unparsed:
    """Unparsed answers of one run, per task (None where the task did not run)."""

    pope: TaskUnparsed | None
    chair: TaskUnparsed | None
    video_pope: TaskUnparsed | None = None

    def reasons(self) -> list[str]:
        """Why the run is not ranked (empty when it is): each task over :data:`UNPARSED_LIMIT`."""
        out = []
        if self.pope and self.pope.over_limit:
            out.append(
                f"{self.pope.cell()} POPE answers neither yes nor no by the official rule"
                + (f" (e.g. {', '.join(repr(e) for e in self.pope.examples)})" if self.pope.examples else "")
            )
        if self.video_pope and self.video_pope.over_limit:
            out.append(
                f"{self.video_pope.cell()} video POPE answers neither yes nor no by the official rule"
                + (
                    f" (e.g. {', '.join(repr(e) for e in self.video_pope.examples)})"
                    if self.video_pope.examples
                    else ""
                )
            )
        if self.chair and self.chair.over_limit:
            out.append(
                f"{self.chair.cell()} CHAIR captions degenerate"
                + (f" (e.g. {', '.join(repr(e[:40]) for e in self.chair.examples)})" if self.chair.examples else "")
            )
        return out

    def as_dict(self) -> dict[str, Any]:
        return {
            "pope": self.pope.as_dict() if self.pope else None,
            "chair": self.chair.as_dict() if self.chair else None,
            "video_pope": self.video_pope.as_dict() if self.video_pope else None,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Unparsed:
        def task(x: Mapping[str, Any] | None) -> TaskUnparsed | None:
            return TaskUnparsed(int(x["k"]), int(x["n"]), tuple(x.get("examples", ()))) if x else None

        return cls(task(d.get("pope")), task(d.get("chair")), task(d.get("video_pope")))


def _task(answers: list[str], bad: Any, n_examples: int = 3) -> TaskUnparsed | None:
    if not answers:
        return None
    flagged = [a for a in answers if bad(a)]
    examples = tuple(dict.fromkeys(flagged))[:n_examples]  # distinct, first seen first
    return TaskUnparsed(len(flagged), len(answers), examples)


def count_pope_unparsed(answers: Iterable[str]) -> TaskUnparsed:
    """How many of a POPE task's raw answers the official rule reads as neither yes nor no (e.g. one
    split's, or ``video_pope``'s)."""
    answers = list(answers)
    return _task(answers, pope_unparsed) or TaskUnparsed(0, 0)


def count_unparsed(records: Iterable[Mapping[str, Any]]) -> Unparsed:
    """Unparsed POPE and video POPE answers and degenerate CHAIR captions among a run's records
    (``samples.jsonl``)."""
    pope, chair, video = [], [], []
    for r in records:
        task = str(r.get("task", ""))
        if task.startswith("pope_"):
            pope.append(r["resps"][0][0])
        elif task.startswith("video_pope_"):
            video.append(r["resps"][0][0])
        elif task == "chair":
            chair.append(r["resps"][0][0])
    return Unparsed(
        _task(pope, pope_unparsed),
        _task(chair, lambda c: degenerate_caption(c) is not None),
        _task(video, pope_unparsed),
    )
