"""``mmfast eval``: run a recipe's evaluation tasks, crash-safe and resumable.

Per-sample records are appended to ``samples.jsonl`` as each batch finishes (see
:mod:`mmfast.eval.records`); rerunning the same command skips finished samples whose inputs are
unchanged (each record carries a fingerprint of its inputs, :mod:`mmfast.eval.fingerprint`: the
sample, the run identity and every byte of the weights, the methods' own included; ``eval.batch_size`` and
``eval.max_failures`` change no answer and are not part of it, a calibrated budget's calibration set is),
recomputes those whose inputs changed, and retries failed ones. The output directory is locked for
the run and only mmfast's own files in it are ever removed (:mod:`mmfast.eval.rundir`).

Samples are images or videos (a directory of frames, through the model's video input; a video task
on a family without video input is refused before the model loads). Failures are loud: a sample whose
image or video frame is missing or corrupt (or whose generation raises) is
recorded with its error, never as an empty answer; the run aborts as soon as more than
``floor(eval.max_failures * planned)`` samples failed (``max_failures: 0`` stops at the first
failure), and a run that finishes with failed samples counts and lists them in ``summary.json``
(``counts.failed``, ``failures``) and in the log, and ``mmfast eval`` exits 3 (see
:data:`EXIT_SAMPLES_FAILED`; ``--allow-failures`` makes it exit 0). ``summary.json`` holds the
metrics by task (``metrics.<task>.*``: ``metrics.pope.<split>.*``, ``metrics.pope.mean_f1``,
``metrics.chair.*``), token accounting and the full protocol (model, recipe + hash, prompts,
decoding, parser, file checksums, seeds, package versions). Tasks come from the registry
(:data:`mmfast.registry.TASKS`); the runner knows none of them by name.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import subprocess
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .. import compat
from ..capabilities import ModelFacts, check_model_config, media_refusal, model_facts, video_families
from ..config import Recipe, load_recipe
from ..errors import (
    EXIT_SAMPLES_FAILED,  # noqa: F401 (re-exported)
    IncompatibleRecipeError,
    InputError,
    MMFastError,
    RunAbortedError,
    SamplesFailedError,  # noqa: F401 (re-exported)
)
from ..model import load_model
from ..pipeline import apply
from ..progress import Progress
from ..pruning._budget import CalibrationSet
from ..registry import PRUNERS
from ..video import frame_files, sample_source, source_frames
from . import rundir
from .data import cache_root, resolve_data
from .distributed import barrier, fold_shards, gather_and_finish, launch_data_parallel, shard_info
from .fingerprint import (
    file_sha256,
    hash_tensors,
    model_files_fingerprint,
    sample_fingerprint,
    weights_fingerprint,
)
from .records import RecordStore, count_failures, digest_of, record_problem, write_atomic
from .tasks import Sample, Task, build_tasks

if TYPE_CHECKING:
    from ..models.base import VLMAdapter

logger = logging.getLogger(__name__)


def failure_budget(max_failures: float, n_planned: int) -> int:
    """How many failed samples a run of ``n_planned`` samples tolerates: ``floor(max_failures * n)``
    (``0``: none, the run stops at the first failure; ``1.0``: all)."""
    return int(max_failures * n_planned + 1e-9)


def _input_missing(sample: Sample) -> bool:
    """Whether a sample's input is absent: its image file, or its video's directory of frames."""
    if sample.video is None:
        return not Path(sample.image).is_file()
    return not sample.video.is_dir() or not frame_files(sample.video)


def _check_images(plan, max_failures: float, rank: int, world: int) -> None:
    """Every planned image (or video: a directory with frames) exists, or the missing ones fit the
    failure budget (then a warning); otherwise refuse before any model is loaded, naming them."""
    absent = [s for _, samples in plan for s in samples if _input_missing(s)]
    missing = sorted({str(s.media) for s in absent})
    if not missing:
        return
    noun = " or ".join(sorted({"image(s)" if s.video is None else "video(s)" for s in absent}))
    n_bad = len(absent)
    n_total = sum(len(samples) for _, samples in plan)
    shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
    if n_bad > failure_budget(max_failures, n_total):
        raise InputError(
            f"{len(missing)} {noun} of this evaluation are missing ({shown}): {n_bad} of {n_total} "
            f"samples would fail, more than eval.max_failures={max_failures} allows; fix the data root or the "
            "question files"
        )
    if rank == 0:
        logger.warning(
            "%d %s missing (%s): %d of %d samples will fail (within eval.max_failures=%s)",
            len(missing),
            noun,
            shown,
            n_bad,
            n_total,
            max_failures,
        )


def check_media(recipe: Recipe, plan, model: VLMAdapter | ModelFacts | None) -> None:
    """Refuse, before any compute, an evaluation whose samples the model or the recipe's methods
    cannot take: videos on a family without video input (``model``: the loaded adapter, or the facts
    of its config; None when neither is known yet), videos under an images-only method, images under a
    method that needs a video."""
    video_tasks = [task.name for task, samples in plan if any(s.video is not None for s in samples)]
    has_images = any(s.image is not None for _, samples in plan for s in samples)
    problem = media_refusal(recipe, images=has_images, videos=bool(video_tasks), model=model)
    if problem:
        what = "videos" if video_tasks else "images"
        raise IncompatibleRecipeError(f"{problem}, and this evaluation gives the model {what}; change the recipe")
    if video_tasks and model is not None and not model.features.video:
        raise IncompatibleRecipeError(
            f"evaluation task(s) {', '.join(video_tasks)} give the model videos, but {recipe.model.name} is a "
            f"{model.family} model, which takes no video input; use a checkpoint of a family with video input "
            f"({', '.join(video_families())}), or leave the task(s) out"
        )
    if video_tasks:
        calibrated = [
            f"pruning[{i}] ({st.method})"
            for i, st in enumerate(recipe.pruning)
            if st.budget and getattr(PRUNERS.get(st.method).cls, "calibrated", False)
        ]
        if calibrated:
            raise IncompatibleRecipeError(
                f"{calibrated[0]} calibrates its token budget on images, which says nothing of the videos of "
                f"evaluation task(s) {', '.join(video_tasks)}; give the method its own thresholds in params instead "
                "of a budget, or leave the video task(s) out"
            )


def evaluation_calibration(recipe: Recipe, limit: int | None = None):
    """:func:`calibration_set` of the evaluation ``run_eval(recipe, limit)`` would plan (for a
    benchmark's timing sessions, which must run with the evaluation's calibrated thresholds)."""
    cfg = recipe.eval
    limit = limit if limit is not None else cfg.limit
    tasks = build_tasks(cfg, resolve_data(cfg, cfg.tasks), cache_dir=cache_root())
    return calibration_set([(task, task.samples(limit)) for task in tasks])


def calibration_set(plan):
    """The samples token budgets are calibrated on: a spread of the evaluation's own (every task in its
    share), so a calibrated method lands on its budget in this evaluation's mean."""

    images = [s for _, samples in plan for s in samples if s.image is not None]
    return CalibrationSet.spread(images) if images else None


