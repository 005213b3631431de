"""An lmms-eval POPE task on local files: the recipe's POPE questions and images (or, for ``video_pope``,
its video world's clips), no hub access.

    mmfast lmms-task world_eval                   # writes ~/.cache/mmfast/lmms_tasks/mmfast_world_pope/
    python -m lmms_eval --model mmfast --model_args recipe=world_eval \\
        --include_path ~/.cache/mmfast/lmms_tasks/mmfast_world_pope --tasks mmfast_world_pope --limit 8

    mmfast lmms-task video_world_pope --set eval.video_pope.video_world=/tmp/video_world
    python -m lmms_eval --model mmfast --model_args recipe=video_world_pope \\
        --include_path ~/.cache/mmfast/lmms_tasks/mmfast_video_pope --tasks mmfast_video_pope --limit 8

:func:`write_lmms_task` locates the recipe's data exactly as ``mmfast eval`` does and writes an
lmms-eval task directory for ``--include_path``. Which task: ``video_pope`` when it is the recipe's
only POPE task in ``eval.tasks`` (or ``task="video_pope"``, ``--task video_pope``), else image POPE
(the embedded world is generated on first use; ``eval.data.dataset: coco`` takes the official POPE
files and COCO val2014 images). The directory holds

- ``data/<split>.jsonl``: one line per question (``question_id``, ``image`` as an absolute path, or
  ``video``, the clip's frame directory, with ``sampling``, the recipe's ``num_frames`` / ``fps`` /
  ``video_fps``; ``question``, ``answer`` = the label, ``split``, ``parser``), read by ``datasets``'
  ``json`` builder;
- ``<name>_<split>.yaml``: one task per split (``generate_until``; the recipe's prompt split around
  ``{question}`` into lmms-eval's ``pre_prompt`` / ``post_prompt``; ``max_new_tokens`` from the recipe,
  greedy, no stop string, as ``mmfast eval``), metrics ``pope_accuracy``, ``pope_precision``,
  ``pope_recall``, ``pope_f1``, ``pope_yes_ratio``;
- ``<name>.yaml``: the group of the splits, with the unweighted mean of F1 and accuracy over splits
  (the three-split mean ``mmfast eval`` reports as ``mean_f1`` / ``mean_accuracy``);
- ``utils.py``: imports the functions below (so the task needs mmfast installed, as the model does).

A video question's visual is ``{"type": "video", "path": <clip>, "sampling": {...}}``: the mmfast
plugin samples its frames as ``mmfast eval`` does (:mod:`mmfast.eval._lmms_visuals`). Answers are
scored by mmfast's POPE parser named in the recipe (``eval.pope.parser`` / ``eval.video_pope.parser``,
:mod:`mmfast.eval.pope`), so an lmms-eval run of a recipe reports the figures ``mmfast eval`` reports
for the same questions.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ..errors import InputError
from .data import cache_root, resolve_data
from .pope import load_pope_questions, score_pope
from .tasks.pope import PopeTask, check_prompt
from .tasks.video_pope import NAME as VIDEO_POPE
from .tasks.video_pope import VideoPopeTask

logger = logging.getLogger(__name__)

METRICS = ("accuracy", "precision", "recall", "f1", "yes_ratio")


@dataclass(frozen=True)
class LmmsTask:
    """What :func:`write_lmms_task` wrote: the directory for ``--include_path`` and the names for ``--tasks``."""

    directory: Path
    group: str
    tasks: tuple[str, ...]  # one per POPE split
    n_questions: dict[str, int]


def default_output(name: str) -> Path:
    return cache_root() / "lmms_tasks" / name


def write_lmms_task(
    recipe: Any, output: str | Path | None = None, name: str | None = None, task: str | None = None
) -> LmmsTask:
    """Write the lmms-eval task directory for ``recipe``'s POPE (or ``video_pope``) section (see the
    module docstring); ``task`` picks one where the recipe lists both."""
    cfg = recipe.eval
    kind = _kind(cfg, task)
    data = resolve_data(cfg, [kind])
    if kind == "video_pope":
        name, split_rows, prompt, max_new = _video_pope_rows(cfg, data, name)
        where = "eval.video_pope.prompt"
    else:
        name, split_rows, prompt, max_new = _pope_rows(cfg, data, name)
        where = "eval.pope.prompt"
    if not name.replace("_", "").isalnum():
        raise InputError(
            f"task name {name!r}: use letters, digits and underscores (it becomes lmms-eval's --tasks name)"
        )
    pre, post = _prompt_parts(prompt, where)
    out = Path(output).expanduser() if output is not None else default_output(name)
    _claim(out)
    (out / "data").mkdir(parents=True, exist_ok=True)
    counts: dict[str, int] = {}
    tasks = []
    for split, rows in split_rows.items():
        jsonl = (out / "data" / f"{split}.jsonl").resolve()
        jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
        counts[split] = len(rows)
        task_name = f"{name}_{split}"
        tasks.append(task_name)
        (out / f"{task_name}.yaml").write_text(_task_yaml(task_name, split, jsonl, pre, post, max_new))
    (out / f"{name}.yaml").write_text(_group_yaml(name, tasks))
    (out / "utils.py").write_text(_UTILS)
    logger.info("wrote lmms-eval task %s (%s) to %s", name, ", ".join(f"{s}: {n}" for s, n in counts.items()), out)
    return LmmsTask(out.resolve(), name, tuple(tasks), counts)


#: written first into a task directory: marks it as mmfast's, so a rerun may write into it again
MARKER = ".mmfast-lmms-task"


def _claim(out: Path) -> None:
    """Accept ``out`` for a task directory: absent, empty, or one mmfast wrote (its :data:`MARKER`, or, written
    before the marker, mmfast's ``utils.py``); refuse a file, or a folder of other files (a task writes
    ``utils.py``, ``data/`` and YAML files there and would overwrite files of those names). Then mark it."""
    if out.exists() and not out.is_dir():
        raise InputError(
            f"output {str(out)!r} is a file, not a directory; give --output a directory (created if missing)"
        )
    if out.is_dir() and any(out.iterdir()) and not (out / MARKER).is_file():
        utils = out / "utils.py"
        if not (utils.is_file() and utils.read_text(encoding="utf-8", errors="replace") == _UTILS):
            shown = sorted(p.name for p in out.iterdir())
            raise InputError(
                f"output directory {out} is not empty ({', '.join(shown[:5])}{' ...' if len(shown) > 5 else ''}) and "
                f"is not an lmms-eval task directory mmfast wrote (no {MARKER}); a task writes utils.py, data/ and "
                "YAML files there and would overwrite files of those names: use another --output (or an empty directory)"
            )
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("an lmms-eval task directory written by `mmfast lmms-task`\n")


def _kind(cfg: Any, task: str | None) -> str:
    """``pope`` or ``video_pope``: ``task`` if given, else the recipe's one POPE task (image POPE by default)."""
    kinds = ("pope", "video_pope")
    if task is not None:
        if task not in kinds:
            raise InputError(f"task {task!r}: mmfast lmms-task writes {' or '.join(kinds)}")
        return task
    listed = [t for t in kinds if t in cfg.tasks]
    if len(listed) > 1:
        raise InputError(
            "the recipe's eval.tasks lists both pope and video_pope; pick one with --task pope or --task video_pope"
        )
    return listed[0] if listed else "pope"


