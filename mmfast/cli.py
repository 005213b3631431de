"""The ``mmfast`` command line.

    mmfast list [-v]                         registered methods by kind, and evaluation tasks
    mmfast validate RECIPE                   check a recipe, print the resolved config
    mmfast run RECIPE --image P --prompt T   answer one prompt
    mmfast eval RECIPE [--limit N] [--output DIR]
    mmfast bench RECIPE [--output DIR]
    mmfast report RUN_DIR... [--output DIR]
    mmfast rerender DIR...                   rewrite a bench's results.md + plots (n, 95% intervals), or an eval
                                             run's stale intervals in summary.json; no re-run
    mmfast lmms-task [RECIPE] [--output DIR] write the recipe's POPE (or video_pope) data as a local lmms-eval task

Exit codes: 0 ok, 2 bad input (the message names the file/key and the fix), 1 internal error,
3 evaluation samples failed (``mmfast eval``: more than ``eval.max_failures`` allow, or any at all in
a finished run unless ``--allow-failures``; they are counted and listed in ``summary.json``),
130 interrupted (Ctrl-C), 128 + N ended by signal N (e.g. 143 for SIGTERM).
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import math
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import yaml

from .errors import InputError

logger = logging.getLogger("mmfast")


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (0 or a negative count is a mistake, never "everything")."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (a frame rate; 0, a negative or nan is a mistake)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mmfast", description=__doc__.split("\n\n")[0])
    from . import __version__

    p.add_argument("--version", action="version", version=f"mmfast {__version__}")
    p.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("list", help="registered methods (grouped by kind), evaluation tasks, shipped recipes")
    s.add_argument("what", nargs="?", choices=["methods", "tasks", "recipes"], help="only this section")
    s.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="also show each method's parameters and each task's options, with defaults",
    )

    def recipe_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("recipe", help="YAML recipe path, or a shipped recipe's name (`mmfast list recipes`)")
        sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a recipe key")

    s = sub.add_parser("validate", help="check a recipe and print the resolved config")
    recipe_args(s)

    s = sub.add_parser("run", help="answer one prompt about one image (or a video)")
    recipe_args(s)
    s.add_argument("--image", action="append", default=[], help="image path (repeat for several images)")
    s.add_argument(
        "--video",
        default=None,
        help="a directory of frame images (sorted by name) or a video file (.mp4, ...; needs PyAV): Qwen-VL and "
        "OneVision families",
    )
    s.add_argument("--num-frames", type=_positive_int, default=None, help="sample this many frames of --video")
    s.add_argument("--fps", type=_positive_float, default=None, help="sample this many frames per second of --video")
    s.add_argument(
        "--video-fps",
        type=_positive_float,
        default=None,
        help="frames per second of --video's frames (a video file's own rate by default)",
    )
    s.add_argument("--prompt", required=True)
    s.add_argument("--max-new-tokens", type=_positive_int, default=None)
    s.add_argument("--json", action="store_true", help="print the full result as JSON")

    s = sub.add_parser("eval", help="run the recipe's evaluation tasks (POPE, CHAIR, ...)")
    recipe_args(s)
    s.add_argument("--limit", type=_positive_int, default=None, help="samples per task/split (>= 1)")
    s.add_argument("--output", default=None, help="output directory (default: the recipe's output.dir)")
    s.add_argument("--num-processes", type=_positive_int, default=1, help="data-parallel processes (>= 1)")
    s.add_argument(
        "--allow-failures",
        action="store_true",
        help="exit 0 even when samples failed (within eval.max_failures); they are still listed",
    )

    s = sub.add_parser("bench", help="run the recipe's benchmark (baseline vs methods, same process)")
    recipe_args(s)
    s.add_argument("--output", default=None)
    s.add_argument(
        "--limit",
        type=_positive_int,
        default=None,
        help="pruning / decoding benches: samples per task/split of every variant's evaluation (overrides "
        "eval.limit); speculative: timed samples (overrides bench.n_samples); unused by gpu_speed and video_cost",
    )
    s.add_argument(
        "--only",
        default=None,
        metavar="NAMES",
        help="comma-separated bench.compare variants to run (the baseline always runs)",
    )

    s = sub.add_parser("report", help="markdown/HTML report with plots from run directories")
    s.add_argument("runs", nargs="+")
    s.add_argument("--output", default="report")

    s = sub.add_parser(
        "rerender",
        help="rewrite a finished bench directory's results.md and plots (n, 95%% intervals), or a finished eval "
        "run's intervals recorded by an older method in its summary.json, without re-running",
    )
    s.add_argument("benches", nargs="+", metavar="DIR")

    s = sub.add_parser(
        "lmms-task",
        help="write the recipe's POPE questions and images (or video_pope's clips) as a local lmms-eval task "
        "(for --include_path)",
    )
    s.add_argument(
        "recipe",
        nargs="?",
        default="world_eval",
        help="recipe whose eval.data / eval.pope (or eval.video_pope) define the task (default: world_eval)",
    )
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a recipe key")
    s.add_argument("--output", default=None, help="task directory (default: ~/.cache/mmfast/lmms_tasks/<name>)")
    s.add_argument(
        "--name",
        default=None,
        help="lmms-eval group name (default: mmfast_<dataset>_pope, or mmfast_video_pope); tasks are <name>_<split>",
    )
    s.add_argument(
        "--task",
        choices=["pope", "video_pope"],
        default=None,
        help="which task to write (default: the recipe's one POPE task in eval.tasks, else pope)",
    )
    return p


def _cmd_list(args) -> int:
    from .config import describe_fields

    sections = {}
    if args.what in (None, "methods", "tasks"):
        from .registry import REGISTRIES, TASKS

        sections = (
            {**REGISTRIES, "tasks": TASKS}
            if args.what is None
            else REGISTRIES
            if args.what == "methods"
            else {"tasks": TASKS}
        )
    for kind, reg in sections.items():
        print(f"{kind}:")
        entries = list(reg.entries())
        if not entries:
            print("  (none)")
        for e in entries:
            print(f"  {e.name:<18} {e.description}")
            if args.verbose and kind != "tasks":
                from .capabilities import listed_families

                print(f"      families: {', '.join(listed_families(e.cls, e.config_cls))}")
            if args.verbose and e.config_cls is not None:
                for name, default, doc in describe_fields(e.config_cls):
                    print(f"      {name} = {default!r}" + (f"  # {doc}" if doc else ""))
    if args.what in (None, "recipes"):
        from .config import RECIPES_DIR, shipped_recipes

        print("recipes:")
        for name in shipped_recipes():
            print(f"  {name:<28} {_recipe_summary(RECIPES_DIR / f'{name}.yaml')}")
    return 0


def _recipe_summary(path) -> str:
    """A shipped recipe's description, else its first comment line."""
    text = path.read_text()
    data = yaml.safe_load(text) or {}
    if data.get("description"):
        return str(data["description"]).strip().splitlines()[0]
    first = next((ln for ln in text.splitlines() if ln.startswith("#")), "")
    return first.lstrip("# ").strip()