def output_dir(recipe: Recipe, output: str | None) -> Path:
    """The run's directory: ``output``, else the recipe's ``output.dir`` (``~`` is the home directory)."""
    return Path(output or recipe.output.dir.format(name=recipe.name)).expanduser()


#: eval settings that change no answer (how many failures a run tolerates; how samples are batched,
#: as mmfast's answers do not depend on batch composition): left out of the run's identity, so a run
#: stopped by max_failures resumes with a looser one, or with another batch_size
ANSWER_NEUTRAL_EVAL_KEYS = ("max_failures", "batch_size")


def run_identity(recipe: Recipe) -> str:
    """What a run directory's results are results of: :meth:`Recipe.hash` less the
    :data:`ANSWER_NEUTRAL_EVAL_KEYS` (16 hex digits). ``eval.limit`` stays in it (every committed run's
    records are fingerprinted with it): a run resumes with more or fewer samples through ``--limit``, and
    ``_guard`` says so where only the recipe's limit changed."""
    return recipe.hash(leave_out_eval=ANSWER_NEUTRAL_EVAL_KEYS)


def _only_limit_differs(old: dict | None, recipe: Recipe, identity: str) -> bool:
    """The recipe a run directory recorded (``run.json``'s ``recipe``) is ``recipe`` (of run identity
    ``identity``) but for ``eval.limit``."""
    if not isinstance(old, dict):
        return False
    try:
        earlier = load_recipe(old)
    except MMFastError:  # recorded by an older mmfast, no longer valid: not the same run anyway
        return False
    same_limit = dataclasses.replace(earlier, eval=dataclasses.replace(earlier.eval, limit=recipe.eval.limit))
    return run_identity(same_limit) == identity


