"""Rendering one clip of the video world, deterministically from ``(seed, clip_id)``.

A clip is ``frames`` RGB frames of the image world's size, seen by a still camera: one scene
background, objects of the image world's vocabulary drawn by its renderer (same scene model, same
sprites, same placement rule for the first frame), moving along :mod:`mmfast.world._motion`
trajectories: fixtures stay, other objects move linearly and bounce, some enter or leave the frame
mid-clip. Pipeline of :func:`render_clip`:

1. A per-clip :class:`random.Random` is seeded from ``sha256("mmfast-video:{seed}:{clip_id}")``.
2. Scene, object count and categories are sampled as for an image (:mod:`mmfast.world.scenes`),
   then the background; each object gets its sprite once (so it looks the same in every frame),
   a start position and a trajectory.
3. Every frame composites the sprites on the background in the image world's order (big
   furniture first, then back to front) and adds the world's photometric noise (one tint and
   noise level per clip, fresh Gaussian noise per frame).

**Visibility rule** (the ground truth). An object instance is *visible in frame t* if at least
``min_visible`` (35%, the image world's ``min_visible``) of its sprite's pixels are visible in that
frame (inside the frame and not covered by an object drawn in front; alpha >= 50%) and at least 4
pixels. A category is in frame ``t``'s object set if one of its instances is visible there, and
*in the video* if it is in at least one frame's set: the clip's object set is the union of the
per-frame sets. An instance the rule counts in no frame is not drawn at all (as the image world
drops an object it cannot place visibly), so that a category absent from the clip's object set is
absent from every frame, not partly visible (POPE asks about it as absent). Objects are listed in
annotation order (the scene model's sampling order, as in the image world), which the official POPE
rule reads.
"""

from __future__ import annotations

import hashlib
import logging
import random
from dataclasses import dataclass, field

import numpy as np
from PIL import Image

from ._motion import Trajectory, plan_trajectory
from .backgrounds import draw_background
from .render import WorldConfig, _clip, _layer, _Plan, _plan, _position
from .scenes import sample_count, sample_objects, sample_scene

logger = logging.getLogger(__name__)

MIN_FRAMES = 8
MAX_FRAMES = 64
_MIN_PIXELS = 4


@dataclass(frozen=True)
class VideoConfig:
    """Knobs of the clip generator.

    Attributes:
        frames: Frames per clip, in ``[MIN_FRAMES, MAX_FRAMES]`` (8-32 for short clips; 64 for the
            long setting of the cost bench).
        image_size: Frame side in pixels (the image world's 192 by default).
        min_objects: Minimum number of sampled objects per clip.
        max_objects: Maximum number of sampled objects per clip.
        min_distinct: Every clip shows at least ``min(min_distinct, sampled categories)`` distinct
            categories under the visibility rule (re-drawn otherwise), so clips are POPE-eligible.
        in_scene_prob: Probability that an object slot is filled from the scene's typical set.
        small_prob: Probability that an instance is drawn small.
        enter_prob: Probability that a moving object enters the frame mid-clip.
        leave_prob: Probability that a moving object leaves the frame mid-clip.
        speed: Speed range of moving objects, as a fraction of ``image_size`` per frame.
        min_visible: Visible fraction of its pixels an instance needs to count in a frame.
    """

    frames: int = 16
    image_size: int = 192
    min_objects: int = 3
    max_objects: int = 8
    min_distinct: int = 3
    in_scene_prob: float = 0.8
    small_prob: float = 0.18
    enter_prob: float = 0.25
    leave_prob: float = 0.25
    speed: tuple[float, float] = (0.01, 0.035)
    min_visible: float = 0.35

    def __post_init__(self) -> None:
        if not MIN_FRAMES <= self.frames <= MAX_FRAMES:
            raise ValueError(f"frames must be in [{MIN_FRAMES}, {MAX_FRAMES}], got {self.frames}")
        if not (self.enter_prob >= 0 and self.leave_prob >= 0 and self.enter_prob + self.leave_prob <= 1):
            raise ValueError(
                f"enter_prob and leave_prob must be >= 0 with a sum <= 1, got {self.enter_prob}, {self.leave_prob}"
            )
        if not 0 <= self.speed[0] <= self.speed[1] <= 0.5:
            raise ValueError(f"speed must satisfy 0 <= low <= high <= 0.5 (image sides per frame), got {self.speed}")
        self.world()  # validates image_size, object counts and probabilities

    def world(self) -> WorldConfig:
        """The image world's settings for the shared sampling and drawing code."""
        return WorldConfig(
            image_size=self.image_size,
            min_objects=self.min_objects,
            max_objects=self.max_objects,
            min_distinct=self.min_distinct,
            in_scene_prob=self.in_scene_prob,
            small_prob=self.small_prob,
            min_visible=self.min_visible,
        )


