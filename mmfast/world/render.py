"""Rendering one image of the world, deterministically from ``(seed, split, image_id)``.

Pipeline of :func:`render_image`:

1. A per-image :class:`random.Random` is seeded from ``sha256("mmfast-world:{seed}:{split}:{id}")``
   (Python's Mersenne Twister with an int seed is stable across Python versions; numpy noise uses
   the frozen ``RandomState`` stream), so any image can be re-rendered alone, in any order, in
   any worker process, with identical bytes.
2. Scene type, object count and object categories are sampled (:mod:`mmfast.world.scenes`).
3. The background is drawn (:mod:`mmfast.world.backgrounds`).
4. Each object gets a size (about 18% are *small*: 10-18 px long side), aspect, colour, variant,
   rotation and flip, and is drawn by its category routine on a supersampled RGBA layer that is
   downsampled and rotated. Objects are composited big-furniture-first, then back to front
   (ground objects lower in the image are nearer and larger). A placement is rejected if it
   would leave an earlier object less than ``min_visible`` visible; after a few retries the
   object is shrunk, then dropped.
5. Photometric noise is added to the whole image.

Per-pixel maps: ``instance_map`` (0 = background, ``k`` = ``annotation.instances[k - 1]``) and
``label_map`` (0 = background, ``k`` = ``CATEGORIES[k - 1]``); the last-drawn object wins.
A pixel belongs to an object where its layer's alpha is at least 50%.

Instances are listed by **visible area, descending** (ties: drawing order); POPE version ``v1`` took
its "first three ground-truth objects" in this order. Each instance also keeps ``sample_index``, its
position in the scene model's sampled object list: the world's *annotation order*, not sorted by size,
which the official POPE rule (version ``official``) reads (:meth:`ImageAnnotation.annotated_names`).
``bbox`` is the COCO ``[x, y, w, h]`` box of the *visible* pixels and ``area`` their count;
``visible_fraction`` is visible / full-object pixels.
"""

from __future__ import annotations

import hashlib
import logging
import random
from dataclasses import dataclass, field

import numpy as np
from PIL import Image, ImageDraw

from .backgrounds import draw_background, finish
from .categories import CATEGORIES, CATEGORY_BY_NAME, VARIANT_ASPECT, VARIANT_COLOR, Category
from .draw_base import COLORS, RGB, Pen, jitter, mix
from .scenes import sample_count, sample_objects, sample_scene

logger = logging.getLogger(__name__)

WORLD_VERSION = "1.0"
SPLITS = ("train", "val")
_LABEL_LUT_CACHE: dict[int, np.ndarray] = {}


@dataclass(frozen=True)
class WorldConfig:
    """Knobs of the generator (defaults reproduce the shipped world).

    Attributes:
        image_size: Side of the square RGB images in pixels.
        min_objects: Minimum number of sampled objects per image.
        max_objects: Maximum number of sampled objects per image.
        min_distinct: Every image shows at least ``min(min_distinct, n_objects)`` distinct
            categories (3 by default, so that *every* val image is eligible for POPE and
            ``n_val=500`` yields the standard 500 POPE images / 3000 questions per split).
        in_scene_prob: Probability that an object slot is filled from the scene's typical set.
        small_prob: Probability that an instance is drawn small (``small_px`` long side).
        small_px: Long-side range in pixels of small instances.
        min_visible: Minimum visible fraction an object keeps when later objects are placed.
    """

    image_size: int = 192
    min_objects: int = 3
    max_objects: int = 8
    min_distinct: int = 3
    in_scene_prob: float = 0.8
    small_prob: float = 0.18
    small_px: tuple[int, int] = (10, 18)
    min_visible: float = 0.35

    def __post_init__(self) -> None:
        if not 32 <= self.image_size <= 2048:
            raise ValueError(f"image_size must be in [32, 2048], got {self.image_size}")
        if not 1 <= self.min_objects <= self.max_objects <= 16:
            raise ValueError(f"need 1 <= min_objects <= max_objects <= 16, got {self.min_objects}, {self.max_objects}")
        for k in ("in_scene_prob", "small_prob", "min_visible"):
            if not 0.0 <= getattr(self, k) <= 1.0:
                raise ValueError(f"{k} must be in [0, 1], got {getattr(self, k)}")


