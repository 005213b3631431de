"""POPE (Li et al. 2023) as an evaluation task: yes/no object probing per split, scored by the
configured answer parser (:mod:`mmfast.eval.pope`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...config import EvalConfig, PopeTaskConfig
from ...errors import InputError
from ...registry import TASKS
from ..data import EvalData
from .base import Sample, Task


@TASKS.register("pope", description="POPE yes/no object probing per split (accuracy, precision, recall, F1)")
class PopeTask(Task):
    """POPE over the configured splits; metrics by the configured answer parser."""

    Config = PopeTaskConfig
    needs = frozenset({"images"})
    files_help = {"coco": "POPE question files: https://github.com/RUCAIBox/POPE (output/coco/coco_pope_*.json)"}

    @classmethod
    def required_files(cls, cfg: EvalConfig, data: EvalData) -> dict[str, Path]:
        if data.dataset == "coco":
            names = {s: f"coco_pope_{s}.json" for s in cfg.pope.splits}
        else:
            from ...world.pope_build import pope_file_name

            names = {s: pope_file_name(s, cfg.pope.world_version) for s in cfg.pope.splits}
        return {s: Path(cfg.pope.files.get(s, data.root / "pope" / names[s])) for s in cfg.pope.splits}

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
        from ..pope import parse_answer

        return parse_answer(text, self.cfg.pope.parser, label=sample.target).pred

    def metrics(self, records: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
        from ..intervals import pope_cells, pope_intervals, pope_units
        from ..pope import PopeRecord, score_pope, summarize_pope

        per_split, cells, units = {}, {}, {}
        for split in self.questions:
            recs = records.get(f"pope_{split}", [])
            if not recs:
                continue
            items = [PopeRecord(r["meta"]["question_id"], r["target"], r["resps"][0][0]) for r in recs]
            per_split[split] = score_pope(items, self.cfg.pope.parser)
            cells[split] = pope_cells(recs, self.cfg.pope.parser)
            units[split] = pope_units(recs)
        if not per_split:
            return {}
        out = summarize_pope(per_split)
        # n and 95% intervals next to every figure (keys *_ci95; mmfast.eval.intervals)
        intervals = pope_intervals(cells, units).as_dict()
        for split in per_split:
            out[split].update(intervals.pop(split))
        out.update(intervals)
        return out

    def protocol(self) -> dict[str, Any]:
        p = self.cfg.pope
        out = {"splits": list(p.splits), "prompt": p.prompt, "parser": p.parser, "max_new_tokens": p.max_new_tokens,
               "files": self.file_info, "intervals": _intervals_protocol()}
        if self.data.dataset == "world":
            out["world_version"] = p.world_version
        return out


def _intervals_protocol() -> dict[str, Any]:
    from ..intervals import RESAMPLES, SEED

    return {
        "accuracy, precision, recall": "Wilson score interval, 95%",
        "f1, mean_f1, mean_accuracy": "percentile bootstrap resampling images jointly across splits (one draw per image for "
                                      "all its questions of all splits), 95%; Wilson of the pooled counts where every replicate is equal",
        "resamples": RESAMPLES,
        "seed": SEED,
    }