def _load(args):
    from .config import load_recipe

    return load_recipe(args.recipe, overrides=args.set)


def _cmd_validate(args) -> int:
    from .capabilities import check_model_config

    recipe = _load(args)
    check_model_config(recipe)  # layer indices, grids, families against the model's config (no weights)
    if recipe.bench.kind != "none":
        from .bench.common import variants

        names = [v.name for v in variants(recipe)]
        print(f"# bench variants ({len(names)}): {', '.join(names)}")
    print(yaml.safe_dump(recipe.to_dict(), sort_keys=False).rstrip())
    print(f"# recipe hash: {recipe.hash()}")
    return 0


def _cmd_run(args) -> int:
    from .capabilities import check_model_config, model_facts, video_families
    from .model import load_model
    from .pipeline import apply

    if not args.image and args.video is None:
        raise InputError("mmfast run needs --image (repeatable) or --video (a directory of frames or a video file)")
    sampled = [
        flag
        for flag, v in (("--num-frames", args.num_frames), ("--fps", args.fps), ("--video-fps", args.video_fps))
        if v is not None
    ]
    if sampled and args.video is None:
        raise InputError(
            f"{' / '.join(sampled)}: how a video's frames are sampled; pass --video too (a directory of frames or a video file)"
        )
    recipe = _load(args)
    check_model_config(recipe)
    from .inputs import open_image

    for path in args.image or []:
        open_image(path)  # a missing or unreadable image is refused before the model loads
    if args.video is not None:  # so are a missing video and a family without video input
        if not Path(args.video).exists():
            raise InputError(f"--video {args.video!r} not found; give a directory of frame images or a video file")
        facts = model_facts(recipe)
        if facts is not None and not facts.features.video:
            raise InputError(
                f"--video: {recipe.model.name} is a {facts.family} model, which has no video input; pass the frames "
                f"as --image, or use a checkpoint of a family with video input ({', '.join(video_families())})"
            )
    mm = load_model(recipe.model)
    images = None if not args.image else args.image if len(args.image) > 1 else args.image[0]
    video = {} if args.video is None else {"videos": args.video}
    sampling = {"num_frames": args.num_frames, "fps": args.fps, "video_fps": args.video_fps}
    with apply(mm, recipe) as session:
        result = session.generate(
            [images] if images is not None else None,
            args.prompt,
            max_new_tokens=args.max_new_tokens,
            seed=recipe.decoding.seed or 0,
            **video,
            **{k: v for k, v in sampling.items() if v is not None},
        )[0]
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(result.text)
    return 0


