"""POPE (Li et al. 2023) as an evaluation task: yes/no object probing per split, scored by the
configured answer parser (:mod:`mmfast.eval.pope`)."""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

from ...config import EvalConfig, PopeTaskConfig
from ...errors import ConfigError
from ...registry import TASKS
from ..data import EvalData
from .base import Sample, Task


def check_prompt(prompt: str, where: str = "eval.pope.prompt") -> None:
    """``eval.pope.prompt`` (or the template at ``where``) is a ``str.format`` template whose only
    field is ``{question}`` (at least once); ``{{`` / ``}}`` are literal braces. Refuses a template with
    no ``{question}`` field (e.g. ``{{question}}``, which would send the literal text), other fields, or
    unbalanced braces."""
    try:
        fields = [(name, spec, conv) for _, name, spec, conv in string.Formatter().parse(prompt) if name is not None]
    except ValueError as exc:
        raise ConfigError(
            where, f"{prompt!r} is not a valid template ({exc}); write a literal brace as {{{{ or }}}}"
        ) from None
    others = sorted({f"{{{n}}}" for n, _, _ in fields if n != "question"})
    if others:
        raise ConfigError(
            where,
            f"{prompt!r} has the field(s) {', '.join(others)}; the only field is {{question}} "
            "(write a literal brace as {{ or }})",
        )
    if any(spec or conv for _, spec, conv in fields):
        raise ConfigError(where, f"{prompt!r}: write {{question}} without a format spec or conversion")
    if not fields:
        literal = " ({{question}} is the literal text '{question}', not the field)" if "{{question}}" in prompt else ""
        raise ConfigError(
            where, f"{prompt!r} has no {{question}} field{literal}; put {{question}} where the POPE question goes"
        )


@TASKS.register("pope", description="POPE yes/no object probing per split (accuracy, precision, recall, F1)")
class PopeTask(Task):
    """POPE over the configured splits; metrics by the configured answer parser."""

    Config = PopeTaskConfig
    needs = frozenset({"images"})
    files_help = {"coco": "POPE question files: https://github.com/RUCAIBox/POPE (output/coco/coco_pope_*.json)"}

    @classmethod
    def required_files(cls, cfg: EvalConfig, data: EvalData) -> dict[str, Path]:
        check_prompt(cfg.pope.prompt)  # before any file is read or any model loads
        if data.dataset == "coco":
            names = {s: f"coco_pope_{s}.json" for s in cfg.pope.splits}
        else:
            from ...world.pope_build import pope_file_name

            names = {s: pope_file_name(s, cfg.pope.world_version) for s in cfg.pope.splits}
        return {s: Path(cfg.pope.files.get(s, data.root / "pope" / names[s])).expanduser() for s in cfg.pope.splits}

    def __init__(self, cfg: EvalConfig, data: EvalData, cache_dir: Path | None = None) -> None:
        from .. import pope

        super().__init__(cfg, data, cache_dir)
        self.file_info = {}
        self.questions = {}
        for split, path in self.files.items():
            self.questions[split] = pope.load_pope_questions(path, strict=cfg.pope.strict_version)
            info = pope.pope_file_info(path)
            self.file_info[split] = {
                "path": str(path),
                "sha256": info.sha256,
                "md5": info.md5,
                "known_version": (
                    {"commit": info.known.commit, "split": info.known.split, "dataset": info.known.dataset}
                    if info.known
                    else None
                ),
            }
        check_prompt(cfg.pope.prompt)

    def samples(self, limit: int | None) -> list[Sample]:
        out = []
        for split, qs in self.questions.items():
            for q in qs[:limit] if limit else qs:
                out.append(
                    Sample(
                        doc_id=f"pope_{split}/{q.question_id}",
                        task=f"pope_{split}",
                        image=self.data.image_dir / q.image,
                        prompt=self.cfg.pope.prompt.format(question=q.text),
                        target=q.label,
                        max_new_tokens=self.cfg.pope.max_new_tokens,
                        meta={"question_id": q.question_id, "question": q.text},
                    )
                )
        return out

    def filter_response(self, text: str, sample: Sample) -> str:
        from ..pope import parse_answer

        return parse_answer(text, self.cfg.pope.parser, label=sample.target).pred

    def metrics(self, records: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
        by_split = {s: records[f"pope_{s}"] for s in self.questions if records.get(f"pope_{s}")}
        return score_splits(by_split, self.cfg.pope.parser) if by_split else {}

    def protocol(self) -> dict[str, Any]:
        p = self.cfg.pope
        out = {
            "splits": list(p.splits),
            "prompt": p.prompt,
            "parser": p.parser,
            "max_new_tokens": p.max_new_tokens,
            "files": self.file_info,
            "intervals": intervals_protocol(),
        }
        if self.data.dataset == "world":
            out["world_version"] = p.world_version
        return out


def score_splits(by_split: dict[str, list[dict[str, Any]]], parser: str, unit: str = "image") -> dict[str, Any]:
    """POPE metrics of finished records by split (each split's records as in ``samples.jsonl``): the
    official scoring by ``parser`` (:func:`mmfast.eval.pope.score_pope`, :func:`~mmfast.eval.pope.summarize_pope`)
    and, next to every figure, n and its 95% interval (keys ``*_ci95``; :mod:`mmfast.eval.intervals`),
    resampling the records' ``unit`` (``image``; a video task's ``video``) jointly across splits."""
    from ..intervals import pope_cells, pope_intervals, pope_units
    from ..pope import PopeRecord, score_pope, summarize_pope

    per_split, cells, units = {}, {}, {}
    for split, recs in by_split.items():
        items = [PopeRecord(r["meta"]["question_id"], r["target"], r["resps"][0][0]) for r in recs]
        per_split[split] = score_pope(items, parser)
        cells[split] = pope_cells(recs, parser)
        units[split] = pope_units(recs, unit)
    out = summarize_pope(per_split)
    intervals = pope_intervals(cells, units).as_dict()
    for split in per_split:
        out[split].update(intervals.pop(split))
    out.update(intervals)
    return out


def intervals_protocol(unit: str = "image") -> dict[str, Any]:
    """How :func:`score_splits` computes its intervals (``protocol.tasks.<task>.intervals``)."""
    from ..intervals import RESAMPLES, SEED

    return {
        "accuracy, precision, recall": "Wilson score interval, 95%",
        "f1, mean_f1, mean_accuracy": f"percentile bootstrap resampling {unit}s jointly across splits (one draw per {unit} for "
        "all its questions of all splits), 95%; Wilson of the pooled counts where every replicate is equal",
        "resamples": RESAMPLES,
        "seed": SEED,
    }
