"""Drawing primitives shared by the per-category drawing routines.

Every object is drawn by a small routine into its own transparent RGBA *layer* through a
:class:`Pen`. The pen speaks **unit coordinates**: ``(0, 0)`` is the layer's top-left corner and
``(1, 1)`` its bottom-right corner, whatever the layer's pixel size and aspect ratio. A routine
therefore describes the *shape* of a category once ("head is a circle near the top-right, four
legs below the body") and the renderer decides size, aspect, supersampling, flip and rotation.

Colours are named (``COLORS``) because the text generators talk about them ("a red car").
The word "orange" is deliberately not a colour name: it is also a COCO category, and CHAIR would
count the colour as a mention of the fruit.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from PIL import ImageDraw

RGB = tuple[int, int, int]

#: Named colours used for object attributes (and mentioned in the text).
COLORS: dict[str, RGB] = {
    "red": (196, 38, 38),
    "blue": (40, 86, 200),
    "green": (48, 148, 60),
    "yellow": (232, 202, 44),
    "white": (236, 236, 230),
    "black": (34, 34, 38),
    "brown": (122, 78, 42),
    "gray": (130, 130, 134),
    "pink": (232, 132, 172),
    "purple": (122, 62, 164),
}


def clamp(v: float) -> int:
    """Clamp a channel value into ``0..255``."""
    return 0 if v < 0 else 255 if v > 255 else int(v)


def shade(c: RGB, f: float) -> RGB:
    """Scale a colour's brightness by ``f`` (``f < 1`` darkens, ``f > 1`` lightens)."""
    if f <= 1.0:
        return (clamp(c[0] * f), clamp(c[1] * f), clamp(c[2] * f))
    t = min(1.0, f - 1.0)
    return mix(c, (255, 255, 255), t)


def mix(a: RGB, b: RGB, t: float) -> RGB:
    """Linear interpolation ``a + t * (b - a)``."""
    return (clamp(a[0] + t * (b[0] - a[0])), clamp(a[1] + t * (b[1] - a[1])), clamp(a[2] + t * (b[2] - a[2])))


def jitter(c: RGB, rng: random.Random, amount: int = 16) -> RGB:
    """A random nearby colour (per-channel uniform noise of +-``amount``)."""
    return (
        clamp(c[0] + rng.randint(-amount, amount)),
        clamp(c[1] + rng.randint(-amount, amount)),
        clamp(c[2] + rng.randint(-amount, amount)),
    )


def outline_of(c: RGB) -> RGB:
    """A dark outline colour matching a fill colour."""
    return shade(c, 0.45)


