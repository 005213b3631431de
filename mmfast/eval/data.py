"""Where evaluation data lives: the embedded world (generated on first use) or real COCO.

Real COCO follows one convention: ``coco_root/val2014/`` images, ``coco_root/annotations/``
(``instances_val2014.json``, ``captions_val2014.json``) and ``coco_root/pope/coco_pope_{split}.json``
(the official POPE files), given by ``eval.data.root`` or ``$MMFAST_COCO_ROOT``.

What is checked depends on the tasks: each registered task declares the shared inputs it reads
(``Task.needs``: ``images``, ``annotations``) and its own files (``Task.required_files``, e.g. POPE's
question files). Every required file is checked before any model is loaded, and all missing ones are
listed with where to get them.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..config import DataConfig, EvalConfig
from ..errors import InputError
from ..weights_pack import cache_root  # one cache for the model and the data

logger = logging.getLogger(__name__)

SHARED_INPUTS: tuple[str, ...] = ("images", "annotations")
"""What a task may list in ``Task.needs``: the val images, the instances + captions annotations."""

_COCO_HELP = {
    "images": "COCO 2014 val images: https://cocodataset.org/#download (val2014.zip)",
    "annotations": "COCO 2014 annotations: https://cocodataset.org/#download (annotations_trainval2014.zip)",
}


@dataclass(frozen=True)
class EvalData:
    """The located inputs: shared ones (images, annotations) and each task's own files."""

    dataset: str
    root: Path
    image_dir: Path
    instances: tuple[Path, ...]
    captions: tuple[Path, ...]
    task_files: dict[str, dict[str, Path]] = field(default_factory=dict)  # task name -> {key: path}

    def files_of(self, task: str) -> dict[str, Path]:
        """Task ``task``'s own files as its ``required_files`` declared them (empty if none)."""
        return self.task_files.get(task, {})


def world_cache_dir(seed: int) -> Path:
    from ..world import WORLD_VERSION

    return cache_root() / f"world-v{WORLD_VERSION}-seed{seed}"


def ensure_world(root: Path, seed: int) -> Path:
    """Generate the world's val split and POPE files into ``root`` unless already there.

    A world written before POPE version ``official`` (its ``pope/world_pope_{split}.json`` are the
    ``v1`` files) gets every POPE version added (:func:`mmfast.world.generate.upgrade_pope`; its
    images and annotations are kept).

    A new world is written into a temporary sibling directory and renamed into place when complete, so
    that processes generating it at once (data-parallel workers on a fresh cache) never read a file
    another one is rewriting; the first to finish wins, the others drop their copy.
    """
    from ..world import write_world
    from ..world.generate import pope_versions_present, upgrade_pope, written_without_pope

    marker = root / "world.json"
    if not marker.is_file():
        _check_not_foreign(root)
        logger.info("generating the evaluation world (seed %d) in %s", seed, root)
        if root.is_symlink() or (root.exists() and any(root.iterdir())):  # the user's directory: in place
            if not marker.is_file():  # (non-empty since another process renamed its finished world here)
                write_world(root, seed=seed, n_train=0, progress=sys.stderr.isatty())
            return root
        root.parent.mkdir(parents=True, exist_ok=True)
        tmp = root.parent / f".{root.name}.{os.getpid()}.partial"
        try:
            write_world(tmp, seed=seed, n_train=0, progress=sys.stderr.isatty())
            try:
                tmp.rename(root)  # atomic; onto an empty directory too, never onto a non-empty one
            except OSError:
                if not marker.is_file():  # not another process's finished world: a real error
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    elif not pope_versions_present(root) and not written_without_pope(root):
        logger.warning(
            "the world in %s predates the official POPE files (its world_pope_*.json are version v1); "
            "writing every POPE version (images and annotations kept)",
            root,
        )
        try:
            upgrade_pope(root)
        except ValueError as exc:
            raise InputError(f"{exc} (python -m mmfast.world.generate --out DIR --seed {seed} ...)") from exc
    return root


#: what write_world makes (world.json last: another process may just have renamed its finished world into place)
_WORLD_ENTRIES = frozenset({"annotations", "images", "labels", "pope", "world.json"})


