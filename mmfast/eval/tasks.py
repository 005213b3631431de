"""Evaluation tasks: POPE (per split) and CHAIR, as the benchmarks define them.

A task turns the recipe and the data into :class:`Sample` items (one prompt about one image, with
a stable ``doc_id``), and turns the finished per-sample records back into metrics.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import EvalConfig
from ..errors import InputError
from .data import EvalData

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sample:
    doc_id: str
    task: str  # record group: "pope_random", "chair", ...
    image: Path
    prompt: str
    target: Any
    max_new_tokens: int
    meta: dict[str, Any] = field(default_factory=dict)


class PopeTask:
    """POPE over the configured splits; metrics by the configured answer parser."""

    name = "pope"

    def __init__(self, cfg: EvalConfig, data: EvalData) -> None:
        from . import pope

        self.cfg, self.data = cfg, data
        self.files = {}
        self.questions = {}
        for split, path in data.pope_files.items():
            self.questions[split] = pope.load_pope_questions(path, strict=cfg.pope.strict_version)
            info = pope.pope_file_info(path)
            self.files[split] = {
                "path": str(path),
                "sha256": info.sha256,
                "md5": info.md5,
                "known_version": (
                    {"commit": info.known.commit, "split": info.known.split, "dataset": info.known.dataset} if info.known else None
                ),
            }
        if "{question}" not in cfg.pope.prompt:
            raise InputError("eval.pope.prompt must contain '{question}' (where the POPE question goes)")

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
        from .pope import parse_answer

        return parse_answer(text, self.cfg.pope.parser, label=sample.target).pred

    def score(self, records: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
        from .pope import PopeRecord, score_pope, summarize_pope

        per_split = {}
        for split in self.questions:
            recs = records.get(f"pope_{split}", [])
            if not recs:
                continue
            items = [PopeRecord(r["meta"]["question_id"], r["target"], r["resps"][0][0]) for r in recs]
            per_split[split] = score_pope(items, self.cfg.pope.parser)
        return summarize_pope(per_split) if per_split else {}

    def protocol(self) -> dict[str, Any]:
        p = self.cfg.pope
        return {"splits": list(p.splits), "prompt": p.prompt, "parser": p.parser, "max_new_tokens": p.max_new_tokens, "files": self.files}


class ChairTask:
    """CHAIR on detailed descriptions of a sorted+seeded image sample (ids saved with the run)."""

    name = "chair"

    def __init__(self, cfg: EvalConfig, data: EvalData, cache_dir: Path | None = None) -> None:
        from .chair import ChairEvaluator, coco_image_id, sample_image_ids

        self.cfg, self.data = cfg, data
        c = cfg.chair
        self.evaluator = ChairEvaluator.from_coco(list(data.instances), list(data.captions), cache_dir=cache_dir)
        files = sorted(p for p in data.image_dir.iterdir() if p.suffix.lower() in (".jpg", ".jpeg", ".png"))
        names = {coco_image_id(p.name): p.name for p in files}
        if c.image_ids_file:
            ids = [int(x) for x in Path(c.image_ids_file).read_text().split()]
            unknown = [i for i in ids if i not in names]
            if unknown:
                raise InputError(f"{c.image_ids_file}: {len(unknown)} image ids have no file in {data.image_dir} (e.g. {unknown[:3]})")
        else:
            ids = sample_image_ids(sorted(names), min(c.n_images, len(names)), c.seed)
        self.image_ids = ids
        self.file_names = names

    def samples(self, limit: int | None) -> list[Sample]:
        c = self.cfg.chair
        ids = self.image_ids[:limit] if limit else self.image_ids
        return [
            Sample(f"chair/{i}", "chair", self.data.image_dir / self.file_names[i], c.prompt, i, c.max_new_tokens, {"image_id": i})
            for i in ids
        ]

    def filter_response(self, text: str, sample: Sample) -> str:
        return text

    def score(self, records: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
        recs = records.get("chair", [])
        if not recs:
            return {}
        result = self.evaluator.evaluate([{"image_id": r["target"], "caption": r["resps"][0][0]} for r in recs])
        return result.as_dict()

    def protocol(self) -> dict[str, Any]:
        c = self.cfg.chair
        return {
            "prompt": c.prompt,
            "max_new_tokens": c.max_new_tokens,
            "n_images": len(self.image_ids),
            "sampling": "ids from sorted file names, random.Random(seed).shuffle, first n" if not c.image_ids_file else c.image_ids_file,
            "seed": c.seed,
            "evaluator": self.evaluator.describe(),
        }


def build_tasks(cfg: EvalConfig, data: EvalData, cache_dir: Path | None = None) -> list:
    tasks = []
    for name in cfg.tasks:
        tasks.append(PopeTask(cfg, data) if name == "pope" else ChairTask(cfg, data, cache_dir))
    return tasks
