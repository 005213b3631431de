"""Scene backgrounds: a wall / sky part above a floor / ground part, plus clutter.

Each scene type has a recognisable style (kitchen: light tiles over a wooden counter; street: sky,
buildings and a gray road; office: gray wall with a window over a blue carpet; living room:
striped wallpaper over wooden planks; park: sky, tree line and grass; bedroom: pastel dotted
wall over a beige carpet; dining room: warm wall with wainscot over a dark wooden floor).
Colours are jittered per image so that the scene is inferable but not trivially so, and random
low-contrast clutter (blobs, lines, frames) is added so that object perception is imperfect.
Clutter never gets a label: it is background (label ``0``).
"""

from __future__ import annotations

import random

import numpy as np
from PIL import Image, ImageDraw

from .draw_base import RGB, jitter, mix, shade
from .scenes import SceneSpec


def _vgrad(d: ImageDraw.ImageDraw, x0: int, y0: int, x1: int, y1: int, top: RGB, bot: RGB) -> None:
    n = max(1, y1 - y0)
    for i in range(n):
        d.line([(x0, y0 + i), (x1, y0 + i)], fill=mix(top, bot, i / n))


def _sky(d: ImageDraw.ImageDraw, s: int, h: int, rng: random.Random) -> None:
    top = jitter((120, 170, 225), rng, 18)
    _vgrad(d, 0, 0, s, h, top, mix(top, (235, 240, 245), 0.6))
    for _ in range(rng.randint(0, 3)):
        x, y = rng.uniform(0, s), rng.uniform(0, h * 0.6)
        w = rng.uniform(0.1, 0.25) * s
        d.ellipse([x - w, y - w * 0.25, x + w, y + w * 0.25], fill=jitter((245, 245, 248), rng, 6))


def _planks(d: ImageDraw.ImageDraw, s: int, y0: int, base: RGB, rng: random.Random, step: int) -> None:
    d.rectangle([0, y0, s, s], fill=base)
    y = y0
    while y < s:
        d.line([(0, y), (s, y)], fill=shade(base, 0.7), width=1)
        off = rng.randint(0, s)
        for x in range(off % 40, s, 40 + rng.randint(0, 20)):
            d.line([(x, y), (x, min(s, y + step))], fill=shade(base, 0.75), width=1)
        step = int(step * 1.15) + 1
        y += step


def _kitchen(d: ImageDraw.ImageDraw, s: int, hz: int, rng: random.Random) -> None:
    wall = jitter(rng.choice(((236, 230, 214), (218, 232, 236), (240, 240, 238), (226, 236, 220))), rng, 10)
    d.rectangle([0, 0, s, hz], fill=wall)
    t = rng.randint(9, 15)
    for x in range(0, s, t):
        d.line([(x, 0), (x, hz)], fill=shade(wall, 0.82))
    for y in range(0, hz, t):
        d.line([(0, y), (s, y)], fill=shade(wall, 0.82))
    _planks(d, s, hz, jitter((160, 112, 70), rng, 16), rng, 6)
    d.rectangle([0, hz, s, hz + 4], fill=shade(wall, 0.6))


def _street(d: ImageDraw.ImageDraw, s: int, hz: int, rng: random.Random) -> None:
    _sky(d, s, hz, rng)
    x = -rng.randint(0, 20)
    while x < s:
        w = rng.randint(28, 60)
        top = rng.randint(int(hz * 0.1), int(hz * 0.55))
        col = jitter(rng.choice(((150, 80, 60), (160, 160, 165), (210, 195, 160), (120, 120, 130))), rng, 12)
        d.rectangle([x, top, x + w, hz], fill=col)
        for wy in range(top + 5, hz - 6, 10):
            for wx in range(x + 4, x + w - 6, 9):
                d.rectangle([wx, wy, wx + 4, wy + 5], fill=shade(col, 0.55))
        x += w + rng.randint(0, 4)
    walk = hz + int((s - hz) * 0.15)
    d.rectangle([0, hz, s, walk], fill=jitter((185, 185, 180), rng, 10))
    road = jitter((92, 92, 96), rng, 10)
    d.rectangle([0, walk, s, s], fill=road)
    ly = (walk + s) // 2
    lane = (240, 240, 235) if rng.random() < 0.5 else (235, 200, 60)
    for x in range(rng.randint(0, 12), s, 26):
        d.rectangle([x, ly - 1, x + 13, ly + 1], fill=lane)