@dataclass(frozen=True)
class Instance:
    """One annotated object of an image (COCO conventions for ``bbox`` / ``area``)."""

    category_id: int
    name: str
    bbox: tuple[int, int, int, int]
    area: int
    visible_fraction: float
    is_small: bool
    color: str
    variant: str = ""
    sample_index: int = -1  # position in the scene model's sampled list (annotation order); -1: not recorded

    @property
    def label(self) -> int:
        """Label-map value of this instance's category."""
        return CATEGORY_BY_NAME[self.name].label

    @property
    def center(self) -> tuple[float, float]:
        """Centre of the visible bounding box in pixels."""
        x, y, w, h = self.bbox
        return x + w / 2.0, y + h / 2.0


@dataclass(frozen=True)
class ImageAnnotation:
    """Everything known about one image (no pixels)."""

    image_id: int
    split: str
    file_name: str
    width: int
    height: int
    scene: str
    instances: tuple[Instance, ...] = field(default_factory=tuple)

    def object_names(self) -> list[str]:
        """Distinct category names in instance order (largest first)."""
        seen: list[str] = []
        for inst in self.instances:
            if inst.name not in seen:
                seen.append(inst.name)
        return seen

    def annotated_names(self) -> list[str]:
        """Distinct category names in annotation order (the scene model's sampling order, see
        ``Instance.sample_index``), each at its first sampled instance.

        Raises:
            ValueError: for annotations read back from COCO files, which do not record the order
                (``pope/world_objects_val.json`` of a written world does).
        """
        if any(inst.sample_index < 0 for inst in self.instances):
            raise ValueError(
                f"image {self.image_id}: annotation order not recorded (read from a COCO file?); "
                "use the world's pope/world_objects_val.json"
            )
        seen: list[str] = []
        for inst in sorted(self.instances, key=lambda i: i.sample_index):
            if inst.name not in seen:
                seen.append(inst.name)
        return seen

    def counts(self) -> dict[str, int]:
        """Number of instances per category name (instance order)."""
        out: dict[str, int] = {}
        for inst in self.instances:
            out[inst.name] = out.get(inst.name, 0) + 1
        return out


@dataclass(frozen=True)
class RenderedImage:
    """An image with its annotation and per-pixel maps (``uint8`` arrays of shape ``(H, W)``)."""

    image: Image.Image
    label_map: np.ndarray
    instance_map: np.ndarray
    annotation: ImageAnnotation


@dataclass(frozen=True)
class _Plan:
    cat: Category
    variant: str
    color: str
    w: int
    h: int
    angle: float
    flip: bool
    depth: float
    small: bool
    index: int  # position in the sampled name list (annotation order)