def _prompt_parts(template: str, where: str) -> tuple[str, str]:
    """The text before and after the question in ``template`` (lmms-eval's ``pre_prompt`` / ``post_prompt``)."""
    check_prompt(template, where)
    marker = "\x00"
    text = template.format(question=marker)
    if text.count(marker) != 1:
        raise InputError(
            f"{where} {template!r} holds {{question}} {text.count(marker)} times; an lmms-eval task puts the question "
            "once, between pre_prompt and post_prompt"
        )
    pre, post = text.split(marker)
    return pre, post


def _pope_rows(cfg: Any, data: Any, name: str | None) -> tuple[str, dict[str, list[dict]], str, int]:
    pope = cfg.pope
    rows = {}
    for split, path in PopeTask.required_files(cfg, data).items():
        rows[split] = [
            {
                "question_id": q.question_id,
                "image": str((data.image_dir / q.image).resolve()),
                "question": q.text,
                "answer": q.label,
                "split": split,
                "parser": pope.parser,
            }
            for q in load_pope_questions(path, strict=pope.strict_version)
        ]
    return name or f"mmfast_{data.dataset}_pope", rows, pope.prompt, pope.max_new_tokens


def _video_pope_rows(cfg: Any, data: Any, name: str | None) -> tuple[str, dict[str, list[dict]], str, int]:
    """The rows of ``mmfast eval``'s own video_pope samples (the task checks the video world and its files)."""
    task = VideoPopeTask(cfg, data)
    opts = task.options
    rows: dict[str, list[dict]] = {}
    for s in task.samples(None):
        split = s.task.removeprefix(f"{VIDEO_POPE}_")
        sampling = s.video_sampling
        rows.setdefault(split, []).append(
            {
                "question_id": s.meta["question_id"],
                "video": str(s.video.resolve()),
                "sampling": {"num_frames": sampling.num_frames, "fps": sampling.fps, "video_fps": sampling.video_fps},
                "question": s.meta["question"],
                "answer": s.target,
                "split": split,
                "parser": opts.parser,
            }
        )
    return name or "mmfast_video_pope", rows, opts.prompt, opts.max_new_tokens


