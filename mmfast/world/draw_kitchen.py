"""Drawing routines for tableware, food and kitchen appliances.

Same signature as every drawing routine: ``draw_x(p, rng, c, variant)`` (see
:mod:`mmfast.world.draw_living`). Deliberately confusable groups at small sizes:
cup / bowl / wine glass (all round containers), fork / knife / spoon (thin metal bars),
apple / orange / sports ball (round things), microwave / tv (dark window in a box).
"""

from __future__ import annotations

import math
import random

from .draw_base import RGB, Pen, jitter, mix, shade

CLEAR = (0, 0, 0, 0)
METAL: RGB = (175, 178, 184)
GLASS: RGB = (205, 225, 235)


def draw_bottle(p: Pen, rng: random.Random, c: RGB, variant: str) -> None:
    """Bottle: body, shoulders, neck, cap and a paper label."""
    p.poly([(0.12, 0.4), (0.38, 0.22), (0.62, 0.22), (0.88, 0.4)], c)
    p.rect(0.12, 0.38, 0.88, 1.0, c, radius=0.12)
    p.rect(0.36, 0.06, 0.64, 0.26, c)
    p.rect(0.32, 0.0, 0.68, 0.09, rng.choice(((200, 30, 30), (230, 200, 40), (240, 240, 240), (30, 30, 30))))
    p.rect(0.12, 0.55, 0.88, 0.8, jitter((235, 230, 215), rng, 15), outline=False)
    p.line([(0.25, 0.64), (0.75, 0.64)], shade(c, 0.6), 0.06)
    p.line([(0.24, 0.42), (0.24, 0.52)], shade(c, 1.5), 0.06)


def draw_wine_glass(p: Pen, rng: random.Random, c: RGB, variant: str) -> None:
    """Wine glass: round bowl (maybe with wine), thin stem, flat foot."""
    p.ellipse(0.15, 0.9, 0.85, 1.0, GLASS, outline=(120, 130, 140))
    p.line([(0.5, 0.5), (0.5, 0.94)], shade(GLASS, 0.8), 0.08)
    p.chord(0.02, -0.45, 0.98, 0.55, 0, 180, GLASS, outline=(120, 130, 140))
    p.rect(0.02, 0.0, 0.98, 0.05, GLASS, outline=False)
    if rng.random() < 0.75:
        wine = rng.choice(((120, 20, 40), (150, 30, 50), (235, 215, 130)))
        p.chord(0.06, -0.41, 0.94, 0.51, 10, 170, wine, outline=False)
    p.line([(0.2, 0.1), (0.22, 0.3)], (250, 250, 250), 0.05)


def draw_cup(p: Pen, rng: random.Random, c: RGB, variant: str) -> None:
    """Mug (or teacup on a saucer): body, handle ring, rim with a dark drink."""
    saucer = rng.random() < 0.3
    if saucer:
        p.ellipse(0.0, 0.82, 1.0, 1.0, shade(c, 1.2))
    bot = 0.9 if saucer else 1.0
    p.ellipse(0.6, 0.3, 0.98, 0.78, None, outline=shade(c, 0.8), width=0.12)
    p.rect(0.08, 0.12, 0.76, bot, c, radius=0.08)
    p.ellipse(0.08, 0.04, 0.76, 0.22, shade(c, 0.85))
    p.ellipse(0.13, 0.07, 0.71, 0.19, rng.choice(((90, 55, 30), (60, 35, 20), (200, 160, 110))), outline=False)
    if rng.random() < 0.35:
        p.line([(0.1, 0.55), (0.74, 0.55)], shade(c, 0.6) if sum(c) > 300 else shade(c, 1.6), 0.08)


def draw_bowl(p: Pen, rng: random.Random, c: RGB, variant: str) -> None:
    """Bowl: wide rim ellipse with a shaded inside, deep lower half, small foot; maybe contents."""
    p.rect(0.32, 0.86, 0.68, 1.0, shade(c, 0.7))
    p.chord(0.0, -0.6, 1.0, 0.94, 0, 180, c)
    p.ellipse(0.0, 0.0, 1.0, 0.36, shade(c, 1.15))
    p.ellipse(0.06, 0.05, 0.94, 0.31, shade(c, 0.75), outline=False)
    if rng.random() < 0.5:
        food = rng.choice(((230, 200, 120), (200, 60, 40), (90, 150, 60), (245, 240, 225)))
        p.ellipse(0.1, 0.07, 0.9, 0.29, food, outline=False)
        p.spots(rng, 0.2, 0.1, 0.8, 0.26, 4, shade(food, 0.7), 0.05)