class Pen:
    """Draws in unit coordinates on a (supersampled) RGBA layer.

    Args:
        draw: Pillow drawing context of the layer.
        width: Layer width in layer pixels.
        height: Layer height in layer pixels.
        px: Size of one *final* image pixel in layer pixels (the supersampling factor), used so
            that outlines stay about one final pixel wide.
    """

    def __init__(self, draw: ImageDraw.ImageDraw, width: int, height: int, px: int) -> None:
        self.d = draw
        self.w = width
        self.h = height
        self.px = px
        self.m = min(width, height)

    # -- coordinate helpers -------------------------------------------------------------------
    def x(self, u: float) -> float:
        """Unit x -> layer pixels."""
        return u * self.w

    def y(self, v: float) -> float:
        """Unit y -> layer pixels."""
        return v * self.h

    def lw(self, frac: float) -> int:
        """Line width: ``frac`` of the shorter side, at least one final pixel."""
        return max(self.px, int(round(frac * self.m)))

    def _box(self, x0: float, y0: float, x1: float, y1: float) -> list[float]:
        a, b = sorted((x0 * self.w, x1 * self.w))
        c, d = sorted((y0 * self.h, y1 * self.h))
        return [a, c, max(b, a + 1), max(d, c + 1)]

    def _ol(self, fill: RGB | None, outline: RGB | bool | None) -> RGB | None:
        if outline is True:
            return outline_of(fill) if fill is not None else (20, 20, 20)
        if outline is False or outline is None:
            return None
        return outline

    # -- shapes -------------------------------------------------------------------------------
    def rect(
        self,
        x0: float,
        y0: float,
        x1: float,
        y1: float,
        fill: RGB | None,
        outline: RGB | bool | None = True,
        radius: float = 0.0,
    ) -> None:
        """Axis-aligned (optionally rounded) rectangle; ``radius`` is a fraction of the short side."""
        ol = self._ol(fill, outline)
        box = self._box(x0, y0, x1, y1)
        # PIL fails on a radius larger than half the box (tiny instances): clamp it
        rad = min(radius * self.m, (box[2] - box[0] - 2) / 2, (box[3] - box[1] - 2) / 2)
        if rad >= 1:
            self.d.rounded_rectangle(box, radius=rad, fill=fill, outline=ol, width=self.px if ol else 0)
        else:
            self.d.rectangle(box, fill=fill, outline=ol, width=self.px if ol else 0)

    def ellipse(
        self,
        x0: float,
        y0: float,
        x1: float,
        y1: float,
        fill: RGB | None,
        outline: RGB | bool | None = True,
        width: float = 0.0,
    ) -> None:
        """Ellipse inscribed in a unit box."""
        ol = self._ol(fill, outline)
        w = self.lw(width) if width else self.px
        self.d.ellipse(self._box(x0, y0, x1, y1), fill=fill, outline=ol, width=w if ol else 0)

    def circle(
        self, cx: float, cy: float, r: float, fill: RGB | None, outline: RGB | bool | None = True, width: float = 0.0
    ) -> None:
        """A true circle: centre in unit coordinates, radius a fraction of the shorter side."""
        ol = self._ol(fill, outline)
        x, y, rr = cx * self.w, cy * self.h, max(1.0, r * self.m)
        w = self.lw(width) if width else self.px
        self.d.ellipse([x - rr, y - rr, x + rr, y + rr], fill=fill, outline=ol, width=w if ol else 0)

    def poly(self, pts: Sequence[tuple[float, float]], fill: RGB | None, outline: RGB | bool | None = True) -> None:
        """Filled polygon from unit points."""
        ol = self._ol(fill, outline)
        self.d.polygon([(u * self.w, v * self.h) for u, v in pts], fill=fill, outline=ol, width=self.px if ol else 0)

    def line(self, pts: Sequence[tuple[float, float]], fill: RGB, width: float = 0.04) -> None:
        """Poly-line; ``width`` is a fraction of the shorter side."""
        self.d.line([(u * self.w, v * self.h) for u, v in pts], fill=fill, width=self.lw(width), joint="curve")

    def pieslice(
        self,
        x0: float,
        y0: float,
        x1: float,
        y1: float,
        start: float,
        end: float,
        fill: RGB,
        outline: RGB | bool | None = True,
    ) -> None:
        """Pie slice of the ellipse in a unit box, angles in degrees (0 = east, clockwise)."""
        ol = self._ol(fill, outline)
        self.d.pieslice(self._box(x0, y0, x1, y1), start, end, fill=fill, outline=ol, width=self.px if ol else 0)

    def chord(
        self,
        x0: float,
        y0: float,
        x1: float,
        y1: float,
        start: float,
        end: float,
        fill: RGB,
        outline: RGB | bool | None = True,
    ) -> None:
        """Chord (segment) of the ellipse in a unit box."""
        ol = self._ol(fill, outline)
        self.d.chord(self._box(x0, y0, x1, y1), start, end, fill=fill, outline=ol, width=self.px if ol else 0)

    def arc(
        self, x0: float, y0: float, x1: float, y1: float, start: float, end: float, fill: RGB, width: float = 0.04
    ) -> None:
        """Arc of the ellipse in a unit box."""
        self.d.arc(self._box(x0, y0, x1, y1), start, end, fill=fill, width=self.lw(width))

    def stripes(
        self, x0: float, y0: float, x1: float, y1: float, n: int, fill: RGB, vertical: bool = False, width: float = 0.03
    ) -> None:
        """``n`` parallel lines across a box (texture / pattern helper)."""
        for i in range(1, n + 1):
            t = i / (n + 1)
            if vertical:
                u = x0 + t * (x1 - x0)
                self.line([(u, y0), (u, y1)], fill, width)
            else:
                v = y0 + t * (y1 - y0)
                self.line([(x0, v), (x1, v)], fill, width)

    def spots(
        self, rng: random.Random, x0: float, y0: float, x1: float, y1: float, n: int, fill: RGB, r: float = 0.06
    ) -> None:
        """``n`` random round spots inside a box (texture helper)."""
        for _ in range(n):
            self.circle(rng.uniform(x0, x1), rng.uniform(y0, y1), r * rng.uniform(0.6, 1.3), fill, outline=False)
