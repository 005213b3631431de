"""Drawing routines for furniture, electronics and books.

Same signature as every drawing routine: ``draw_x(p, rng, c, variant)`` (see
:mod:`mmfast.world.draw_living`). Deliberately confusable groups at small sizes: tv / laptop /
microwave (a dark or bright screen in a frame), remote / cell phone (small dark slabs),
couch / bed / chair (cushions on legs).
"""

from __future__ import annotations

import random

from .draw_base import RGB, Pen, jitter, mix, shade

SCREENS: tuple[tuple[RGB, RGB], ...] = (
    ((70, 130, 220), (150, 200, 250)),
    ((40, 150, 90), (170, 220, 120)),
    ((30, 30, 60), (80, 80, 150)),
    ((220, 120, 60), (250, 210, 120)),
)


def _screen(p: Pen, rng: random.Random, x0: float, y0: float, x1: float, y1: float) -> None:
    """A lit screen with a simple picture (sky / ground split and a blob)."""
    a, b = rng.choice(SCREENS)
    p.rect(x0, y0, x1, y1, b, outline=False)
    split = y0 + (y1 - y0) * rng.uniform(0.45, 0.7)
    p.rect(x0, split, x1, y1, a, outline=False)
    if rng.random() < 0.6:
        cx, cy = x0 + (x1 - x0) * rng.uniform(0.25, 0.75), y0 + (y1 - y0) * rng.uniform(0.3, 0.6)
        p.ellipse(cx - 0.08, cy - 0.08, cx + 0.08, cy + 0.08, jitter((240, 230, 120), rng, 20), outline=False)


def draw_chair(p: Pen, rng: random.Random, c: RGB, variant: str) -> None:
    """Chair, front three-quarter view: backrest with slats, seat, four legs."""
    legc = shade(c, 0.7)
    for x, y1 in ((0.12, 1.0), (0.8, 1.0), (0.22, 0.9), (0.7, 0.9)):
        p.rect(x, 0.55, x + 0.08, y1, legc)
    p.rect(0.18, 0.0, 0.82, 0.12, c, radius=0.05)
    for x in (0.2, 0.74):
        p.rect(x, 0.05, x + 0.07, 0.55, c)
    if rng.random() < 0.5:
        for x in (0.38, 0.56):
            p.rect(x, 0.1, x + 0.06, 0.5, shade(c, 0.9), outline=False)
    else:
        p.rect(0.26, 0.14, 0.74, 0.48, shade(c, 1.1))
    p.poly([(0.15, 0.5), (0.85, 0.5), (0.95, 0.64), (0.05, 0.64)], shade(c, 1.15))


def draw_couch(p: Pen, rng: random.Random, c: RGB, variant: str) -> None:
    """Couch / sofa: tall back, two or three seat cushions, rounded arms, short legs, pillows."""
    dark = shade(c, 0.75)
    for x in (0.06, 0.9):
        p.rect(x, 0.88, x + 0.04, 1.0, (50, 35, 25), outline=False)
    p.rect(0.04, 0.08, 0.96, 0.6, c, radius=0.12)
    n = rng.randint(2, 3)
    for i in range(n):
        x0 = 0.14 + i * 0.72 / n
        p.rect(x0, 0.5, x0 + 0.72 / n, 0.76, shade(c, 1.08), radius=0.08)
    p.rect(0.08, 0.72, 0.92, 0.9, dark)
    p.rect(0.0, 0.32, 0.16, 0.9, dark, radius=0.2)
    p.rect(0.84, 0.32, 1.0, 0.9, dark, radius=0.2)
    if rng.random() < 0.6:
        col = rng.choice(((230, 200, 60), (220, 220, 215), (200, 60, 60), (60, 110, 180)))
        p.rect(0.18, 0.3, 0.34, 0.52, col, radius=0.1)
        if rng.random() < 0.5:
            p.rect(0.66, 0.3, 0.82, 0.52, col, radius=0.1)