def image_seed(seed: int, split: str, image_id: int) -> int:
    """The 64-bit seed of one image."""
    digest = hashlib.sha256(f"mmfast-world:{seed}:{split}:{image_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def file_name_for(split: str, image_id: int) -> str:
    """COCO-style file name, e.g. ``WORLD_val_000000000001.png``."""
    return f"WORLD_{split}_{image_id:012d}.png"


def label_lut() -> np.ndarray:
    """``uint8`` lookup: COCO category id -> label-map value (0 for ids not in the world)."""
    if 0 not in _LABEL_LUT_CACHE:
        lut = np.zeros(256, dtype=np.uint8)
        for i, c in enumerate(CATEGORIES):
            lut[c.id] = i + 1
        _LABEL_LUT_CACHE[0] = lut
    return _LABEL_LUT_CACHE[0]


def _plan(name: str, rng: random.Random, cfg: WorldConfig, index: int) -> _Plan:
    cat = CATEGORY_BY_NAME[name]
    variant = rng.choices([v for v, _ in cat.variants], [w for _, w in cat.variants])[0] if cat.variants else ""
    color = VARIANT_COLOR.get((name, variant)) or rng.choice(cat.colors)
    s = cfg.image_size
    depth = rng.random()
    small = cat.layer > 0 and rng.random() < cfg.small_prob
    if small:
        long_side = rng.uniform(*cfg.small_px)
    else:
        long_side = rng.uniform(*cat.size) * s
        if cat.placement == "ground":
            long_side *= 0.8 + 0.35 * depth
    lo, hi = VARIANT_ASPECT.get((name, variant), cat.aspect)
    aspect = rng.uniform(lo, hi)
    w, h = (long_side, long_side / aspect) if aspect >= 1 else (long_side * aspect, long_side)
    angle = rng.uniform(-cat.rotation, cat.rotation)
    flip = cat.flip and rng.random() < 0.5
    return _Plan(cat, variant, color, max(3, round(w)), max(3, round(h)), angle, flip, depth, small, index)


def _rgb(p: _Plan, rng: random.Random) -> RGB:
    if p.cat.name == "sports ball" and p.variant == "basketball":
        return jitter((212, 108, 40), rng, 10)
    rgb = jitter(COLORS[p.color], rng, 14)
    if p.cat.supercategory == "animal" and p.color not in ("black", "white"):
        rgb = mix(rgb, (150, 118, 88), 0.3)
    return rgb


def _layer(p: _Plan, rng: random.Random, scale: float = 1.0) -> Image.Image:
    w, h = max(3, round(p.w * scale)), max(3, round(p.h * scale))
    ss = 4 if max(w, h) < 32 else 3 if max(w, h) < 80 else 2
    lay = Image.new("RGBA", (w * ss, h * ss), (0, 0, 0, 0))
    p.cat.drawer(Pen(ImageDraw.Draw(lay), w * ss, h * ss, ss), rng, _rgb(p, rng), p.variant)
    if p.flip:
        lay = lay.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    lay = lay.resize((w, h), Image.Resampling.BOX)
    if abs(p.angle) > 0.5:
        lay = lay.rotate(p.angle, resample=Image.Resampling.BICUBIC, expand=True)
    return lay


def _position(p: _Plan, lw: int, lh: int, s: int, hz: int, rng: random.Random) -> tuple[int, int]:
    x = rng.uniform(-0.15 * lw, s - 0.85 * lw)
    kind = p.cat.placement
    if kind == "ground":
        lo = min(s, hz + 0.08 * (s - hz) + 0.3 * lh)
        bottom = lo + (s + 0.1 * lh - lo) * min(1.0, max(0.0, p.depth + rng.uniform(-0.08, 0.08)))
        y = bottom - lh
    elif kind == "high":
        y = rng.uniform(-0.1 * lh, max(0.0, hz - 0.6 * lh))
    elif kind == "air":
        y = rng.uniform(-0.1 * lh, max(0.0, 0.7 * s - lh))
    else:
        y = rng.uniform(max(0.0, hz - lh), max(1.0, s - 0.85 * lh))
    y = min(max(y, -0.2 * lh), s - 0.8 * lh)
    return int(round(x)), int(round(y))


def _clip(x: int, y: int, lw: int, lh: int, s: int) -> tuple[slice, slice, slice, slice] | None:
    x0, y0, x1, y1 = max(0, x), max(0, y), min(s, x + lw), min(s, y + lh)
    if x1 <= x0 or y1 <= y0:
        return None
    return slice(y0, y1), slice(x0, x1), slice(y0 - y, y1 - y), slice(x0 - x, x1 - x)


def render_image(seed: int, split: str, image_id: int, config: WorldConfig | None = None) -> RenderedImage:
    """Render one image with its annotation, label map and instance map.

    Args:
        seed: World seed.
        split: ``"train"`` or ``"val"`` (any string works; it only seeds the generator).
        image_id: Image id (positive int).
        config: Generator settings; ``WorldConfig()`` if omitted.

    Returns:
        The :class:`RenderedImage`; identical for identical arguments.
    """
    cfg = config or WorldConfig()
    base = image_seed(seed, split, image_id)
    for attempt in range(8):  # re-draw (deterministically) if placement lost a needed category
        rng = random.Random(base + attempt)
        scene = sample_scene(rng)
        n = sample_count(rng, cfg.min_objects, cfg.max_objects)
        names = sample_objects(scene, n, rng, cfg.in_scene_prob, cfg.min_distinct)
        canvas, hz = draw_background(scene, cfg.image_size, rng)
        inst_map, full, placed = _compose(canvas, hz, names, rng, cfg)
        if len({p.cat.name for p in placed}) >= min(cfg.min_distinct, len(set(names))):
            break
        logger.debug("image %s/%d attempt %d lost a category; re-drawing", split, image_id, attempt)
    return _finalize(canvas, inst_map, full, placed, rng, cfg, scene.name, split, image_id)


def _compose(
    canvas: Image.Image, hz: int, names: list[str], rng: random.Random, cfg: WorldConfig
) -> tuple[np.ndarray, list[int], list[_Plan]]:
    """Place and draw the objects onto ``canvas``; returns instance map, full sizes, plans."""
    s = cfg.image_size
    plans = sorted((_plan(n, rng, cfg, i) for i, n in enumerate(names)), key=lambda p: (p.cat.layer, p.depth))
    inst_map = np.zeros((s, s), dtype=np.uint8)
    full: list[int] = [0]  # full-object pixel counts, index = provisional instance id
    vis: list[int] = [0]  # currently visible pixel counts
    placed: list[_Plan] = []
    for p in plans:
        for scale in (1.0, 0.7, 0.5):
            lay = _layer(p, rng, scale)
            mask = np.asarray(lay.getchannel("A")) >= 128
            n_full = int(mask.sum())
            if n_full < 4:
                break
            found = None
            for _ in range(6):
                x, y = _position(p, lay.width, lay.height, s, hz, rng)
                reg = _clip(x, y, lay.width, lay.height, s)
                if reg is None:
                    continue
                m = mask[reg[2], reg[3]]
                n_in = int(m.sum())
                if n_in < cfg.min_visible * n_full or n_in < 4:
                    continue
                covered = np.bincount(inst_map[reg[0], reg[1]][m], minlength=len(full))
                if all(vis[k] - covered[k] >= max(cfg.min_visible * full[k], 4) for k in range(1, len(full))):
                    found = (reg, m, n_in, covered)
                    break
            if found is None:
                continue
            reg, m, n_in, covered = found
            for k in range(1, len(full)):
                vis[k] -= int(covered[k])
            inst_map[reg[0], reg[1]][m] = len(full)
            full.append(n_full)
            vis.append(n_in)
            placed.append(p)
            piece = lay.crop((reg[3].start, reg[2].start, reg[3].stop, reg[2].stop))
            canvas.alpha_composite(piece, dest=(reg[1].start, reg[0].start))
            break
    return inst_map, full, placed


def _finalize(
    canvas: Image.Image,
    inst_map: np.ndarray,
    full: list[int],
    placed: list[_Plan],
    rng: random.Random,
    cfg: WorldConfig,
    scene: str,
    split: str,
    image_id: int,
) -> RenderedImage:
    """Noise the image, measure instances, sort them by visible area and build the maps."""
    s = cfg.image_size
    image = finish(canvas, rng)
    small_area = (0.1 * s) ** 2
    found: list[tuple[int, int, Instance]] = []
    for k, p in enumerate(placed, start=1):
        ys, xs = np.nonzero(inst_map == k)
        if len(xs) == 0:
            continue
        x0, y0 = int(xs.min()), int(ys.min())
        bbox = (x0, y0, int(xs.max()) - x0 + 1, int(ys.max()) - y0 + 1)
        area = int(len(xs))
        inst = Instance(
            p.cat.id, p.cat.name, bbox, area, round(area / full[k], 4), area < small_area, p.color, p.variant, p.index
        )
        found.append((area, k, inst))
    found.sort(key=lambda t: (-t[0], t[1]))
    remap = np.zeros(256, dtype=np.uint8)
    for new, (_, old, _) in enumerate(found, start=1):
        remap[old] = new
    inst_map = remap[inst_map]
    lut = np.zeros(256, dtype=np.uint8)
    for new, (_, _, inst) in enumerate(found, start=1):
        lut[new] = inst.label
    ann = ImageAnnotation(image_id, split, file_name_for(split, image_id), s, s, scene, tuple(t[2] for t in found))
    return RenderedImage(image, lut[inst_map], inst_map, ann)