@dataclass(frozen=True)
class Track:
    """One object instance through a clip (per-frame tuples have one entry per frame).

    Attributes:
        instance: Instance number, 1-based, in drawing order (value in ``instance_maps``).
        category_id: COCO category id.
        name: Category name.
        sample_index: Position in the scene model's sampled list (annotation order).
        motion: Trajectory kind (:data:`mmfast.world._motion.MOTIONS`).
        size: Sprite ``(width, height)`` in px.
        full_area: Sprite pixels (alpha >= 50%).
        positions: Sprite top-left corner per frame (may lie outside the frame).
        areas: Visible pixels per frame.
        bboxes: COCO ``[x, y, w, h]`` box of the visible pixels per frame, None where none.
    """

    instance: int
    category_id: int
    name: str
    sample_index: int
    motion: str
    size: tuple[int, int]
    full_area: int
    positions: tuple[tuple[int, int], ...]
    areas: tuple[int, ...]
    bboxes: tuple[tuple[int, int, int, int] | None, ...]

    def visible(self, t: int, min_visible: float) -> bool:
        """The visibility rule (module docstring) at frame ``t``."""
        return self.areas[t] >= max(min_visible * self.full_area, _MIN_PIXELS)


@dataclass(frozen=True)
class ClipAnnotation:
    """Everything known about one clip (no pixels)."""

    clip_id: int
    name: str
    scene: str
    width: int
    height: int
    num_frames: int
    min_visible: float
    tracks: tuple[Track, ...] = field(default_factory=tuple)

    def _in_order(self) -> list[Track]:
        return sorted(self.tracks, key=lambda tr: tr.sample_index)

    def frame_objects(self, t: int) -> list[str]:
        """Distinct categories visible in frame ``t``, in annotation order."""
        out: list[str] = []
        for tr in self._in_order():
            if tr.visible(t, self.min_visible) and tr.name not in out:
                out.append(tr.name)
        return out

    def clip_objects(self) -> list[str]:
        """Distinct categories visible in at least one frame, in annotation order."""
        seen = {n for t in range(self.num_frames) for n in self.frame_objects(t)}
        out: list[str] = []
        for tr in self._in_order():
            if tr.name in seen and tr.name not in out:
                out.append(tr.name)
        return out


@dataclass(frozen=True)
class RenderedClip:
    """A clip's frames with its annotation; ``instance_maps`` is ``uint8 (F, H, W)`` (0 = background,
    ``k`` = the track with ``instance == k``; the last-drawn object wins)."""

    frames: tuple[Image.Image, ...]
    instance_maps: np.ndarray
    annotation: ClipAnnotation


@dataclass(frozen=True)
class _Sprite:
    layer: Image.Image
    mask: np.ndarray  # bool (lh, lw): alpha >= 50%
    trajectory: Trajectory


def clip_seed(seed: int, clip_id: int) -> int:
    """The 64-bit seed of one clip."""
    return int.from_bytes(hashlib.sha256(f"mmfast-video:{seed}:{clip_id}".encode()).digest()[:8], "big")


def clip_dir_name(clip_id: int) -> str:
    """Directory name of a clip, e.g. ``VWORLD_000001``."""
    return f"VWORLD_{clip_id:06d}"


def frame_file_name(t: int) -> str:
    """File name of frame ``t`` (0-based), e.g. ``frame_000.png``."""
    return f"frame_{t:03d}.png"


