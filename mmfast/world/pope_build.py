"""POPE question files for the world, in named versions.

* ``official`` (default): the construction rule of the POPE release, exactly (positives in
  annotation order, official tie-breaks; :mod:`mmfast.world.pope_official`). Files
  ``pope/world_pope_{split}.json``.
* ``v1``: mmfast's files before that (positives by visible area, ties by COCO id;
  :mod:`mmfast.world.pope_v1`), kept so that results measured on them stay reproducible. Files
  ``pope/world_pope_v1_{split}.json``.

``write_world`` writes both. The sha256 of every version for the standard world (``write_world``
defaults: 500 val images, 500 POPE images, ``WorldConfig()``) are pinned in
:data:`KNOWN_WORLD_POPE`; :func:`verify_pope` compares a build with them.

Lines are JSON objects (POPE's JSON Lines format): ``{"question_id", "image", "image_id", "text",
"label"}``; the same images are used in all three splits.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

from ._pope_common import POPE_SPLITS, PopeQuestion
from .pope_official import build_pope_official, ground_truth_objects
from .pope_v1 import build_pope_v1, pool_statistics, pope_pool
from .render import ImageAnnotation

__all__ = [
    "DEFAULT_POPE_VERSION",
    "KNOWN_WORLD_POPE",
    "POPE_RULES",
    "POPE_SPLITS",
    "POPE_VERSIONS",
    "PopeQuestion",
    "build_pope",
    "pool_statistics",
    "pope_bytes",
    "pope_file_name",
    "pope_pool",
    "read_pope",
    "verify_pope",
    "write_pope",
]

POPE_VERSIONS: tuple[str, ...] = ("official", "v1")
DEFAULT_POPE_VERSION = "official"

#: One line per version, recorded in ``world.json``.
POPE_RULES: dict[str, str] = {
    "official": "official POPE (Li et al. 2023, RUCAIBox/POPE utils.py): first 3 objects in annotation order "
    "as positives; ties in first-appearance order; images in drawn order; one random stream",
    "v1": "mmfast v1: first 3 objects by visible area as positives; ties by COCO id; images in id order",
}

#: sha256 of each split's file for the standard world, by (version, world seed). The ``v1`` entries
#: are the files behind every benchmark committed before the ``official`` version (their
#: ``summary.json`` protocol records the same checksums).
KNOWN_WORLD_POPE: dict[tuple[str, int], dict[str, str]] = {
    ("v1", 0): {
        "random": "bb90685577c6a76cd11398b62acd495fe4bdfa6eca23093a770cd10e13c44e32",
        "popular": "63e7ffcdbcbfcd9f953c4dc533d42d24d802c1c684e8e615efeb340d46aa5de6",
        "adversarial": "6226f45ad2a336087fc181ece29b1d29fa731da159fdd8fe63781b4db6859f58",
    },
    ("official", 0): {
        "random": "16bd38e487d12aded1278d2c6277be7745c1d567b42adc3ff93e2852074655d6",
        "popular": "93c86dcf4f3718f04c45fb91b654838ac82d9aebceddee56ca8f3a2048718d6a",
        "adversarial": "72b294869f7d3759e54159a3f6cf323e6619013657e65f30a8439dca43159b6a",
    },
}


def pope_file_name(split: str, version: str = DEFAULT_POPE_VERSION) -> str:
    """``world_pope_random.json`` (official) or ``world_pope_v1_random.json`` etc."""
    _check_version(version)
    return f"world_pope_{split}.json" if version == "official" else f"world_pope_{version}_{split}.json"


def _check_version(version: str) -> None:
    if version not in POPE_VERSIONS:
        raise ValueError(f"unknown world POPE version {version!r}; choose from {POPE_VERSIONS}")


def build_pope(
    annotations: Sequence[ImageAnnotation],
    *,
    version: str = DEFAULT_POPE_VERSION,
    n_images: int = 500,
    seed: int = 0,
    n_pos: int = 3,
) -> dict[str, list[PopeQuestion]]:
    """Build the three POPE splits of ``version`` from rendered val annotations.

    Args:
        annotations: Val-split annotations as rendered (``official`` needs their annotation order).
        version: ``"official"`` or ``"v1"``.
        n_images: Number of images to draw (500 in POPE).
        seed: World seed (seeds the image draw and the random negatives).
        n_pos: Positives (and negatives) per image (3 in POPE).

    Returns:
        ``{"random": [...], "popular": [...], "adversarial": [...]}``.
    """
    _check_version(version)
    if version == "v1":
        return build_pope_v1(annotations, n_images=n_images, seed=seed, n_pos=n_pos)
    return build_pope_official(ground_truth_objects(annotations), n_images=n_images, seed=seed, n_pos=n_pos)


def pope_bytes(questions: Sequence[PopeQuestion]) -> bytes:
    """The exact bytes of a split's file."""
    return "".join(json.dumps(q.to_json()) + "\n" for q in questions).encode("utf-8")


def verify_pope(splits: dict[str, list[PopeQuestion]], version: str, seed: int) -> bool | None:
    """True / False: the build equals / differs from the pinned checksums of (version, seed);
    None: nothing is pinned for it (only the standard world's files are)."""
    known = KNOWN_WORLD_POPE.get((version, seed))
    if known is None:
        return None
    return {s: hashlib.sha256(pope_bytes(qs)).hexdigest() for s, qs in splits.items()} == known


def write_pope(
    out_dir: str | Path, splits: dict[str, list[PopeQuestion]], version: str = DEFAULT_POPE_VERSION
) -> dict[str, Path]:
    """Write one JSON Lines file per split into ``out_dir``; returns their paths."""
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    for split, qs in splits.items():
        path = d / pope_file_name(split, version)
        path.write_bytes(pope_bytes(qs))
        paths[split] = path
    return paths


def read_pope(path: str | Path) -> list[dict[str, object]]:
    """Read a POPE JSON Lines file."""
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
