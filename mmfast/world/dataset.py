"""Reading a written world back: annotations, captions, label maps, protocol record.

The trainer typically does::

    info = load_world_info(root)
    anns = load_annotations(root, "train")             # list[ImageAnnotation], instance order kept
    caps = load_captions(root, "train")                # {image_id: [5 captions]}
    img = Image.open(root / "images" / "train" / anns[0].file_name)
    labels = load_label_map(root, "train", anns[0].image_id)   # (H, W) uint8, 0 = background

``load_label_map`` reads ``labels/<split>/<file>.png`` when it was written and otherwise
re-renders the image from the seed and config recorded in ``world.json`` (about 10 ms).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from .categories import CATEGORY_BY_ID
from .render import ImageAnnotation, Instance, WorldConfig, file_name_for, render_image


def load_world_info(root: str | Path) -> dict[str, Any]:
    """The ``world.json`` record of a written world."""
    return json.loads((Path(root) / "world.json").read_text(encoding="utf-8"))


def world_config(info: dict[str, Any]) -> WorldConfig:
    """Rebuild the :class:`WorldConfig` recorded in ``world.json``."""
    cfg = dict(info["config"])
    cfg["small_px"] = tuple(cfg["small_px"])
    return WorldConfig(**cfg)


def annotations_from_coco(coco: dict[str, Any], split: str) -> list[ImageAnnotation]:
    """Convert a COCO instances dict of this world into :class:`ImageAnnotation` objects."""
    per: dict[int, list[Instance]] = {}
    for a in coco["annotations"]:
        cat = CATEGORY_BY_ID[int(a["category_id"])]
        x, y, w, h = (int(round(v)) for v in a["bbox"])
        per.setdefault(int(a["image_id"]), []).append(
            Instance(
                cat.id,
                cat.name,
                (x, y, w, h),
                int(a["area"]),
                float(a.get("visible_fraction", 1.0)),
                bool(a.get("is_small", False)),
                str(a.get("color", cat.colors[0])),
                str(a.get("variant", "")),
            )
        )
    return [
        ImageAnnotation(
            int(im["id"]),
            split,
            im["file_name"],
            int(im["width"]),
            int(im["height"]),
            str(im.get("scene", "")),
            tuple(per.get(int(im["id"]), ())),
        )
        for im in coco["images"]
    ]


def load_annotations(root: str | Path, split: str) -> list[ImageAnnotation]:
    """Annotations of one split, in image-id order with instances in file order (area desc)."""
    path = Path(root) / "annotations" / f"instances_{split}.json"
    return annotations_from_coco(json.loads(path.read_text(encoding="utf-8")), split)


def load_captions(root: str | Path, split: str) -> dict[int, list[str]]:
    """``{image_id: [captions]}`` of one split."""
    path = Path(root) / "annotations" / f"captions_{split}.json"
    out: dict[int, list[str]] = {}
    for a in json.loads(path.read_text(encoding="utf-8"))["annotations"]:
        out.setdefault(int(a["image_id"]), []).append(a["caption"])
    return out


def load_label_map(root: str | Path, split: str, image_id: int) -> np.ndarray:
    """The ``(H, W)`` ``uint8`` label map of one image (read from disk or re-rendered).

    Values: ``0`` background, ``k`` = ``CATEGORIES[k - 1]`` (``world.json["label_names"][k]``).
    """
    root = Path(root)
    path = root / "labels" / split / file_name_for(split, image_id)
    if path.exists():
        with Image.open(path) as im:
            return np.asarray(im, dtype=np.uint8).copy()
    info = load_world_info(root)
    return render_image(int(info["seed"]), split, image_id, world_config(info)).label_map