def draw_fork(p: Pen, rng: random.Random, c: RGB, variant: str) -> None:
    """Fork (vertical): handle, head and four tines."""
    p.rect(0.3, 0.45, 0.7, 1.0, c, radius=0.3)
    p.poly([(0.06, 0.28), (0.94, 0.28), (0.75, 0.46), (0.25, 0.46)], c)
    for x in (0.06, 0.3, 0.54, 0.78):
        p.rect(x, 0.0, x + 0.16, 0.3, c, outline=False)


def draw_knife(p: Pen, rng: random.Random, c: RGB, variant: str) -> None:
    """Knife (vertical): metal blade with a curved edge, handle in the main colour."""
    p.poly([(0.22, 0.6), (0.22, 0.04), (0.4, 0.0), (0.75, 0.2), (0.78, 0.6)], METAL)
    p.line([(0.3, 0.1), (0.3, 0.55)], (230, 232, 236), 0.12)
    p.rect(0.15, 0.58, 0.85, 1.0, c, radius=0.3)
    p.circle(0.5, 0.72, 0.1, METAL, outline=False)
    p.circle(0.5, 0.88, 0.1, METAL, outline=False)


def draw_spoon(p: Pen, rng: random.Random, c: RGB, variant: str) -> None:
    """Spoon (vertical): oval bowl on top of a thin handle."""
    p.rect(0.36, 0.26, 0.64, 1.0, c, radius=0.3)
    p.ellipse(0.02, 0.0, 0.98, 0.34, c)
    p.ellipse(0.18, 0.05, 0.82, 0.27, shade(c, 0.85), outline=False)


def draw_banana(p: Pen, rng: random.Random, c: RGB, variant: str) -> None:
    """Banana: a curved crescent with brown tips; sometimes a bunch of two."""
    n = 2 if rng.random() < 0.35 else 1
    for k in range(n):
        dy = k * 0.22
        outer = [
            (0.5 + 0.5 * math.cos(a), -0.2 + dy + 0.95 * math.sin(a))
            for a in (math.radians(t) for t in range(15, 166, 10))
        ]
        inner = [
            (0.5 + 0.4 * math.cos(a), -0.2 + dy + 0.62 * math.sin(a))
            for a in (math.radians(t) for t in range(165, 14, -10))
        ]
        col = shade(c, 1.0 - 0.12 * k)
        p.poly(outer + inner, col, outline=shade(c, 0.6))
        p.circle(outer[0][0], outer[0][1] - 0.02, 0.06, (90, 60, 30), outline=False)
        p.circle(outer[-1][0], outer[-1][1] - 0.02, 0.05, (90, 60, 30), outline=False)


def draw_apple(p: Pen, rng: random.Random, c: RGB, variant: str) -> None:
    """Apple: two-lobed round body, stem, leaf and a highlight."""
    p.circle(0.38, 0.58, 0.36, c)
    p.circle(0.62, 0.58, 0.36, c)
    p.ellipse(0.2, 0.3, 0.8, 0.95, c, outline=False)
    p.line([(0.5, 0.3), (0.54, 0.05)], (90, 60, 30), 0.05)
    if rng.random() < 0.7:
        p.ellipse(0.55, 0.06, 0.85, 0.2, (60, 150, 50))
    p.circle(0.32, 0.48, 0.08, shade(c, 1.45), outline=False)


def draw_orange(p: Pen, rng: random.Random, c: RGB, variant: str) -> None:
    """Orange: round, dimpled peel, small navel, maybe a leaf; or cut in half."""
    col = jitter((236, 138, 28), rng, 10)
    if rng.random() < 0.25:
        p.circle(0.5, 0.5, 0.49, col)
        p.circle(0.5, 0.5, 0.42, (250, 190, 80), outline=False)
        for k in range(8):
            a = math.radians(45 * k)
            p.line([(0.5, 0.5), (0.5 + 0.4 * math.cos(a), 0.5 + 0.4 * math.sin(a))], (252, 230, 170), 0.03)
        return
    p.circle(0.5, 0.52, 0.47, col)
    p.spots(rng, 0.2, 0.25, 0.8, 0.85, 8, shade(col, 0.85), 0.03)
    p.circle(0.5, 0.1, 0.04, (90, 110, 40), outline=False)
    p.circle(0.35, 0.38, 0.07, shade(col, 1.3), outline=False)
    if rng.random() < 0.4:
        p.ellipse(0.52, 0.0, 0.8, 0.12, (60, 140, 50))