def draw_bed(p: Pen, rng: random.Random, c: RGB, variant: str) -> None:
    """Bed: wooden headboard, mattress, pillow and a blanket in the main colour."""
    wood = jitter(rng.choice(((110, 70, 40), (70, 45, 30), (220, 215, 205))), rng, 10)
    p.rect(0.0, 0.0, 0.14, 1.0, wood, radius=0.03)
    p.rect(0.93, 0.42, 1.0, 1.0, wood)
    p.rect(0.12, 0.45, 0.97, 0.72, (245, 245, 240))
    p.ellipse(0.15, 0.3, 0.4, 0.5, (250, 250, 250))
    p.poly([(0.36, 0.36), (0.97, 0.38), (0.97, 0.8), (0.34, 0.78)], c)
    if rng.random() < 0.5:
        p.stripes(0.36, 0.38, 0.97, 0.78, 3, shade(c, 0.7), vertical=True, width=0.02)
    p.rect(0.12, 0.72, 0.97, 0.86, wood)


def draw_dining_table(p: Pen, rng: random.Random, c: RGB, variant: str) -> None:
    """Dining table in perspective: table top, front edge, four legs; maybe a tablecloth."""
    legc = shade(c, 0.7)
    for x in (0.06, 0.86):
        p.rect(x, 0.38, x + 0.08, 1.0, legc)
    for x in (0.18, 0.76):
        p.rect(x, 0.38, x + 0.06, 0.8, shade(legc, 0.8))
    p.poly([(0.1, 0.0), (0.9, 0.0), (1.0, 0.32), (0.0, 0.32)], c)
    p.rect(0.0, 0.3, 1.0, 0.4, shade(c, 0.8))
    if rng.random() < 0.35:
        cloth = rng.choice(((240, 240, 235), (200, 50, 50), (70, 110, 190)))
        p.poly([(0.12, 0.02), (0.88, 0.02), (0.97, 0.3), (0.03, 0.3)], cloth, outline=False)
        p.rect(0.02, 0.3, 0.98, 0.5, shade(cloth, 0.9), outline=False)
    else:
        p.stripes(0.1, 0.02, 0.9, 0.3, 2, shade(c, 0.85), width=0.01)


def draw_tv(p: Pen, rng: random.Random, c: RGB, variant: str) -> None:
    """Television / monitor: thin frame (main colour), lit screen, stand and foot."""
    p.rect(0.38, 0.8, 0.62, 0.92, (60, 60, 60))
    p.rect(0.2, 0.9, 0.8, 1.0, (50, 50, 55), radius=0.03)
    p.rect(0.0, 0.0, 1.0, 0.84, c)
    _screen(p, rng, 0.05, 0.06, 0.95, 0.76)
    p.circle(0.92, 0.8, 0.02, (60, 200, 80), outline=False)


def draw_laptop(p: Pen, rng: random.Random, c: RGB, variant: str) -> None:
    """Open laptop: lid with a screen, keyboard base in perspective and a touchpad."""
    p.rect(0.12, 0.0, 0.88, 0.58, c, radius=0.03)
    _screen(p, rng, 0.16, 0.04, 0.84, 0.53)
    p.poly([(0.12, 0.58), (0.88, 0.58), (1.0, 0.94), (0.0, 0.94)], shade(c, 0.9))
    p.rect(0.02, 0.93, 0.98, 1.0, shade(c, 0.6))
    keys = shade(c, 0.55) if sum(c) > 250 else shade(c, 1.6)
    for r in range(3):
        y = 0.62 + r * 0.075
        inset = 0.1 - r * 0.03
        p.line([(0.12 + inset - 0.02, y + 0.03), (0.88 - inset + 0.02, y + 0.03)], keys, 0.05)
    p.poly([(0.42, 0.85), (0.58, 0.85), (0.6, 0.92), (0.4, 0.92)], shade(c, 0.75), outline=False)


def draw_keyboard(p: Pen, rng: random.Random, c: RGB, variant: str) -> None:
    """Computer keyboard: long rounded base with a grid of keys and a space bar."""
    p.rect(0.0, 0.0, 1.0, 1.0, c, radius=0.1)
    key = shade(c, 1.5) if sum(c) < 300 else shade(c, 0.75)
    cols = rng.randint(11, 14)
    for r in range(4):
        y0 = 0.1 + r * 0.2
        for k in range(cols):
            x0 = 0.04 + k * 0.92 / cols
            if r == 3 and 3 <= k < cols - 3:
                continue
            p.rect(x0, y0, x0 + 0.92 / cols - 0.012, y0 + 0.15, key, outline=False)
    p.rect(0.04 + 3 * 0.92 / cols, 0.7, 0.04 + (cols - 3) * 0.92 / cols - 0.012, 0.85, key, outline=False)