def check_output_dir(path: Path) -> None:
    """Refuse an output path that is a file or cannot be written, before any model loads."""
    from .errors import InputError

    if path.exists() and not path.is_dir():
        raise InputError(
            f"output {str(path)!r} is a file, not a directory; give --output a directory (created if missing)"
        )
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise InputError(
            f"output {str(path)!r} cannot be created: {str(existing)!r} is a file; choose another --output"
        )
    try:  # a real write: os.access misses read-only mounts and says yes to root
        fd, probe = tempfile.mkstemp(prefix=".mmfast-write-check-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise InputError(
            f"output {str(path)!r} is not writable ({str(existing)!r}: {exc.strerror}); choose another --output "
            "or fix the directory's permissions"
        ) from None


def _cmd_eval(args) -> int:
    from .eval.distributed import is_worker, shard_info
    from .eval.runner import EXIT_SAMPLES_FAILED, output_dir, run_eval

    recipe = _load(args)
    check_output_dir(output_dir(recipe, args.output))
    summary = run_eval(recipe, limit=args.limit, output=args.output, num_processes=args.num_processes)
    if is_worker():
        return 0  # the launcher prints the result
    main_process = shard_info()[0] == 0  # under torchrun / accelerate every process returns the summary
    if main_process:
        from .report import metrics_table

        print(metrics_table(summary["metrics"]))
        print(f"(all figures: {output_dir(recipe, args.output) / 'summary.json'})")
    failed, not_run = summary["counts"]["failed"], summary["counts"]["not_run"]
    if (failed or not_run) and not args.allow_failures:
        if not main_process:
            return EXIT_SAMPLES_FAILED
        logger.error(
            "%d of %d samples failed (listed in summary.json)%s; exiting %d (--allow-failures accepts them)",
            failed,
            summary["counts"]["planned"],
            f" and {not_run} have no answer" if not_run else "",
            EXIT_SAMPLES_FAILED,
        )
        return EXIT_SAMPLES_FAILED
    return 0


def _cmd_bench(args) -> int:
    from .bench import output_dir, run_bench  # output_dir: the eval runner's (~ expanded)

    recipe = _load(args)
    check_output_dir(output_dir(recipe, args.output))
    if args.only is not None:  # `--only ""` names no variant: refused, not read as "all of them"
        from .bench.common import only_variants

        recipe = only_variants(recipe, [n.strip() for n in args.only.split(",") if n.strip()])
    summary = run_bench(recipe, output=args.output, limit=args.limit)
    print(summary.get("table", json.dumps(summary.get("results", {}), indent=2)))
    return 0