def calibration_identity(recipe: Recipe, plan) -> str | None:
    """The identity of the calibration set a calibrated budget (MustDrop, ZipVL) is fitted on, or None
    when no stage of the recipe is calibrated. The set is a spread of the planned samples, so another
    ``--limit`` calibrates other thresholds: the answers depend on it, and so does every fingerprint. It
    covers the images' bytes, not only their paths: an image replaced under its name is another calibration."""

    if not any(st.budget and getattr(PRUNERS.get(st.method).cls, "calibrated", False) for st in recipe.pruning):
        return None
    calibration = calibration_set(plan)
    if calibration is None:
        return None
    return f"{calibration.identity}:{digest_of(file_sha256(Path(p)) for p in calibration.images)}"


def methods_fingerprint(session) -> str | None:
    """The content fingerprint of the weights a session's methods brought besides the model's own
    (Dynamic-LLaVA's trained predictors, HICom's modules, a draft model): every tensor of each ``nn.Module``
    a pruner, the decoder or the drafter holds (directly, or in a list, tuple or dict), by name and every
    byte (:func:`~mmfast.eval.fingerprint.hash_tensors`), less the model's own tensors. None when the
    methods hold no such tensor, so the fingerprints of runs without them are unchanged. Retrained weights
    under the same path change it."""
    own = {id(t) for t in (*session.mm.model.parameters(), *session.mm.model.buffers())}
    holders = {"pruning": session.pruners, "decoding": [session.decoder], "speculative": [session.drafter]}
    named = [
        (f"{where}[{i}].{attr}[{j}].{name}", t)
        for where, objs in holders.items()
        for i, obj in enumerate(objs)
        for attr, value in (sorted(vars(obj).items()) if obj is not None else ())
        for j, m in enumerate(_modules_in(value))
        for name, t in m.state_dict(keep_vars=True).items()
        if id(t) not in own
    ]
    if not named:
        return None
    h = hashlib.sha256()
    hash_tensors(h, named)
    return h.hexdigest()[:16]


def _modules_in(value: Any) -> list:
    """The ``nn.Module`` objects ``value`` is or holds (in a list, tuple or dict, one level down)."""
    if isinstance(value, torch.nn.Module):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    return [v for v in value if isinstance(v, torch.nn.Module)] if isinstance(value, (list, tuple)) else []


def planned_fingerprints(recipe: Recipe, plan, weights: str, methods: str | None = None) -> dict[str, str]:
    """doc_id -> :func:`~mmfast.eval.fingerprint.sample_fingerprint` of every planned sample (``methods``: the
    :func:`methods_fingerprint` of the weights the recipe's methods brought)."""

    identity = run_identity(recipe)
    calibration = calibration_identity(recipe, plan)
    if calibration is not None:
        identity += f"/calibration:{calibration}"
    if methods is not None:
        identity += f"/methods:{methods}"
    return {s.doc_id: sample_fingerprint(s, identity, weights) for _, samples in plan for s in samples}