def _check_not_foreign(root: Path) -> None:
    """Refuse to write a world into a directory that holds other things (a COCO root given as
    ``eval.data.root`` without ``dataset: coco``): the world would be written among them and evaluated
    in place of the data meant. A new, empty or partly written world directory is fine."""
    try:
        foreign = sorted(p.name for p in root.iterdir() if p.name not in _WORLD_ENTRIES and not p.name.startswith("."))
    except FileNotFoundError:
        return
    except OSError as exc:
        raise InputError(f"eval.data.root {str(root)!r} cannot be read ({exc})") from None
    if foreign:
        coco = any(n.startswith(("val2014", "train2014", "val2017")) for n in foreign)
        raise InputError(
            f"eval.data.root {str(root)!r} is not an mmfast world (no world.json; it holds "
            f"{', '.join(foreign[:5])}{' ...' if len(foreign) > 5 else ''}), and eval.data.dataset is 'world', which "
            "would generate the world into it; "
            + (
                "for COCO set eval.data.dataset: coco"
                if coco
                else "set eval.data.dataset: coco for COCO, or give a new or empty directory for the world"
            )
        )


def resolve_data(cfg: EvalConfig, tasks: Sequence[str]) -> EvalData:
    """Locate (and for the world, create) every file the named tasks need; fail listing what is missing."""
    from ..registry import TASKS

    classes = {name: TASKS.get(name).cls for name in tasks}
    needs = {need for cls in classes.values() for need in cls.needs}
    data: DataConfig = cfg.data
    if data.dataset == "world":
        root = Path(data.root).expanduser() if data.root else world_cache_dir(data.world_seed)
        if needs:  # tasks with inputs of their own only (the video world's video_pope) need no image world
            ensure_world(root, data.world_seed)
        image_dir = Path(data.image_dir).expanduser() if data.image_dir else root / "images" / "val"
        instances = tuple(Path(p).expanduser() for p in data.instances) or (
            root / "annotations" / "instances_val.json",
        )
        captions = tuple(Path(p).expanduser() for p in data.captions) or (root / "annotations" / "captions_val.json",)
    else:
        env_root = os.environ.get("MMFAST_COCO_ROOT")
        if not data.root and not env_root:
            raise InputError(
                "eval.data.dataset is 'coco' but no COCO root is set: add eval.data.root to the recipe or "
                "export MMFAST_COCO_ROOT=/path/to/coco (with val2014/, annotations/, pope/)"
            )
        root = Path(data.root or env_root).expanduser()
        image_dir = Path(data.image_dir).expanduser() if data.image_dir else root / "val2014"
        instances = tuple(Path(p).expanduser() for p in data.instances) or (
            root / "annotations" / "instances_val2014.json",
        )
        captions = tuple(Path(p).expanduser() for p in data.captions) or (
            root / "annotations" / "captions_val2014.json",
        )
    shared = EvalData(data.dataset, root, image_dir, instances, captions)
    world_help = "regenerate the world"
    needed: list[tuple[Path, str]] = []  # (path, where to get it)
    if "images" in needs:
        needed.append((image_dir, _COCO_HELP["images"] if data.dataset == "coco" else world_help))
    if "annotations" in needs:
        needed += [
            (p, _COCO_HELP["annotations"] if data.dataset == "coco" else world_help) for p in instances + captions
        ]
    task_files: dict[str, dict[str, Path]] = {}
    for name, cls in classes.items():
        task_files[name] = {k: Path(p) for k, p in cls.required_files(cfg, shared).items()}
        default = world_help if data.dataset == "world" else f"an input of evaluation task {name!r}"
        needed += [(p, cls.files_help.get(data.dataset, default)) for p in task_files[name].values()]
    missing = list(dict.fromkeys((p, why) for p, why in needed if not p.exists()))
    if missing:
        lines = "\n".join(f"  - {p}  ({why})" for p, why in missing)
        raise InputError(f"missing evaluation data ({len(missing)} file(s)):\n{lines}")
    return EvalData(data.dataset, root, image_dir, instances, captions, task_files)
