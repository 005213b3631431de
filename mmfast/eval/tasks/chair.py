"""CHAIR (Rohrbach et al. 2018) as an evaluation task: object hallucination in detailed
descriptions, scored by :class:`mmfast.eval.chair.ChairEvaluator`."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ...config import ChairTaskConfig, EvalConfig
from ...errors import InputError
from ...registry import TASKS
from ..data import EvalData
from .base import Sample, Task

logger = logging.getLogger(__name__)


@TASKS.register("chair", description="CHAIR object hallucination in detailed descriptions (CHAIR_s, CHAIR_i, recall)")
class ChairTask(Task):
    """CHAIR on detailed descriptions of a sorted+seeded image sample (ids saved with the run)."""

    Config = ChairTaskConfig
    needs = frozenset({"images", "annotations"})

    def __init__(self, cfg: EvalConfig, data: EvalData, cache_dir: Path | None = None) -> None:
        from ..chair import ChairEvaluator, coco_image_id, sample_image_ids

        super().__init__(cfg, data, cache_dir)
        c = cfg.chair
        self.evaluator = ChairEvaluator.from_coco(list(data.instances), list(data.captions), cache_dir=cache_dir)
        files = sorted(p for p in data.image_dir.iterdir() if p.suffix.lower() in (".jpg", ".jpeg", ".png"))
        names: dict[int, str] = {}
        stray: list[str] = []  # not named by an image id (macOS's ._COCO_... files, a notes.jpg): not COCO images
        for p in files:
            try:
                image_id = coco_image_id(p.name)
            except ValueError:
                stray.append(p.name)
                continue
            if image_id in names:
                raise InputError(
                    f"{data.image_dir} holds image {image_id} twice ({names[image_id]} and {p.name}); keep one"
                )
            names[image_id] = p.name
        if not names:
            raise InputError(
                f"{data.image_dir} holds no COCO image (.jpg, .jpeg or .png named by its image id); point "
                "eval.data.image_dir (or the data root) at the folder that holds the images themselves"
            )
        if stray:
            logger.warning(
                "CHAIR: %d file(s) in %s are not named by an image id (%s); left out of the image pool",
                len(stray),
                data.image_dir,
                ", ".join(stray[:3]) + (" ..." if len(stray) > 3 else ""),
            )
        if c.image_ids_file:
            ids = read_image_ids(Path(c.image_ids_file).expanduser())
            unknown = [i for i in ids if i not in names]
            if unknown:
                raise InputError(
                    f"{c.image_ids_file}: {len(unknown)} image ids have no file in {data.image_dir} (e.g. {unknown[:3]})"
                )
        else:
            ids = sample_image_ids(sorted(names), min(c.n_images, len(names)), c.seed)
        # metrics() scores with missing="error": refuse now what would only fail after every caption is generated
        absent = [i for i in ids if i not in self.evaluator.ground_truth]
        if absent:
            raise InputError(
                f"{len(absent)} of the {len(ids)} CHAIR images have no ground truth in "
                f"{[p.name for p in (*data.instances, *data.captions)]}, e.g. {absent[:5]}; give the annotation "
                "files that cover them (COCO: instances and captions of train+val 2014) or list other images in "
                "eval.chair.image_ids_file"
            )
        self.image_ids = ids
        self.file_names = names

    def samples(self, limit: int | None) -> list[Sample]:
        c = self.cfg.chair
        ids = self.image_ids[:limit] if limit else self.image_ids
        return [
            Sample(
                f"chair/{i}",
                "chair",
                self.data.image_dir / self.file_names[i],
                c.prompt,
                i,
                c.max_new_tokens,
                {"image_id": i},
            )
            for i in ids
        ]

    def metrics(self, records: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
        recs = records.get("chair", [])
        if not recs:
            return {}
        from ..intervals import caption_counts, chair_intervals
        from ..unparsed import degenerate_caption

        result = self.evaluator.evaluate([{"image_id": r["target"], "caption": r["resps"][0][0]} for r in recs])
        # n and 95% intervals next to every figure (keys *_ci95; mmfast.eval.intervals); captions that are
        # empty, wordless or looping (mmfast.eval.unparsed), counted so a table can flag them
        n_degenerate = sum(degenerate_caption(r["resps"][0][0]) is not None for r in recs)
        return {**result.as_dict(), **chair_intervals(caption_counts(result)).as_dict(), "n_degenerate": n_degenerate}

    def protocol(self) -> dict[str, Any]:
        from ..intervals import RESAMPLES, SEED

        c = self.cfg.chair
        return {
            "prompt": c.prompt,
            "max_new_tokens": c.max_new_tokens,
            "n_images": len(self.image_ids),
            "sampling": "ids from sorted file names, random.Random(seed).shuffle, first n"
            if not c.image_ids_file
            else c.image_ids_file,
            "seed": c.seed,
            "evaluator": self.evaluator.describe(),
            "intervals": {
                "chair_s": "Wilson score interval over captions, 95%",
                "chair_i, recall": "percentile bootstrap over captions (ratio of sums), 95%; Wilson of the pooled counts where every replicate is equal",
                "resamples": RESAMPLES,
                "seed": SEED,
            },
        }

    def side_files(self) -> dict[str, str]:
        return {"chair_image_ids.txt": "\n".join(str(i) for i in self.image_ids) + "\n"}


def read_image_ids(path: Path) -> list[int]:
    """``eval.chair.image_ids_file``: one COCO image id per line (blank lines skipped); a missing,
    unreadable, empty or malformed file is an error naming the line and the fix."""
    where = f"eval.chair.image_ids_file {str(path)!r}"
    try:
        text = path.read_text(encoding="utf-8-sig")  # a BOM (Windows editors) is not part of the first id
    except FileNotFoundError:
        raise InputError(f"{where} does not exist; give the path of a file with one image id per line") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{where} cannot be read ({exc}); give a text file with one image id per line") from None
    ids: list[int] = []
    seen: dict[int, int] = {}
    for no, line in enumerate(text.splitlines(), start=1):
        token = line.strip()
        if not token:
            continue
        if not (token.isascii() and token.isdigit()):
            raise InputError(f"{where} line {no}: {token[:40]!r} is not an image id (a whole number, one per line)")
        i = int(token)
        if i in seen:
            raise InputError(
                f"{where} line {no}: image id {i} is listed twice (first at line {seen[i]}); list each once"
            )
        seen[i] = no
        ids.append(i)
    if not ids:
        raise InputError(
            f"{where} lists no image ids; put one per line, or leave the key out to sample eval.chair.n_images"
        )
    return ids