def _guard(out: Path, recipe: Recipe, fingerprint: str, files: list[str], model_files: str | None = None) -> None:
    """Refuse to mix results of different recipes, of different weights, or of a model whose config,
    processor, chat template or tokenizer changed (``model_files``:
    :func:`~mmfast.eval.fingerprint.model_files_fingerprint`) in one directory (unless output.overwrite,
    which removes the earlier run's own files and starts over); record in ``run.json`` every file this
    run writes."""

    old = rundir.read_run_json(out)
    if old is None:
        rundir.check_recognised(out)
    else:
        problem = None
        identity = run_identity(recipe)
        if "run_identity" not in old:
            problem = (
                "results of an older mmfast, whose weights fingerprint read only the first values of each tensor "
                "(none of its records can be matched to these weights)"
            )
        elif old["run_identity"] != identity:
            problem = f"results of another recipe (identity {old['run_identity']} != {identity})"
            if _only_limit_differs(old.get("recipe"), recipe, identity):
                earlier = old["recipe"].get("eval", {}).get("limit")
                problem += (
                    f": only eval.limit differs ({earlier} -> {recipe.eval.limit}), and its records are fingerprinted "
                    f"with the recipe's limit; to run more or fewer samples of this run keep eval.limit: {earlier} and "
                    "pass --limit N"
                )
        elif old.get("weights_fingerprint", fingerprint) != fingerprint:
            problem = f"results of other model weights (fingerprint {old.get('weights_fingerprint')} != {fingerprint})"
        elif model_files is not None and old.get("model_files_fingerprint", model_files) != model_files:
            problem = (
                "results of the model with another config, processor, chat template or tokenizer "
                f"(fingerprint {old.get('model_files_fingerprint')} != {model_files})"
            )
        if problem:
            if not recipe.output.overwrite:
                raise InputError(
                    f"{out} holds {problem}; use another --output, or set output.overwrite: true to start over"
                )
            logger.warning("%s holds %s; output.overwrite is set: starting over", out, problem)
            rundir.remove_own(out, old)
            old = None
        else:
            files = list(dict.fromkeys(rundir.listed_files(old, out) + files))
            if model_files is None:  # a model not loaded from a directory this time: the run's digest stays
                model_files = old.get("model_files_fingerprint")
    rundir.check_own_files(out, files)
    rundir.write_run_json(
        out,
        {
            "recipe_hash": recipe.hash(),
            "run_identity": run_identity(recipe),
            "weights_fingerprint": fingerprint,
            **({"model_files_fingerprint": model_files} if model_files is not None else {}),
            "recipe": recipe.to_dict(),
            "files": files,
        },
    )


def _shard_device(device: str, rank: int, world: int) -> str:
    """In a data-parallel run each process takes its own GPU (``cuda`` -> ``cuda:<local rank>``)."""

    if world > 1 and torch.cuda.is_available() and device in ("auto", "cuda"):
        return f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}"
    return device


def git_sha(source: str | Path = __file__) -> str | None:
    """HEAD of the mmfast checkout ``source`` (this module) lies in, or None: not a checkout, no git, or an
    installed mmfast inside some other repository (a project's venv), whose HEAD is not mmfast's."""
    package = Path(source).resolve().parents[1]  # mmfast/eval/runner.py -> mmfast/
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--show-toplevel", "HEAD"], cwd=package, capture_output=True, text=True, timeout=5
        )
        top, sha = done.stdout.splitlines()
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    if done.returncode != 0:  # no repository, or one without a commit
        return None
    return sha if (Path(top) / package.name).resolve() == package else None


def check_plan(plan: list[tuple[Task, list[Sample]]]) -> None:
    """Refuse a plan whose samples collide: a ``doc_id`` planned twice, or one record group used by two
    tasks, would mix answers on resume or in scoring."""
    doc_owner: dict[str, str] = {}
    group_owner: dict[str, str] = {}
    for task, samples in plan:
        for s in samples:
            if s.doc_id in doc_owner:
                raise InputError(
                    f"doc_id {s.doc_id!r} is planned twice (by evaluation tasks {doc_owner[s.doc_id]!r} and {task.name!r}); "
                    "each sample needs its own doc_id, prefixed with its task's name"
                )
            doc_owner[s.doc_id] = task.name
            if group_owner.setdefault(s.task, task.name) != task.name:
                raise InputError(
                    f"evaluation tasks {group_owner[s.task]!r} and {task.name!r} both use record group {s.task!r}; "
                    "prefix each task's record groups (Sample.task) with its name"
                )


