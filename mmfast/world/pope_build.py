"""POPE question files for the world, built with the official POPE construction rule.

Official rule (Li et al., 2023, "Evaluating Object Hallucination in Large Vision-Language
Models", github.com/AoiDragon/POPE), reproduced here on the world's val split:

1. Pool: images with at least 3 distinct ground-truth categories; ``n_images`` (default 500) are
   drawn with a seeded RNG (``random.Random(seed)``; the pool is then ordered by image id).
2. Per image, the *first 3* ground-truth categories are the positives. Ground-truth order is the
   instance order of the annotation: **visible area, descending** (distinct categories).
3. Each positive is followed by one negative, a category absent from the image and not yet used
   for that image:

   * ``random``: uniform over all categories seen in the pool (re-drawn until valid);
   * ``popular``: the most frequent categories in the pool (number of pool images containing
     them; ties by COCO id), the first one that is valid;
   * ``adversarial``: the categories that co-occur most often with *that positive* in the pool
     (ties by COCO id), the first valid one; if none is valid, a random one as in ``random``.

4. Questions alternate yes / no (6 per image, 3000 per split for 500 images), with the template
   ``"Is there a {obj} in the image?"`` ("an" before a vowel). The official generator's
   ``template.replace("a", "an")`` bug (which yields "imange") is not reproduced.

The same images are used in all three splits. Lines are JSON objects (POPE's JSON Lines format):
``{"question_id", "image", "image_id", "text", "label"}``.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from .categories import CATEGORY_BY_NAME
from .render import ImageAnnotation
from .text import object_question

POPE_SPLITS: tuple[str, ...] = ("random", "popular", "adversarial")


@dataclass(frozen=True)
class PopeQuestion:
    """One POPE line (``to_json`` gives the dict written to the file)."""

    question_id: int
    image: str
    image_id: int
    text: str
    label: str

    def to_json(self) -> dict[str, object]:
        """The JSON object of this line."""
        return asdict(self)


def pope_file_name(split: str) -> str:
    """``world_pope_random.json`` etc."""
    return f"world_pope_{split}.json"


def _cid(name: str) -> int:
    return CATEGORY_BY_NAME[name].id


def pope_pool(annotations: Sequence[ImageAnnotation], n_images: int = 500, seed: int = 0,
              min_objects: int = 3) -> list[ImageAnnotation]:
    """Draw the POPE images: ``n_images`` of those with ``>= min_objects`` distinct categories.

    Returns:
        The drawn annotations ordered by image id (fewer if not enough images are eligible).
    """
    eligible = sorted((a for a in annotations if len(a.object_names()) >= min_objects), key=lambda a: a.image_id)
    rng = random.Random(int.from_bytes(hashlib.sha256(f"mmfast-pope-pool:{seed}".encode()).digest()[:8], "big"))
    drawn = rng.sample(eligible, min(n_images, len(eligible)))
    return sorted(drawn, key=lambda a: a.image_id)


def pool_statistics(pool: Sequence[ImageAnnotation]) -> tuple[list[str], list[str], dict[str, list[str]]]:
    """Object lists of the official rule, computed over the pool.

    Returns:
        ``(all_objects, by_frequency, co_occurring)``: all categories seen (COCO id order); the same
        sorted by number of images containing them (descending); and for each category the
        others sorted by number of images where both appear (descending, only those > 0).
    """
    freq: Counter[str] = Counter()
    co: dict[str, Counter[str]] = {}
    for a in pool:
        objs = a.object_names()
        freq.update(objs)
        for o in objs:
            co.setdefault(o, Counter()).update(x for x in objs if x != o)
    all_objects = sorted(freq, key=_cid)
    by_freq = sorted(freq, key=lambda n: (-freq[n], _cid(n)))
    co_sorted = {o: sorted(c, key=lambda n: (-c[n], _cid(n))) for o, c in co.items()}
    return all_objects, by_freq, co_sorted


def build_pope(annotations: Sequence[ImageAnnotation], *, n_images: int = 500, seed: int = 0,
               n_pos: int = 3) -> dict[str, list[PopeQuestion]]:
    """Build the three POPE splits from val annotations with the official rule.

    Args:
        annotations: Val-split annotations.
        n_images: Number of images to draw (500 in POPE).
        seed: Seed of the image draw and of the random negatives.
        n_pos: Positives (and negatives) per image (3 in POPE).

    Returns:
        ``{"random": [...], "popular": [...], "adversarial": [...]}``.

    Raises:
        ValueError: if no image has ``n_pos`` distinct categories.
    """
    pool = pope_pool(annotations, n_images, seed, n_pos)
    if not pool:
        raise ValueError(f"no image has {n_pos} distinct categories; cannot build POPE")
    all_objects, by_freq, co = pool_statistics(pool)
    out: dict[str, list[PopeQuestion]] = {}
    for split in POPE_SPLITS:
        h = hashlib.sha256(f"mmfast-pope-neg:{seed}:{split}".encode()).digest()
        rng = random.Random(int.from_bytes(h[:8], "big"))
        questions: list[PopeQuestion] = []
        for a in pool:
            present = set(a.object_names())
            used: list[str] = []

            def ok(name: str) -> bool:
                return name not in present and name not in used

            def random_neg() -> str:
                cands = [n for n in all_objects if ok(n)]
                if not cands:
                    raise ValueError(f"image {a.image_id}: no absent object left for a negative")
                while True:  # official: re-draw uniformly until valid
                    name = rng.choice(all_objects)
                    if ok(name):
                        return name

            for gt in a.object_names()[:n_pos]:
                used.append(gt)
                if split == "random":
                    neg = random_neg()
                elif split == "popular":
                    neg = next((n for n in by_freq if ok(n)), None) or random_neg()
                else:
                    neg = next((n for n in co.get(gt, []) if ok(n)), None) or random_neg()
                used.append(neg)
                for name, label in ((gt, "yes"), (neg, "no")):
                    questions.append(PopeQuestion(len(questions) + 1, a.file_name, a.image_id,
                                                  object_question(name), label))
        out[split] = questions
    return out


def write_pope(out_dir: str | Path, splits: dict[str, list[PopeQuestion]]) -> dict[str, Path]:
    """Write one JSON Lines file per split into ``out_dir``; returns their paths."""
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    for split, qs in splits.items():
        path = d / pope_file_name(split)
        path.write_text("".join(json.dumps(q.to_json()) + "\n" for q in qs), encoding="utf-8")
        paths[split] = path
    return paths


def read_pope(path: str | Path) -> list[dict[str, object]]:
    """Read a POPE JSON Lines file."""
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
