"""Where evaluation data lives: the embedded world (generated on first use) or real COCO.

Real COCO follows one convention: ``coco_root/val2014/`` images, ``coco_root/annotations/``
(``instances_val2014.json``, ``captions_val2014.json``) and ``coco_root/pope/coco_pope_{split}.json``
(the official POPE files), given by ``eval.data.root`` or ``$MMFAST_COCO_ROOT``. Every required file
is checked before any model is loaded, and all missing ones are listed with where to get them.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..config import DataConfig, EvalConfig
from ..errors import InputError

logger = logging.getLogger(__name__)

_COCO_HELP = {
    "val2014": "COCO 2014 val images: https://cocodataset.org/#download (val2014.zip)",
    "annotations": "COCO 2014 annotations: https://cocodataset.org/#download (annotations_trainval2014.zip)",
    "pope": "POPE question files: https://github.com/RUCAIBox/POPE (output/coco/coco_pope_*.json)",
}


@dataclass(frozen=True)
class EvalData:
    dataset: str
    root: Path
    image_dir: Path
    instances: tuple[Path, ...]
    captions: tuple[Path, ...]
    pope_files: dict[str, Path] = field(default_factory=dict)


def world_cache_dir(seed: int) -> Path:
    from ..world import WORLD_VERSION

    base = Path(os.environ.get("MMFAST_CACHE", Path.home() / ".cache" / "mmfast"))
    return base / f"world-v{WORLD_VERSION}-seed{seed}"


def ensure_world(root: Path, seed: int) -> Path:
    """Generate the world's val split and POPE files into ``root`` unless already there."""
    from ..world import write_world

    marker = root / "world.json"
    if not marker.is_file():
        logger.info("generating the evaluation world (seed %d) in %s", seed, root)
        write_world(root, seed=seed, n_train=0, progress=sys.stderr.isatty())
    return root


def resolve_data(cfg: EvalConfig, tasks: tuple[str, ...]) -> EvalData:
    """Locate (and for the world, create) every file the tasks need; fail listing what is missing."""
    data: DataConfig = cfg.data
    splits = cfg.pope.splits
    if data.dataset == "world":
        root = Path(data.root).expanduser() if data.root else world_cache_dir(data.world_seed)
        ensure_world(root, data.world_seed)
        image_dir = Path(data.image_dir) if data.image_dir else root / "images" / "val"
        instances = tuple(Path(p) for p in data.instances) or (root / "annotations" / "instances_val.json",)
        captions = tuple(Path(p) for p in data.captions) or (root / "annotations" / "captions_val.json",)
        pope = {s: Path(cfg.pope.files.get(s, root / "pope" / f"world_pope_{s}.json")) for s in splits}
    else:
        env_root = os.environ.get("MMFAST_COCO_ROOT")
        if not data.root and not env_root:
            raise InputError(
                "eval.data.dataset is 'coco' but no COCO root is set: add eval.data.root to the recipe or "
                "export MMFAST_COCO_ROOT=/path/to/coco (with val2014/, annotations/, pope/)"
            )
        root = Path(data.root or env_root).expanduser()
        image_dir = Path(data.image_dir) if data.image_dir else root / "val2014"
        instances = tuple(Path(p) for p in data.instances) or (root / "annotations" / "instances_val2014.json",)
        captions = tuple(Path(p) for p in data.captions) or (root / "annotations" / "captions_val2014.json",)
        pope = {s: Path(cfg.pope.files.get(s, root / "pope" / f"coco_pope_{s}.json")) for s in splits}
    needed: list[tuple[Path, str]] = [(image_dir, "val2014")]
    if "chair" in tasks:
        needed += [(p, "annotations") for p in instances + captions]
    if "pope" in tasks:
        needed += [(p, "pope") for p in pope.values()]
    missing = [(p, why) for p, why in needed if not p.exists()]
    if missing:
        lines = "\n".join(f"  - {p}  ({_COCO_HELP[why] if data.dataset == 'coco' else 'regenerate the world'})" for p, why in missing)
        raise InputError(f"missing evaluation data ({len(missing)} file(s)):\n{lines}")
    return EvalData(data.dataset, root, image_dir, instances, captions, pope)