def side_files(tasks: list[Task]) -> dict[str, str]:
    """Every task's side files (e.g. CHAIR's sampled image ids), written next to the records: file name -> text."""
    files: dict[str, str] = {}
    owner: dict[str, str] = {}
    for task in tasks:
        for fname, text in task.side_files().items():
            if Path(fname).name != fname or fname in ("run.json", "summary.json") or fname.startswith("samples."):
                raise InputError(
                    f"evaluation task {task.name!r}: side file {fname!r} must be a plain file name, not one of the run's own files"
                )
            if owner.setdefault(fname, task.name) != task.name:
                raise InputError(f"evaluation tasks {owner[fname]!r} and {task.name!r} both write side file {fname!r}")
            files[fname] = text
    return files


def _media(sample: Sample) -> dict[str, str]:
    """A record's input: ``{"image": file name}``, or ``{"video": directory name}`` (the clip)."""
    return {"image": sample.image.name} if sample.video is None else {"video": sample.video.name}


def _record(sample: Sample, result, text_filter: Callable[[str, Sample], str], fingerprint: str) -> dict[str, Any]:
    return {
        "doc_id": sample.doc_id,
        "task": sample.task,
        "target": sample.target,
        "resps": [[result.text]],
        "filtered_resps": [text_filter(result.text, sample)],
        **_media(sample),
        "prompt": sample.prompt,
        "meta": sample.meta,
        "fingerprint": fingerprint,
        **{k: v for k, v in result.to_dict().items() if k != "text"},
    }


def _error_record(sample: Sample, exc: BaseException, fingerprint: str) -> dict[str, Any]:
    return {
        "doc_id": sample.doc_id,
        "task": sample.task,
        "target": sample.target,
        **_media(sample),
        "prompt": sample.prompt,
        "meta": sample.meta,
        "fingerprint": fingerprint,
        "error": f"{type(exc).__name__}: {exc}",
    }


def check_video_sampling(plan, mm) -> None:
    """Refuse, before any compute, a frame sampling that no video of the plan can take on the loaded model
    (``num_frames: 1`` rounds to 0 frames on Qwen-VL; an odd count rounds past a clip's frames; ``fps``
    leaves none of a short clip), which would otherwise fail every sample at generation. Videos that are
    missing are left to ``_check_images``."""
    seen: set[tuple[Path, Any]] = set()
    rule = None
    for _, samples in plan:
        for s in samples:
            if s.video is None or (s.video, s.video_sampling) in seen or _input_missing(s):
                continue
            seen.add((s.video, s.video_sampling))
            rule = rule or mm.adapter.frame_rule(mm.video_settings)
            total, rate = source_frames(s.video, f"video {str(s.video)!r}")
            try:
                sample_source(total, rate, s.video_sampling, rule, f"{s.doc_id}: video {str(s.video)!r}")
            except InputError as exc:
                raise InputError(
                    f"{exc}; every sample of that video would fail on {mm.adapter.family}: change the task's "
                    "frame sampling"
                ) from None


def batch_meta(samples: list[Sample]) -> list[dict[str, Any]]:
    """The per-sample meta that reaches the session (``PreparedBatch.meta``): the task's meta plus the
    sample's stable ``doc_id`` (what per-sample random generators are seeded with)."""
    return [{**s.meta, "doc_id": s.doc_id} for s in samples]


def prepare_batch(mm, samples: list[Sample]):
    """The prepared batch of ``samples``: their images, or their videos through the model's video input
    (``MMModel.prepare(videos=...)``, sampled by the samples' one ``video_sampling``)."""
    images, prompts, meta = [s.image for s in samples], [s.prompt for s in samples], batch_meta(samples)
    if all(s.video is None for s in samples):
        return mm.prepare(images, prompts, meta=meta)
    sampling = {s.video_sampling for s in samples if s.video is not None}
    if len(sampling) > 1:
        raise ValueError(f"a batch samples its videos one way; got {sorted(map(str, sampling))}")
    (how,) = sampling
    videos = [s.video for s in samples]
    return mm.prepare(
        images, prompts, meta=meta, videos=videos, num_frames=how.num_frames, fps=how.fps, video_fps=how.video_fps
    )


