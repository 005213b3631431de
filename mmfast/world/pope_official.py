"""POPE version ``official`` of the world: the construction rule of the POPE release, exactly.

Source: Li et al., 2023, "Evaluating Object Hallucination in Large Vision-Language Models"; code
RUCAIBox/POPE (``main.py`` and ``utils.py`` at 3df3ba1, read for this module, not copied). The
official builder reads one record per image, ``{"image", "objects"}``, whose ``objects`` list the
image's distinct ground-truth categories in annotation order (the COCO file it ships lists them as
annotated, not by size), and then:

1. keeps the images with at least 3 objects and draws 500 of them with ``random.sample``; the
   drawn images are used **in the order drawn** (not re-sorted);
2. counts, over the drawn images in that order, how many images contain each object (a dict in
   first-appearance order) and, for each object, how many images it shares with every other
   object (a dict per object, in first-co-occurrence order);
3. sorts both by count, descending, with Python's stable ``sorted(..., reverse=True)``: **equal
   counts keep first-appearance order** (the official tie-break);
4. per image, takes ``objects[0:3]`` as positives; after each positive, one negative not in the
   image and not yet asked for it: ``random``: ``random.choice`` over the objects of step 2 (in
   first-appearance order), re-drawn until valid; ``popular``: the first valid object by frequency;
   ``adversarial``: the first valid object by co-occurrence with *that positive*; popular and
   adversarial fall back to the random draw when no listed object is valid;
5. writes the splits random, popular, adversarial in that order, all from **one** random stream
   (``random`` module state), question ids from 1 per split, alternating yes / no.

The world's annotation order is the scene model's sampling order (``Instance.sample_index``;
:meth:`~mmfast.world.render.ImageAnnotation.annotated_names`): not sorted by size (the scene's typical
objects tend to come first); in the standard world the official positives sit at every area rank from
1 to 8 (37% beyond rank 3), where version ``v1`` always took the three largest. ``write_world`` writes these records as ``pope/world_objects_val.json`` (the official input format,
plus ``image_id``), so the files can be rebuilt from it alone.

Deviations (none changes the rule): the official code seeds nothing (global ``random`` state); here
one ``random.Random`` is seeded from ``seed`` and consumed in the official order (image draw, then
the three splits). The official code asserts that 500 images are eligible; here fewer are used if
fewer are eligible. Where the official random draw would loop forever (no valid object left), a
``ValueError`` is raised. Question text uses "an" before a vowel as the official code intends, without
its ``template.replace("a", "an")`` side effect ("imange"), which the POPE authors fixed by hand in
their released files (commits edebdda and 109985c).
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ._pope_common import POPE_SPLITS, PopeQuestion
from .render import ImageAnnotation
from .text import object_question

OBJECTS_FILE = "world_objects_val.json"


@dataclass(frozen=True)
class GroundTruthObjects:
    """One record of the official builder's input: an image and its distinct objects in annotation order."""

    image: str
    image_id: int
    objects: tuple[str, ...]

    def to_json(self) -> dict[str, object]:
        return {"image": self.image, "image_id": self.image_id, "objects": list(self.objects)}


def ground_truth_objects(annotations: Sequence[ImageAnnotation]) -> list[GroundTruthObjects]:
    """The official builder's input records of rendered annotations (image-id order)."""
    return [
        GroundTruthObjects(a.file_name, a.image_id, tuple(a.annotated_names()))
        for a in sorted(annotations, key=lambda a: a.image_id)
    ]