def _office(d: ImageDraw.ImageDraw, s: int, hz: int, rng: random.Random) -> None:
    wall = jitter((204, 208, 214), rng, 12)
    d.rectangle([0, 0, s, hz], fill=wall)
    if rng.random() < 0.7:
        x0 = rng.randint(0, s // 2)
        w, h = rng.randint(s // 4, s // 2), rng.randint(hz // 3, int(hz * 0.7))
        y0 = rng.randint(4, max(5, hz - h - 4))
        d.rectangle([x0, y0, x0 + w, y0 + h], fill=jitter((170, 205, 235), rng, 12), outline=(240, 240, 240), width=2)
        for y in range(y0 + 4, y0 + h, 5):
            d.line([(x0 + 2, y), (x0 + w - 2, y)], fill=(225, 228, 232))
    carpet = jitter((88, 100, 132), rng, 12)
    d.rectangle([0, hz, s, s], fill=carpet)
    d.rectangle([0, hz, s, hz + 3], fill=shade(wall, 0.5))


def _living(d: ImageDraw.ImageDraw, s: int, hz: int, rng: random.Random) -> None:
    a = jitter(rng.choice(((232, 214, 180), (200, 222, 190), (236, 196, 176), (214, 204, 226))), rng, 10)
    b = shade(a, 0.9)
    w = rng.randint(7, 14)
    for i, x in enumerate(range(0, s, w)):
        d.rectangle([x, 0, x + w, hz], fill=a if i % 2 == 0 else b)
    _planks(d, s, hz, jitter((150, 98, 56), rng, 14), rng, 5)
    if rng.random() < 0.6:
        rug = jitter(rng.choice(((160, 40, 50), (50, 70, 140), (190, 150, 80))), rng, 14)
        y_hi = hz + (s - hz) // 2
        x0, y0 = rng.randint(0, s // 3), rng.randint(min(hz + 10, y_hi), y_hi)  # small images: floor < 20 px
        d.rectangle([x0, y0, x0 + rng.randint(s // 3, s // 2 + 30), min(s, y0 + (s - hz) // 2)], fill=rug)


def _park(d: ImageDraw.ImageDraw, s: int, hz: int, rng: random.Random) -> None:
    _sky(d, s, hz, rng)
    grass = jitter((92, 160, 70), rng, 14)
    d.rectangle([0, hz, s, s], fill=grass)
    x = -rng.randint(0, 20)
    while x < s + 20:
        r = rng.randint(12, 24)
        d.rectangle([x - 2, hz - r // 2, x + 2, hz + 2], fill=(90, 60, 35))
        d.ellipse([x - r, hz - r * 2, x + r, hz - r // 3], fill=jitter((40, 105, 45), rng, 14))
        x += rng.randint(r, 2 * r + 10)
    for _ in range(60):
        gx, gy = rng.uniform(0, s), rng.uniform(hz, s)
        d.line([(gx, gy), (gx + rng.uniform(-2, 2), gy - rng.uniform(2, 5))], fill=shade(grass, 0.75))
    if rng.random() < 0.5:
        path = jitter((200, 185, 150), rng, 12)
        x0 = rng.uniform(0.2, 0.7) * s
        d.polygon([(x0 - 6, hz), (x0 + 6, hz), (x0 + 50, s), (x0 - 40, s)], fill=path)


def _bedroom(d: ImageDraw.ImageDraw, s: int, hz: int, rng: random.Random) -> None:
    wall = jitter(rng.choice(((236, 200, 210), (214, 204, 236), (196, 220, 236), (204, 232, 214))), rng, 10)
    d.rectangle([0, 0, s, hz], fill=wall)
    dot = shade(wall, 0.85)
    st = rng.randint(10, 16)
    for y in range(4, hz, st):
        for x in range(4 + (y // st % 2) * st // 2, s, st):
            d.ellipse([x - 1, y - 1, x + 1, y + 1], fill=dot)
    d.rectangle([0, hz, s, s], fill=jitter((206, 190, 164), rng, 10))
    d.rectangle([0, hz, s, hz + 3], fill=(245, 245, 240))


def _dining(d: ImageDraw.ImageDraw, s: int, hz: int, rng: random.Random) -> None:
    wall = jitter(rng.choice(((196, 130, 110), (180, 150, 110), (166, 160, 120), (170, 120, 130))), rng, 10)
    d.rectangle([0, 0, s, hz], fill=wall)
    wy = hz - int(hz * 0.3)
    d.rectangle([0, wy, s, hz], fill=shade(wall, 0.75))
    d.line([(0, wy), (s, wy)], fill=shade(wall, 0.5), width=2)
    _planks(d, s, hz, jitter((92, 60, 40), rng, 10), rng, 5)


_STYLES = {
    "kitchen": _kitchen,
    "street": _street,
    "office": _office,
    "living room": _living,
    "park": _park,
    "bedroom": _bedroom,
    "dining room": _dining,
}


def _clutter(img: Image.Image, hz: int, rng: random.Random) -> None:
    """Low-contrast blobs, lines and frames; unlabelled background distractors."""
    s = img.width
    over = Image.new("RGBA", img.size, (0, 0, 0, 0))
    d = ImageDraw.Draw(over)
    for _ in range(rng.randint(3, 9)):
        kind = rng.random()
        x, y = rng.uniform(0, s), rng.uniform(0, s)
        col = jitter(img.getpixel((int(x) % s, int(y) % s))[:3], rng, 60)  # type: ignore[index]
        a = rng.randint(60, 150)
        r = rng.uniform(3, 16)
        if kind < 0.4:
            d.ellipse([x - r, y - r * rng.uniform(0.4, 1.0), x + r, y + r * rng.uniform(0.4, 1.0)], fill=col + (a,))
        elif kind < 0.7:
            d.line(
                [(x, y), (x + rng.uniform(-40, 40), y + rng.uniform(-20, 20))], fill=col + (a,), width=rng.randint(1, 2)
            )
        elif y < hz:  # picture frame / shelf on the wall
            w, h = rng.uniform(10, 30), rng.uniform(8, 22)
            d.rectangle([x, y, x + w, y + h], fill=jitter(col, rng, 30) + (a,), outline=(60, 50, 40, 200))
        else:
            d.polygon([(x, y), (x + r, y + r * 0.3), (x + r * 0.4, y + r)], fill=col + (a,))
    img.alpha_composite(over)


def draw_background(scene: SceneSpec, size: int, rng: random.Random) -> tuple[Image.Image, int]:
    """Draw the background of one image.

    Args:
        scene: Scene type (selects the style).
        size: Image side in pixels.
        rng: Random source.

    Returns:
        An RGBA image and the horizon row (wall / floor split) in pixels.
    """
    img = Image.new("RGBA", (size, size), (0, 0, 0, 255))
    hz = int(size * rng.uniform(*scene.horizon))
    _STYLES[scene.name](ImageDraw.Draw(img), size, hz, rng)
    _clutter(img, hz, rng)
    return img, hz


def finish(img: Image.Image, rng: random.Random) -> Image.Image:
    """Global photometric noise: per-channel tint, brightness and Gaussian pixel noise (RGB out)."""
    arr = np.asarray(img.convert("RGB"), dtype=np.float32)
    rs = np.random.RandomState(rng.getrandbits(32))
    tint = np.array([rng.uniform(0.92, 1.08) for _ in range(3)], dtype=np.float32) * rng.uniform(0.88, 1.1)
    sigma = rng.uniform(2.5, 7.0)
    arr = arr * tint + rs.normal(0.0, sigma, size=arr.shape).astype(np.float32)
    return Image.fromarray(np.clip(arr + 0.5, 0, 255).astype(np.uint8), "RGB")