def _run_batch(session, samples: list[Sample], text_filter, fps: dict[str, str]) -> list[dict[str, Any]]:
    """Generate for a batch; on failure, isolate the failing samples one by one."""
    try:
        batch = prepare_batch(session.mm, samples)
        results = session.run(batch, max_new_tokens=samples[0].max_new_tokens)
        return [_record(s, r, text_filter, fps[s.doc_id]) for s, r in zip(samples, results, strict=True)]
    except Exception as exc:
        if len(samples) > 1:
            logger.warning(
                "a batch of %d samples (%s ...) failed (%s: %s); retrying them one at a time",
                len(samples),
                samples[0].doc_id,
                type(exc).__name__,
                exc,
            )
            return [rec for s in samples for rec in _run_batch(session, [s], text_filter, fps)]
        if not isinstance(exc, MMFastError):
            logger.warning("sample %s failed:\n%s", samples[0].doc_id, traceback.format_exc())
        else:
            logger.warning("sample %s failed: %s", samples[0].doc_id, exc)
        return [_error_record(samples[0], exc, fps[samples[0].doc_id])]


def _check_limit(limit: int | None) -> None:
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise InputError(
            f"limit must be a whole number >= 1 (samples per task/split), got {limit!r}; leave it out to run every sample"
        )


def run_eval(
    recipe: Recipe,
    *,
    limit: int | None = None,
    output: str | None = None,
    num_processes: int = 1,
    mm=None,
) -> dict[str, Any]:
    """Run every task of ``recipe.eval``; returns (and writes) the summary."""
    cfg = recipe.eval
    if not cfg.tasks:
        raise InputError("the recipe has no eval.tasks (add e.g. tasks: [pope, chair])")
    _check_limit(limit)
    if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
        raise InputError(f"num_processes must be a whole number >= 1, got {num_processes!r}")
    if num_processes > 1:
        return launch_data_parallel(recipe, limit=limit, out=output_dir(recipe, output), num_processes=num_processes)
    limit = limit or cfg.limit
    out = output_dir(recipe, output)

    rank, world = shard_info()
    data = resolve_data(cfg, cfg.tasks)  # every input checked before anything is written
    tasks = build_tasks(cfg, data, cache_dir=cache_root())
    plan = [(task, task.samples(limit)) for task in tasks]
    check_plan(plan)
    _check_images(plan, cfg.max_failures, rank, world)  # before the model loads: no hour-long load for a typo
    if mm is None:
        check_model_config(recipe)  # the methods' layers and grids against the model's config
    check_media(recipe, plan, model_facts(recipe) if mm is None else mm.adapter)  # videos on a family with video input
    if mm is not None:
        check_video_sampling(plan, mm)  # the family's frame rule against every clip, before any compute
    extra_files = side_files(tasks)
    lock = None
    if rank == 0 and not rundir.check_held_by_launcher(out):
        lock = rundir.claim(out)  # before loading the model: a second run into the directory stops at once
    try:
        return _run_locked(recipe, out, plan, extra_files, mm, rank, world, barrier)
    finally:
        if lock is not None:
            lock.release()


