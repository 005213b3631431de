"""Object trajectories of the video world: linear motion with bounces, entries and exits.

A trajectory gives the top-left corner of an object's sprite at every frame ``t`` (pixels, may
lie outside the frame). Four kinds:

* ``still``: fixtures (furniture, appliances, street fixtures, tv, clock) do not move;
* ``inside``: ``x0 + vx * t`` (and ``y0 + vy * t`` for flying objects) reflected back and forth
  inside the bounds the image world places the category in (a bounce at each bound);
* ``enter``: moves horizontally in from outside the frame; the sprite is fully outside up to frame
  ``t_in - 1`` and its leading edge is ``|vx|`` px inside at frame ``t_in`` (``1 <= t_in <= F // 2``);
* ``leave``: moves horizontally out; it is fully outside from frame ``t_out`` on
  (``F // 2 <= t_out <= F - 1``).

Whether an object counts as *visible* in a frame is decided from the rendered pixels, not from
the kind (:mod:`mmfast.world.video_render`): an ``enter`` object that is hidden behind another one
when it arrives is not visible, and a fast ``leave`` object may cross the whole frame.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .categories import Category

MOTIONS: tuple[str, ...] = ("still", "inside", "enter", "leave")
_STILL_SUPERCATEGORIES = frozenset({"furniture", "appliance", "outdoor"})
_STILL_NAMES = frozenset({"tv", "clock"})


def reflect(v: float, lo: float, hi: float) -> float:
    """``v`` folded into ``[lo, hi]`` by reflections at both bounds (a bouncing coordinate)."""
    if hi <= lo:
        return lo
    span = hi - lo
    u = (v - lo) % (2.0 * span)
    return lo + (u if u <= span else 2.0 * span - u)


@dataclass(frozen=True)
class Trajectory:
    """Sprite position as a function of the frame index (see the module docstring).

    Attributes:
        motion: One of :data:`MOTIONS`.
        x0: Unreflected x of the top-left corner at frame 0.
        y0: Unreflected y at frame 0.
        vx: Horizontal speed in px per frame (signed).
        vy: Vertical speed in px per frame (signed; non-zero only for flying ``inside`` objects).
        x_bounds: Reflection bounds of x, or None (no bounce: ``enter`` / ``leave``).
        y_bounds: Reflection bounds of y, or None.
    """

    motion: str
    x0: float
    y0: float
    vx: float
    vy: float
    x_bounds: tuple[float, float] | None
    y_bounds: tuple[float, float] | None

    def position(self, t: int) -> tuple[int, int]:
        """Top-left corner of the sprite at frame ``t`` (rounded to pixels)."""
        x, y = self.x0 + self.vx * t, self.y0 + self.vy * t
        if self.x_bounds is not None:
            x = reflect(x, *self.x_bounds)
        if self.y_bounds is not None:
            y = reflect(y, *self.y_bounds)
        return int(round(x)), int(round(y))


def is_still(cat: Category) -> bool:
    """Fixtures that do not move in the video world."""
    return cat.supercategory in _STILL_SUPERCATEGORIES or cat.name in _STILL_NAMES


def plan_trajectory(
    cat: Category,
    lw: int,
    lh: int,
    start: tuple[int, int],
    size: int,
    frames: int,
    rng: random.Random,
    *,
    speed: tuple[float, float],
    enter_prob: float,
    leave_prob: float,
) -> Trajectory:
    """Draw the trajectory of one object.

    Args:
        cat: The object's category (fixtures stay still; ``air`` objects also move vertically).
        lw: Sprite width in px.
        lh: Sprite height in px.
        start: Position the image world's placement rule drew (used by ``still`` / ``inside``, and
            its ``y`` by every kind).
        size: Frame side in px.
        frames: Number of frames of the clip.
        rng: Random source (consumed in a fixed order).
        speed: Range of the speed as a fraction of ``size`` per frame.
        enter_prob: Probability that a moving object enters the frame mid-clip.
        leave_prob: Probability that a moving object leaves the frame mid-clip.

    Returns:
        The :class:`Trajectory`.
    """
    x, y = start
    if is_still(cat):
        return Trajectory("still", x, y, 0.0, 0.0, None, None)
    v = rng.uniform(*speed) * size
    vx = v if rng.random() < 0.5 else -v
    u = rng.random()
    if u < enter_prob:
        t_in = rng.randint(1, frames // 2)
        edge = -lw if vx > 0 else size  # x where the sprite is just outside, on its entry side
        return Trajectory("enter", edge + vx * (1 - t_in), y, vx, 0.0, None, None)
    if u < enter_prob + leave_prob:
        t_out = rng.randint(frames // 2, frames - 1)
        edge = size if vx > 0 else -lw  # x where the sprite is just outside, on its exit side
        return Trajectory("leave", edge - vx * t_out, y, vx, 0.0, None, None)
    x_bounds = (-0.15 * lw, size - 0.85 * lw)  # the image world's horizontal placement range
    vy, y_bounds = 0.0, None
    if cat.placement == "air":
        vy, y_bounds = rng.uniform(-0.5, 0.5) * v, (-0.1 * lh, max(0.0, 0.7 * size - lh))
    return Trajectory("inside", x, y, vx, vy, x_bounds, y_bounds)