def write_objects(path: str | Path, records: Sequence[GroundTruthObjects]) -> Path:
    """Write records as JSON Lines (the format of RUCAIBox/POPE ``segmentation/*.json``)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("".join(json.dumps(r.to_json()) + "\n" for r in records), encoding="utf-8")
    return p


def read_objects(path: str | Path) -> list[GroundTruthObjects]:
    """Read records written by :func:`write_objects`.

    Raises:
        ValueError: naming the file and line of a record that is not ``{"image": str, "image_id":
            int, "objects": [distinct non-empty str, ...]}`` or repeats an earlier ``image_id`` (a
            repeated object would be asked twice as a positive; a string ``objects`` would be read
            letter by letter).
    """
    out = []
    first_line: dict[int, int] = {}
    for lineno, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            d = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: invalid JSON ({exc.msg})") from exc
        d = d if isinstance(d, dict) else {}
        image, image_id, objects = d.get("image"), d.get("image_id"), d.get("objects")
        if (
            not isinstance(image, str)
            or isinstance(image_id, bool)
            or not isinstance(image_id, int)
            or not isinstance(objects, list)
            or not all(isinstance(o, str) and o for o in objects)
        ):
            raise ValueError(
                f'{where}: expected {{"image": str, "image_id": int, "objects": [str, ...]}}, got {line.strip()[:200]}'
            )
        repeated = sorted({o for o in objects if objects.count(o) > 1})
        if repeated:
            raise ValueError(f"{where}: image {image_id} lists {repeated} more than once; objects must be distinct")
        if image_id in first_line:
            raise ValueError(f"{where}: duplicate image_id {image_id} (first at line {first_line[image_id]})")
        first_line[image_id] = lineno
        out.append(GroundTruthObjects(image, image_id, tuple(objects)))
    return out


def official_rng(seed: int) -> random.Random:
    """The one random stream of a build (image draw, then the three splits)."""
    return random.Random(int.from_bytes(hashlib.sha256(f"mmfast-pope-official:{seed}".encode()).digest()[:8], "big"))


def object_statistics(pool: Sequence[GroundTruthObjects]) -> tuple[list[str], list[str], dict[str, list[str]]]:
    """``(objects, by_frequency, co_occurring)`` of the official rule over the drawn pool, in pool order.

    ``objects``: every object in first-appearance order; ``by_frequency``: the same sorted by the
    number of images containing it, descending, ties in first-appearance order; ``co_occurring[o]``:
    the objects sharing an image with ``o``, by number of shared images, descending, ties in
    first-co-occurrence order.
    """
    freq: dict[str, int] = {}
    co: dict[str, dict[str, int]] = {}
    for rec in pool:
        for o in rec.objects:
            freq[o] = freq.get(o, 0) + 1
            row = co.setdefault(o, {})
            for other in rec.objects:
                if other != o:
                    row[other] = row.get(other, 0) + 1
    by_freq = sorted(freq, key=lambda o: freq[o], reverse=True)  # stable: ties keep dict order
    co_sorted = {o: sorted(row, key=lambda x, row=row: row[x], reverse=True) for o, row in co.items()}
    return list(freq), by_freq, co_sorted


def build_pope_official(
    records: Sequence[GroundTruthObjects],
    *,
    n_images: int = 500,
    seed: int = 0,
    n_pos: int = 3,
    question: Callable[[str], str] = object_question,
) -> dict[str, list[PopeQuestion]]:
    """Build the three POPE splits with the official rule (module docstring).

    Args:
        records: Input records in file order (image-id order for the world).
        n_images: Number of images to draw (500 in POPE).
        seed: Seed of the one random stream.
        n_pos: Positives (and negatives) per image (3 in POPE).
        question: Question text of an object name (POPE's image template by default; the video
            world asks about the video).

    Returns:
        ``{"random": [...], "popular": [...], "adversarial": [...]}``.

    Raises:
        ValueError: if no image has ``n_pos`` objects, or an image has no absent object left.
    """
    eligible = [r for r in records if len(r.objects) >= n_pos]
    if not eligible:
        raise ValueError(f"no image has {n_pos} distinct objects; cannot build POPE")
    rng = official_rng(seed)
    pool = rng.sample(eligible, min(n_images, len(eligible)))  # kept in the order drawn
    objects, by_freq, co = object_statistics(pool)
    out: dict[str, list[PopeQuestion]] = {}
    for split in POPE_SPLITS:
        questions: list[PopeQuestion] = []
        for rec in pool:
            asked: list[str] = []

            def valid(o: str) -> bool:
                return o not in asked and o not in rec.objects

            def draw() -> str:
                if not any(valid(o) for o in objects):
                    raise ValueError(f"image {rec.image_id}: no absent object left for a negative")
                o = rng.choice(objects)
                while not valid(o):
                    o = rng.choice(objects)
                return o

            for pos in rec.objects[:n_pos]:
                asked.append(pos)
                ranked = () if split == "random" else by_freq if split == "popular" else co.get(pos, [])
                neg = next((o for o in ranked if valid(o)), None) or draw()
                asked.append(neg)
                for name, label in ((pos, "yes"), (neg, "no")):
                    questions.append(PopeQuestion(len(questions) + 1, rec.image, rec.image_id, question(name), label))
        out[split] = questions
    return out