def _yaml_str(text: str) -> str:
    """``text`` as one double-quoted YAML scalar in ASCII (YAML's own escapes: JSON's would turn a character
    outside the BMP into a surrogate pair, which YAML reads as two lone surrogates)."""
    return yaml.safe_dump(text, default_style='"', width=float("inf")).rstrip("\n")


def _task_yaml(task: str, split: str, jsonl: Path, pre: str, post: str, max_new_tokens: int) -> str:
    metrics = "".join(
        f"  - metric: pope_{m}\n    aggregation: !function utils.aggregate_{m}\n    higher_is_better: {str(m != 'yes_ratio').lower()}\n"
        for m in METRICS
    )
    return (
        f"# written by `mmfast lmms-task` (mmfast.eval.lmms_tasks); POPE {split} split on local files\n"
        "# until: [] -- no stop string, as mmfast eval (lmms-eval's default would cut answers at a blank line)\n"
        f"task: {task}\n"
        "dataset_path: json\n"
        "dataset_kwargs:\n"
        "  data_files:\n"
        f"    {split}: {_yaml_str(str(jsonl))}\n"
        f"test_split: {split}\n"
        "output_type: generate_until\n"
        "doc_to_visual: !function utils.doc_to_visual\n"
        "doc_to_text: !function utils.doc_to_text\n"
        "doc_to_target: answer\n"
        "generation_kwargs:\n"
        f"  max_new_tokens: {int(max_new_tokens)}\n"
        "  until: []\n"
        "  temperature: 0\n"
        "  do_sample: false\n"
        "  num_beams: 1\n"
        "process_results: !function utils.process_results\n"
        "metric_list:\n"
        f"{metrics}"
        "lmms_eval_specific_kwargs:\n"
        "  default:\n"
        f"    pre_prompt: {_yaml_str(pre)}\n"
        f"    post_prompt: {_yaml_str(post)}\n"
        "metadata:\n"
        "  version: 0.0\n"
    )


def _group_yaml(group: str, tasks: Sequence[str]) -> str:
    return (
        "# written by `mmfast lmms-task`: the POPE splits, with the unweighted mean over splits\n"
        f"group: {group}\n"
        "task:\n" + "".join(f"  - {t}\n" for t in tasks) + "aggregate_metric_list:\n"
        "  - metric: pope_f1\n    aggregation: mean\n    weight_by_size: false\n"
        "  - metric: pope_accuracy\n    aggregation: mean\n    weight_by_size: false\n"
        "metadata:\n"
        "  version: 0.0\n"
    )


_UTILS = '''"""lmms-eval functions of the task written by `mmfast lmms-task` (they live in mmfast.eval.lmms_tasks)."""

from mmfast.eval.lmms_tasks import (  # noqa: F401
    aggregate_accuracy,
    aggregate_f1,
    aggregate_precision,
    aggregate_recall,
    aggregate_yes_ratio,
    doc_to_text,
    doc_to_visual,
    process_results,
)
'''


# -- the task's functions (lmms-eval calls them through the written utils.py) -------------------------


def doc_to_visual(doc: dict[str, Any]) -> list:
    """The question's image, read from disk; or its clip, as a video dict with the recipe's sampling."""
    from PIL import Image

    if doc.get("video") is not None:
        return [{"type": "video", "path": doc["video"], "sampling": doc["sampling"]}]
    with Image.open(doc["image"]) as im:
        return [im.convert("RGB")]


def doc_to_text(doc: dict[str, Any], lmms_eval_specific_kwargs: dict[str, Any] | None = None) -> str:
    kw = lmms_eval_specific_kwargs or {}
    return f"{kw.get('pre_prompt', '')}{doc['question']}{kw.get('post_prompt', '')}"


def process_results(doc: dict[str, Any], results: Sequence[str]) -> dict[str, dict[str, Any]]:
    """One record per metric; the aggregations score them with the recipe's parser (``doc["parser"]``)."""
    record = {"question_id": doc["question_id"], "label": doc["answer"], "answer": results[0], "parser": doc["parser"]}
    return {f"pope_{m}": record for m in METRICS}


def _metrics(records: Sequence[dict[str, Any]]):
    modes = {r["parser"] for r in records}
    if len(modes) != 1:
        raise InputError(f"POPE records scored with different parsers {sorted(modes)}")
    return score_pope(records, modes.pop())


def aggregate_accuracy(records: Sequence[dict[str, Any]]) -> float:
    return _metrics(records).accuracy


def aggregate_precision(records: Sequence[dict[str, Any]]) -> float:
    return _metrics(records).precision


def aggregate_recall(records: Sequence[dict[str, Any]]) -> float:
    return _metrics(records).recall


def aggregate_f1(records: Sequence[dict[str, Any]]) -> float:
    return _metrics(records).f1


def aggregate_yes_ratio(records: Sequence[dict[str, Any]]) -> float:
    return _metrics(records).yes_ratio