def draw_mouse(p: Pen, rng: random.Random, c: RGB, variant: str) -> None:
    """Computer mouse seen from above: egg-shaped body, two buttons, scroll wheel, maybe a cable."""
    if rng.random() < 0.4:
        p.line([(0.5, 0.1), (0.55, 0.0)], (40, 40, 40), 0.06)
    p.ellipse(0.02, 0.05, 0.98, 1.0, c)
    p.line([(0.5, 0.07), (0.5, 0.42)], shade(c, 0.55), 0.03)
    p.line([(0.08, 0.42), (0.92, 0.42)], shade(c, 0.75), 0.03)
    p.rect(0.44, 0.15, 0.56, 0.32, (50, 50, 55), outline=False, radius=0.2)


def draw_remote(p: Pen, rng: random.Random, c: RGB, variant: str) -> None:
    """Remote control: long slab, red power button, d-pad and rows of small buttons."""
    p.rect(0.0, 0.0, 1.0, 1.0, c, radius=0.35)
    p.circle(0.5, 0.08, 0.18, (210, 40, 40), outline=False)
    btn = shade(c, 1.8) if sum(c) < 300 else shade(c, 0.6)
    p.circle(0.5, 0.3, 0.3, btn)
    p.circle(0.5, 0.3, 0.12, shade(btn, 0.7), outline=False)
    for r in range(4):
        for k in range(3):
            p.circle(0.2 + k * 0.3, 0.5 + r * 0.1, 0.1, btn, outline=False)


def draw_cell_phone(p: Pen, rng: random.Random, c: RGB, variant: str) -> None:
    """Cell phone: rounded body (main colour), bright screen with app icons, maybe a home button."""
    p.rect(0.0, 0.0, 1.0, 1.0, c, radius=0.15)
    bottom = 0.86 if rng.random() < 0.5 else 0.94
    a, b = rng.choice(SCREENS)
    p.rect(0.08, 0.07, 0.92, bottom, mix(a, b, 0.5), outline=False)
    for r in range(4):
        for k in range(3):
            p.rect(
                0.16 + k * 0.26,
                0.14 + r * 0.15,
                0.32 + k * 0.26,
                0.22 + r * 0.15,
                jitter((235, 235, 235), rng, 40),
                outline=False,
            )
    if bottom < 0.9:
        p.circle(0.5, 0.93, 0.08, shade(c, 0.6))


def draw_book(p: Pen, rng: random.Random, c: RGB, variant: str) -> None:
    """Book: standing cover with a spine and title lines, or a small stack of books."""
    if variant == "stack":
        n = 3
        cols = [c] + [
            jitter(rng.choice(((60, 90, 170), (170, 50, 50), (60, 130, 70), (220, 190, 60))), rng, 20)
            for _ in range(n - 1)
        ]
        for i in range(n):
            y0 = 1.0 - (i + 1) / n
            sh = rng.uniform(-0.06, 0.06)
            p.rect(0.04 + sh, y0 + 0.02, 0.96 + sh, y0 + 1 / n, cols[n - 1 - i])
            p.rect(0.8 + sh, y0 + 0.06, 0.93 + sh, y0 + 1 / n - 0.04, (245, 240, 225), outline=False)
        return
    p.rect(0.1, 0.02, 1.0, 1.0, (245, 240, 225))
    p.rect(0.0, 0.0, 0.92, 0.98, c)
    p.rect(0.0, 0.0, 0.12, 0.98, shade(c, 0.7), outline=False)
    light = shade(c, 1.6) if sum(c) < 450 else shade(c, 0.5)
    p.line([(0.25, 0.22), (0.8, 0.22)], light, 0.08)
    p.line([(0.3, 0.34), (0.75, 0.34)], light, 0.05)
    if rng.random() < 0.5:
        p.rect(0.3, 0.5, 0.75, 0.8, light, outline=False)