def draw_pizza(p: Pen, rng: random.Random, c: RGB, variant: str) -> None:
    """Pizza seen at an angle: crust, cheese, slice cuts, pepperoni / pepper / olive toppings."""
    crust = jitter((200, 140, 70), rng, 12)
    cheese = jitter((245, 200, 90), rng, 12)
    p.ellipse(0.0, 0.0, 1.0, 1.0, crust)
    p.ellipse(0.07, 0.07, 0.93, 0.93, cheese, outline=False)
    p.spots(rng, 0.2, 0.2, 0.8, 0.8, rng.randint(5, 9), (185, 45, 35), 0.07)
    if rng.random() < 0.5:
        p.spots(rng, 0.2, 0.2, 0.8, 0.8, 5, (50, 130, 50), 0.03)
    if rng.random() < 0.4:
        p.spots(rng, 0.2, 0.2, 0.8, 0.8, 5, (30, 30, 30), 0.025)
    k = rng.choice((6, 8))
    for i in range(k // 2):
        a = math.radians(180 * i / (k // 2) + 10)
        dx, dy = 0.47 * math.cos(a), 0.47 * math.sin(a)
        p.line([(0.5 - dx, 0.5 - dy), (0.5 + dx, 0.5 + dy)], shade(crust, 0.8), 0.02)
    if rng.random() < 0.35:  # a slice is missing
        s = rng.randrange(k) * 360 / k + 10
        p.pieslice(-0.02, -0.02, 1.02, 1.02, s, s + 360 / k, CLEAR, outline=False)  # type: ignore[arg-type]


def draw_donut(p: Pen, rng: random.Random, c: RGB, variant: str) -> None:
    """Donut: dough ring, wavy icing in the main colour, sprinkles, a hole."""
    dough = jitter((205, 150, 85), rng, 10)
    p.ellipse(0.0, 0.05, 1.0, 1.0, dough)
    p.ellipse(0.05, 0.05, 0.95, 0.88, c, outline=False)
    if rng.random() < 0.7:
        for _ in range(12):
            x, y = rng.uniform(0.12, 0.88), rng.uniform(0.12, 0.8)
            if (x - 0.5) ** 2 + (y - 0.47) ** 2 < 0.03 or (x - 0.5) ** 2 / 0.16 + (y - 0.47) ** 2 / 0.14 > 1:
                continue
            col = rng.choice(((240, 60, 60), (60, 120, 240), (250, 230, 60), (250, 250, 250), (60, 200, 90)))
            p.line([(x, y), (x + 0.05, y + rng.uniform(-0.03, 0.03))], col, 0.035)
    p.ellipse(0.36, 0.35, 0.64, 0.6, CLEAR, outline=shade(dough, 0.7))  # type: ignore[arg-type]


def draw_microwave(p: Pen, rng: random.Random, c: RGB, variant: str) -> None:
    """Microwave: box in the main colour, dark door window, handle and a button panel."""
    p.rect(0.0, 0.0, 1.0, 0.94, c, radius=0.04)
    p.rect(0.05, 0.94, 0.15, 1.0, (40, 40, 40), outline=False)
    p.rect(0.85, 0.94, 0.95, 1.0, (40, 40, 40), outline=False)
    p.rect(0.06, 0.1, 0.66, 0.84, (35, 35, 40))
    p.line([(0.15, 0.2), (0.3, 0.2)], (90, 90, 100), 0.04)
    p.rect(0.68, 0.1, 0.7, 0.84, shade(c, 0.6), outline=False)
    p.rect(0.74, 0.1, 0.94, 0.24, (40, 60, 50))
    for r in range(3):
        for k in range(2):
            p.circle(0.79 + k * 0.1, 0.36 + r * 0.14, 0.05, shade(c, 0.7), outline=False)


def draw_sink(p: Pen, rng: random.Random, c: RGB, variant: str) -> None:
    """Kitchen sink: counter slab, sunken basin, gooseneck faucet with two taps."""
    p.rect(0.0, 0.3, 1.0, 1.0, c)
    p.ellipse(0.1, 0.42, 0.9, 0.92, shade(c, 0.65))
    p.ellipse(0.16, 0.46, 0.84, 0.84, shade(c, 0.8), outline=False)
    p.circle(0.5, 0.7, 0.04, (40, 40, 40), outline=False)
    p.line([(0.5, 0.38), (0.5, 0.08), (0.62, 0.05), (0.66, 0.2)], METAL, 0.05)
    p.circle(0.38, 0.35, 0.05, METAL)
    p.circle(0.62, 0.35, 0.05, METAL)


def draw_refrigerator(p: Pen, rng: random.Random, c: RGB, variant: str) -> None:
    """Refrigerator: tall box, freezer door on top, long handles, maybe magnets / notes."""
    p.rect(0.0, 0.0, 1.0, 1.0, c, radius=0.06)
    split = rng.uniform(0.3, 0.4)
    p.line([(0.02, split), (0.98, split)], shade(c, 0.55), 0.03)
    hx = 0.82 if rng.random() < 0.5 else 0.12
    p.rect(hx, split - 0.2, hx + 0.06, split - 0.05, METAL)
    p.rect(hx, split + 0.05, hx + 0.06, split + 0.35, METAL)
    for _ in range(rng.randint(0, 3)):
        x, y = rng.uniform(0.25, 0.65), rng.uniform(split + 0.1, 0.8)
        p.rect(x, y, x + 0.14, y + 0.08, jitter((240, 220, 120), rng, 40), outline=False)
    p.rect(0.05, 0.97, 0.95, 1.0, (40, 40, 40), outline=False)


def draw_vase(p: Pen, rng: random.Random, c: RGB, variant: str) -> None:
    """Vase: curved profile with a narrow neck, patterned band; sometimes flowers."""
    top = 0.0
    if rng.random() < 0.5:
        top = 0.35
        for _k in range(rng.randint(3, 5)):
            x = 0.5 + rng.uniform(-0.35, 0.35)
            y = rng.uniform(0.05, 0.25)
            p.line([(0.5, 0.45), (x, y)], (50, 130, 50), 0.04)
            p.circle(x, y, 0.1, jitter(mix((240, 80, 120), (250, 240, 90), rng.random()), rng, 30))
    h = 1.0 - top
    prof = [(0.36, 0.0), (0.3, 0.12), (0.08, 0.45), (0.12, 0.82), (0.3, 1.0)]
    pts = [(x, top + y * h) for x, y in prof] + [(1 - x, top + y * h) for x, y in reversed(prof)]
    p.poly(pts, c)
    p.rect(0.3, top, 0.7, top + 0.04 * h, shade(c, 0.8))
    band = shade(c, 1.4) if sum(c) < 450 else shade(c, 0.6)
    p.line([(0.1, top + 0.55 * h), (0.9, top + 0.55 * h)], band, 0.06)
    if rng.random() < 0.5:
        p.line([(0.1, top + 0.68 * h), (0.9, top + 0.68 * h)], band, 0.04)


def draw_clock(p: Pen, rng: random.Random, c: RGB, variant: str) -> None:
    """Wall clock: rim in the main colour, light face, twelve ticks, two hands."""
    face = jitter((245, 242, 230), rng, 8)
    p.circle(0.5, 0.5, 0.49, c)
    p.circle(0.5, 0.5, 0.41, face, outline=False)
    for k in range(12):
        a = math.radians(30 * k)
        r0 = 0.3 if k % 3 else 0.26
        p.line(
            [(0.5 + r0 * math.cos(a), 0.5 + r0 * math.sin(a)), (0.5 + 0.37 * math.cos(a), 0.5 + 0.37 * math.sin(a))],
            (30, 30, 30),
            0.03 if k % 3 else 0.05,
        )
    h, m = math.radians(rng.uniform(0, 360)), math.radians(rng.uniform(0, 360))
    p.line([(0.5, 0.5), (0.5 + 0.2 * math.sin(h), 0.5 - 0.2 * math.cos(h))], (20, 20, 20), 0.06)
    p.line([(0.5, 0.5), (0.5 + 0.32 * math.sin(m), 0.5 - 0.32 * math.cos(m))], (20, 20, 20), 0.035)
    p.circle(0.5, 0.5, 0.04, (180, 30, 30), outline=False)