def _run_locked(
    recipe: Recipe, out: Path, plan, extra_files: dict[str, str], mm, rank: int, world: int, barrier
) -> dict[str, Any]:

    cfg = recipe.eval
    if mm is None:
        mm = load_model(recipe.model, device=_shard_device(recipe.model.device, rank, world))
        check_media(recipe, plan, mm.adapter)  # a model whose config could not be read before it loaded
        check_video_sampling(plan, mm)  # the family's frame rule against every clip, before any compute
    weights = weights_fingerprint(mm.model)  # hashed once a run: weights changed between runs are seen
    if rank == 0:
        # so are the model's config, processor, chat template and tokenizer, edited under the same path
        _guard(out, recipe, weights, rundir.own_files(world, extra_files), model_files_fingerprint(mm))
        for fname, text in extra_files.items():
            (out / fname).write_text(text)

    t0 = time.perf_counter()
    with apply(mm, recipe, calibration=calibration_set(plan)) as session:
        # and so are the weights the methods loaded (trained predictors, draft models), retrained under the same path
        fps = planned_fingerprints(recipe, plan, weights, methods_fingerprint(session))
        if rank == 0:
            prior = fold_shards(out, fps)  # one file to resume from, whichever process count wrote the records
        if world > 1:
            barrier()  # no shard writes before the main process has checked, claimed and folded the directory
            prior = prior if rank == 0 else RecordStore(out / rundir.SAMPLES, check=record_problem)
        quarantined = len(prior.quarantined) if rank == 0 else 0
        n_total = sum(len(s) for _, s in plan)
        budget = failure_budget(cfg.max_failures, n_total)
        # one process: it appends to samples.jsonl; N: each to its own shard, merged at the end
        store = prior if world == 1 else RecordStore(out / rundir.shard_name(rank), check=record_problem)
        work = [(task, _todo(task, samples, prior, fps, rank, world)) for task, samples in plan]
        pending = {s.doc_id for _, todo in work for s in todo}  # their old failures are not this run's (yet)
        for task, todo in work:
            where = f"{task.name} [rank {rank}]" if world > 1 else task.name
            bar = Progress(len(todo), where, report=bool(todo))  # a bar on a terminal, periodic log lines elsewhere
            for i in range(0, len(todo), cfg.batch_size):
                chunk = todo[i : i + cfg.batch_size]
                records = _run_batch(session, chunk, task.filter_response, fps)
                store.append(records)
                pending.difference_update(s.doc_id for s in chunk)
                bar.update(len(chunk))
                if any("error" in r for r in records):
                    _check_budget(store, pending, fps, budget, n_total, cfg.max_failures, out, rank, world)
            bar.close()
    store.compact()
    elapsed = time.perf_counter() - t0

    def finish_with(records: RecordStore) -> dict[str, Any]:
        return finish(recipe, out, plan, records, mm, elapsed, fps, weights, quarantined)

    if world == 1:
        return finish_with(store)
    summary = gather_and_finish(out, fps, finish_with)
    if summary["counts"]["failed"] > budget:  # the shards' failures together (each process checks as it goes)
        raise RunAbortedError(_too_many(summary["counts"]["failed"], n_total, cfg.max_failures, budget, out))
    return summary


def _todo(task: Task, samples: list[Sample], prior: RecordStore, fps: dict[str, str], rank: int, world: int):
    """This process's share (every ``world``-th) of the ``samples`` that ``prior`` holds no finished record
    of: the work left is split evenly, however far an earlier run's processes got (every process reads the
    same ``prior``, so the shares are disjoint)."""
    left = [s for s in samples if not prior.done(s.doc_id, fps[s.doc_id])]
    todo = left[rank::world]
    stale = [s for s in todo if prior.done(s.doc_id) and prior.stale(s.doc_id, fps[s.doc_id])]
    if stale:
        logger.warning(
            "%s: %d finished sample(s) were computed from other inputs (question, prompt, label or "
            "image changed under the same path); recomputing them",
            task.name,
            len(stale),
        )
    if len(left) < len(samples) and rank == 0:
        logger.info("%s: %d of %d samples already done (resuming)", task.name, len(samples) - len(left), len(samples))
    return todo


def _too_many(n_failed: int, n_total: int, max_failures: float, budget: int, out: Path, errors: str = "") -> str:
    first = f"; first errors: {errors}" if errors else " (listed in summary.json)"
    return (
        f"{n_failed} of {n_total} samples failed, more than eval.max_failures={max_failures} allows "
        f"({budget}){first}. Finished samples are saved in {out}; fix the cause and rerun."
    )


def _check_budget(store, pending, fps, budget: int, n_total: int, max_failures: float, out: Path, rank, world) -> None:
    """Stop the run once more samples failed in it than ``budget``: this run's failures (an old failure
    still waiting for its retry is not one), in every process (the other shards as far as written)."""
    failed = [r for r in store.failed() if r["doc_id"] not in pending and fps.get(r["doc_id"]) == r.get("fingerprint")]
    others = sum(count_failures(out / rundir.shard_name(r), fps) for r in range(world) if r != rank)
    if len(failed) + others > budget:
        errs = "; ".join(f"{r['doc_id']}: {r['error']}" for r in failed[:3])
        raise RunAbortedError(_too_many(len(failed) + others, n_total, max_failures, budget, out, errs))