def render_clip(seed: int, clip_id: int, config: VideoConfig | None = None) -> RenderedClip:
    """Render one clip with its annotation and per-frame instance maps.

    Args:
        seed: World seed.
        clip_id: Clip id (positive int).
        config: Generator settings; ``VideoConfig()`` if omitted.

    Returns:
        The :class:`RenderedClip`; identical for identical arguments.
    """
    cfg = config or VideoConfig()
    wcfg = cfg.world()
    base = clip_seed(seed, clip_id)
    for attempt in range(8):  # re-draw (deterministically) if too few categories end up visible
        rng = random.Random(base + attempt)
        scene = sample_scene(rng)
        names = sample_objects(
            scene, sample_count(rng, cfg.min_objects, cfg.max_objects), rng, cfg.in_scene_prob, cfg.min_distinct
        )
        background, hz = draw_background(scene, cfg.image_size, rng)
        plans = sorted((_plan(n, rng, wcfg, i) for i, n in enumerate(names)), key=lambda p: (p.cat.layer, p.depth))
        sprites = []
        for p in plans:
            lay = _layer(p, rng)
            start = _position(p, lay.width, lay.height, cfg.image_size, hz, rng)
            traj = plan_trajectory(
                p.cat,
                lay.width,
                lay.height,
                start,
                cfg.image_size,
                cfg.frames,
                rng,
                speed=cfg.speed,
                enter_prob=cfg.enter_prob,
                leave_prob=cfg.leave_prob,
            )
            sprites.append(_Sprite(lay, np.asarray(lay.getchannel("A")) >= 128, traj))
        noise_state = rng.getstate()
        frames, maps = _draw_frames(background, sprites, cfg, rng)
        ann = _annotate(clip_id, scene.name, plans, sprites, maps, cfg)
        never = {tr.instance for tr in ann.tracks if not any(tr.visible(t, cfg.min_visible) for t in range(cfg.frames))}
        if never:  # drawn but under the rule in every frame: not drawn at all (as the image world drops them)
            plans = [p for k, p in enumerate(plans, start=1) if k not in never]
            sprites = [sp for k, sp in enumerate(sprites, start=1) if k not in never]
            rng.setstate(noise_state)  # the same photometric noise
            frames, maps = _draw_frames(background, sprites, cfg, rng)
            ann = _annotate(clip_id, scene.name, plans, sprites, maps, cfg)
        if len(ann.clip_objects()) >= min(cfg.min_distinct, len(set(names))):
            return RenderedClip(frames, maps, ann)
        logger.debug("clip %d attempt %d: too few visible categories; re-drawing", clip_id, attempt)
    logger.warning(
        "clip %d shows %d categories after 8 draws (fewer than POPE needs)", clip_id, len(ann.clip_objects())
    )
    return RenderedClip(frames, maps, ann)


def _draw_frames(
    background: Image.Image, sprites: list[_Sprite], cfg: VideoConfig, rng: random.Random
) -> tuple[tuple[Image.Image, ...], np.ndarray]:
    """Composite every frame; returns the RGB frames and the instance maps ``uint8 (F, H, W)``."""
    s = cfg.image_size
    # the image world's photometric model (backgrounds.finish): one tint and noise level per clip
    rs = np.random.RandomState(rng.getrandbits(32))
    tint = np.array([rng.uniform(0.92, 1.08) for _ in range(3)], dtype=np.float32) * rng.uniform(0.88, 1.1)
    sigma = rng.uniform(2.5, 7.0)
    maps = np.zeros((cfg.frames, s, s), dtype=np.uint8)  # (F, H, W)
    frames: list[Image.Image] = []
    for t in range(cfg.frames):
        canvas = background.copy()
        for k, sp in enumerate(sprites, start=1):
            x, y = sp.trajectory.position(t)
            reg = _clip(x, y, sp.layer.width, sp.layer.height, s)
            if reg is None:
                continue
            maps[t][reg[0], reg[1]][sp.mask[reg[2], reg[3]]] = k
            piece = sp.layer.crop((reg[3].start, reg[2].start, reg[3].stop, reg[2].stop))
            canvas.alpha_composite(piece, dest=(reg[1].start, reg[0].start))
        arr = np.asarray(canvas.convert("RGB"), dtype=np.float32)  # (H, W, 3)
        arr = arr * tint + rs.normal(0.0, sigma, size=arr.shape).astype(np.float32)
        frames.append(Image.fromarray(np.clip(arr + 0.5, 0, 255).astype(np.uint8), "RGB"))
    return tuple(frames), maps


def _bbox(mask: np.ndarray) -> tuple[int, int, int, int] | None:
    ys, xs = np.nonzero(mask)
    if len(xs) == 0:
        return None
    x0, y0 = int(xs.min()), int(ys.min())
    return x0, y0, int(xs.max()) - x0 + 1, int(ys.max()) - y0 + 1


def _annotate(
    clip_id: int, scene: str, plans: list[_Plan], sprites: list[_Sprite], maps: np.ndarray, cfg: VideoConfig
) -> ClipAnnotation:
    """Measure every instance in every frame from the instance maps."""
    counts = np.stack([np.bincount(m.ravel(), minlength=len(sprites) + 1) for m in maps])  # (F, K + 1)
    tracks = []
    for k, (p, sp) in enumerate(zip(plans, sprites), start=1):
        tracks.append(
            Track(
                instance=k,
                category_id=p.cat.id,
                name=p.cat.name,
                sample_index=p.index,
                motion=sp.trajectory.motion,
                size=(sp.layer.width, sp.layer.height),
                full_area=int(sp.mask.sum()),
                positions=tuple(sp.trajectory.position(t) for t in range(cfg.frames)),
                areas=tuple(int(c) for c in counts[:, k]),
                bboxes=tuple(_bbox(m == k) for m in maps),
            )
        )
    s = cfg.image_size
    return ClipAnnotation(clip_id, clip_dir_name(clip_id), scene, s, s, cfg.frames, cfg.min_visible, tuple(tracks))