def _cmd_report(args) -> int:
    from .report import write_report

    check_output_dir(Path(args.output))
    path = write_report(args.runs, args.output)
    print(path)
    return 0


def _cmd_lmms_task(args) -> int:
    from .eval.lmms_tasks import write_lmms_task

    if args.output is not None:
        check_output_dir(Path(args.output).expanduser())
    task = write_lmms_task(_load(args), args.output, args.name, args.task)
    print(
        f"lmms-eval task {task.group} ({', '.join(f'{t}: {n}' for t, n in zip(task.tasks, task.n_questions.values()))} questions)"
    )
    print(f"  --include_path {task.directory} --tasks {task.group}")
    return 0


def _cmd_rerender(args) -> int:
    from .bench.rerender import rerender_bench

    for d in args.benches:
        print(rerender_bench(d))
    return 0


#: file-system failures caused by the machine, not by mmfast: a clear error (exit 2) with what to do
_ENVIRONMENT_ERRNOS: dict[int, str] = {
    errno.EACCES: "fix the permissions or choose another path",
    errno.EPERM: "fix the permissions or choose another path",
    errno.EROFS: "the file system is read-only; choose another path",
    errno.ENOSPC: "the disk is full; free space or choose another --output",
    errno.EDQUOT: "the disk quota is exceeded; free space or choose another --output",
    errno.EFBIG: "the file system's largest file size is reached; choose another --output on another file system",
    errno.ENAMETOOLONG: "the path is longer than the file system allows; choose a shorter --output",
}

COMMANDS = {
    "list": _cmd_list,
    "validate": _cmd_validate,
    "run": _cmd_run,
    "eval": _cmd_eval,
    "bench": _cmd_bench,
    "report": _cmd_report,
    "rerender": _cmd_rerender,
    "lmms-task": _cmd_lmms_task,
}


def _quiet_progress_bars() -> None:
    """``-q``: no progress bars from transformers ("Loading weights") or huggingface_hub either. The
    variable covers them when imported later (and in worker processes); already imported, they are told."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    if "transformers" in sys.modules:
        import transformers.utils.logging

        transformers.utils.logging.disable_progress_bar()
    if "huggingface_hub" in sys.modules:
        import huggingface_hub.utils

        huggingface_hub.utils.disable_progress_bars()


def main(argv: Sequence[str] | None = None) -> int:
    from .errors import MMFastError

    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    for noisy in ("transformers", "accelerate", "httpx", "huggingface_hub"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    if args.quiet:
        _quiet_progress_bars()
    from .eval.distributed import Terminated, is_worker, watch_parent  # stdlib + yaml only: no torch

    watch_parent()
    try:
        code = COMMANDS[args.command](args)
        sys.stdout.flush()  # a closed pipe surfaces here, inside the handler below
        return code
    except BrokenPipeError:
        # the reader went away (`mmfast list | head`): stop quietly, as command-line tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except MMFastError as exc:
        print(f"mmfast: error: {exc}", file=sys.stderr)
        return int(getattr(exc, "exit_code", 2))  # 3: evaluation samples failed (SamplesFailedError)
    except OSError as exc:
        if exc.errno not in _ENVIRONMENT_ERRNOS:
            logger.exception("internal error (please report it with the command and the recipe)")
            return 1
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"mmfast: error: {where}{exc.strerror} ({_ENVIRONMENT_ERRNOS[exc.errno]})", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if not is_worker():  # the launcher says it once
            print("mmfast: interrupted (finished samples are saved; rerun the same command to resume)", file=sys.stderr)
        return 130
    except Terminated as exc:
        print(f"mmfast: {exc} (finished samples are saved; rerun the same command to resume)", file=sys.stderr)
        return 128 + exc.signum
    except Exception:
        logger.exception("internal error (please report it with the command and the recipe)")
        return 1


if __name__ == "__main__":
    sys.exit(main())