def finish(
    recipe: Recipe,
    out: Path,
    plan,
    store: RecordStore,
    mm,
    elapsed: float,
    planned: dict[str, str],
    weights: str,
    quarantined: int,
) -> dict[str, Any]:
    """Score the planned samples whose records match their inputs (``planned``: doc_id -> fingerprint, of
    weights fingerprint ``weights``), and write ``summary.json`` (``quarantined``: damaged record lines moved
    aside when the run began)."""

    current = {d: r for d, r in store.records.items() if d in planned and r.get("fingerprint") == planned[d]}
    ok = [current[d] for d in planned if d in current and "error" not in current[d]]
    failed = [current[d] for d in planned if d in current and "error" in current[d]]
    missing = [d for d in planned if d not in current]
    store.arrange([d for d in planned if d in current])  # the scored records first, in plan order
    by_task: dict[str, list[dict[str, Any]]] = {}
    for r in ok:
        by_task.setdefault(r["task"], []).append(r)
    metrics = {}
    for task, samples in plan:
        groups = dict.fromkeys(s.task for s in samples)
        scored = task.metrics({g: by_task[g] for g in groups if g in by_task})
        if scored:
            metrics[task.name] = scored
    proto = protocol(recipe, mm, plan, weights)
    proto["samples_digest"] = digest_of(r["fingerprint"] for r in ok)
    summary = {
        "metrics": metrics,
        "counts": {
            "planned": len(planned),
            "finished": len(ok),
            "failed": len(failed),
            "not_run": len(missing),
            "quarantined_lines": quarantined,
        },
        "accounting": _accounting(ok),
        "protocol": proto,
        "elapsed_s": round(elapsed, 2),
        "failures": [{"doc_id": r["doc_id"], "error": r["error"]} for r in failed],
    }

    write_atomic(out / rundir.SUMMARY_JSON, json.dumps(summary, indent=2).encode("utf-8"))
    logger.info("wrote %s", out / rundir.SUMMARY_JSON)
    if failed:
        shown = "\n".join(f"  {r['doc_id']}: {r['error']}" for r in failed[:20])
        more = f"\n  ... and {len(failed) - 20} more (all listed in summary.json)" if len(failed) > 20 else ""
        logger.warning(
            "%d of %d samples FAILED; the metrics cover the other %d:\n%s%s",
            len(failed),
            len(planned),
            len(ok),
            shown,
            more,
        )
    if missing:
        logger.warning(
            "%d of %d planned samples have no current record (e.g. %s)", len(missing), len(planned), missing[0]
        )
    return summary


def _accounting(records: list[dict[str, Any]]) -> dict[str, float]:
    if not records:
        return {}
    keys = (
        "n_vision_tokens",
        "vision_tokens_layer_avg",
        "kv_bytes_prefill",
        "kv_bytes_end",
        "n_new_tokens",
        "flops_prefill",
        "flops_prefill_7b",
    )
    out = {f"mean_{k}": sum(r[k] for r in records) / len(records) for k in keys if all(k in r for r in records)}
    return {k: round(v, 3) for k, v in out.items()}


def protocol(recipe: Recipe, mm, plan, weights: str) -> dict[str, Any]:
    m = recipe.model
    return {
        "model": m.name,
        "weights_fingerprint": weights,
        "dtype": str(mm.dtype).removeprefix("torch."),
        "attn_implementation": m.attn_implementation,
        "recipe_name": recipe.name,
        "recipe_hash": recipe.hash(),
        "run_identity": run_identity(recipe),
        "recipe": recipe.to_dict(),
        "decoding": recipe.decoding._to_recipe(),
        "pruning": [s._to_recipe() for s in recipe.pruning],
        "speculative": recipe.speculative._to_recipe() if recipe.speculative else None,
        "batch_size": recipe.eval.batch_size,
        "tasks": {task.name: task.protocol() for task, _ in plan},
        "dataset": recipe.eval.data.dataset,
        "world_seed": recipe.eval.data.world_seed if recipe.eval.data.dataset == "world" else None,
        "versions": compat.versions(),
        "git_sha": git_sha(),
    }
