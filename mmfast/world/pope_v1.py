"""POPE version ``v1`` of the world (the files of mmfast before the official rule became the default).

Kept so that results measured on these files stay reproducible: ``build_pope_v1`` still writes
byte-identical files (their sha256 for the standard world are pinned in
:data:`mmfast.world.pope_build.KNOWN_WORLD_POPE`). It differs from the official POPE rule
(:mod:`mmfast.world.pope_official`) in:

* positives: the first 3 distinct categories in **visible-area order** (largest first), where the
  official rule takes the annotation order; the largest objects are the easiest to confirm;
* tie-breaks: equal frequencies (popular) and equal co-occurrence counts (adversarial) are broken by
  COCO category id, where the official code keeps first-appearance order (stable sort of a dict);
* random negatives are drawn from the categories in COCO id order, the image pool is re-ordered by
  image id, and each split has its own RNG stream.

Rule of this version:

1. Pool: images with at least 3 distinct ground-truth categories; ``n_images`` (default 500) are
   drawn with a seeded RNG; the pool is then ordered by image id.
2. Per image, the first 3 distinct categories in instance order (visible area, descending) are
   the positives.
3. Each positive is followed by one negative, a category absent from the image and not yet used
   for that image: ``random``: uniform over all categories seen in the pool (re-drawn until
   valid); ``popular``: the first valid one by number of pool images containing it (ties by COCO
   id); ``adversarial``: the first valid one by co-occurrence with *that positive* in the pool
   (ties by COCO id); if none is valid, a random one as in ``random``.
4. Questions alternate yes / no, ``"Is there a {obj} in the image?"`` ("an" before a vowel).
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from collections.abc import Sequence

from ._pope_common import POPE_SPLITS, PopeQuestion
from .categories import CATEGORY_BY_NAME
from .render import ImageAnnotation
from .text import object_question

__all__ = ["POPE_SPLITS", "build_pope_v1", "pool_statistics", "pope_pool"]


def _cid(name: str) -> int:
    return CATEGORY_BY_NAME[name].id


def pope_pool(
    annotations: Sequence[ImageAnnotation], n_images: int = 500, seed: int = 0, min_objects: int = 3
) -> list[ImageAnnotation]:
    """Draw the POPE images: ``n_images`` of those with ``>= min_objects`` distinct categories.

    Returns:
        The drawn annotations ordered by image id (fewer if not enough images are eligible).
    """
    eligible = sorted((a for a in annotations if len(a.object_names()) >= min_objects), key=lambda a: a.image_id)
    rng = random.Random(int.from_bytes(hashlib.sha256(f"mmfast-pope-pool:{seed}".encode()).digest()[:8], "big"))
    drawn = rng.sample(eligible, min(n_images, len(eligible)))
    return sorted(drawn, key=lambda a: a.image_id)


def pool_statistics(pool: Sequence[ImageAnnotation]) -> tuple[list[str], list[str], dict[str, list[str]]]:
    """Object lists of rule ``v1``, computed over the pool.

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


def build_pope_v1(
    annotations: Sequence[ImageAnnotation], *, n_images: int = 500, seed: int = 0, n_pos: int = 3
) -> dict[str, list[PopeQuestion]]:
    """Build the three POPE splits of version ``v1`` from val annotations (module docstring).

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
                    questions.append(
                        PopeQuestion(len(questions) + 1, a.file_name, a.image_id, object_question(name), label)
                    )
        out[split] = questions
    return out
