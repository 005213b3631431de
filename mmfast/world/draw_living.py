"""Drawing routines for people, animals and other living or soft things.

Each routine has the signature ``draw_x(p, rng, c, variant)``: ``p`` is a :class:`~.draw_base.Pen`
in unit coordinates, ``rng`` a :class:`random.Random` for intra-class variation, ``c`` the
instance's main colour (already jittered) and ``variant`` a category-specific sub-type (for people:
``"man"``, ``"woman"`` or ``"child"``). Animals face right; the renderer flips half of them.

Cats and dogs share the same quadruped skeleton on purpose (a known confusable pair): the cat has
pointed ears, a long raised tail, a short face and whiskers; the dog has floppy ears, a muzzle and
a short tail.
"""

from __future__ import annotations

import math
import random

from .draw_base import RGB, Pen, jitter, mix, shade

SKIN: tuple[RGB, ...] = ((241, 200, 160), (224, 172, 125), (190, 135, 90), (140, 95, 60), (95, 62, 40))
HAIR: tuple[RGB, ...] = ((30, 24, 20), (70, 45, 25), (120, 80, 40), (200, 170, 90), (150, 60, 30))
TROUSERS: tuple[RGB, ...] = ((40, 60, 110), (35, 35, 40), (90, 90, 95), (110, 90, 60))


def draw_person(p: Pen, rng: random.Random, c: RGB, variant: str) -> None:
    """Standing person: head, hair, shirt (main colour), arms, trousers or dress, shoes."""
    skin = jitter(rng.choice(SKIN), rng, 8)
    hair = rng.choice(HAIR)
    child = variant == "child"
    hr = 0.3 if child else 0.24  # head radius, fraction of width
    hy = 0.13 if child else 0.1
    hr_y = hr * p.w / p.h  # head radius in unit y
    top = hy + hr_y * 0.9
    # arms (behind torso)
    sway_l, sway_r = rng.uniform(-0.15, 0.25), rng.uniform(-0.15, 0.25)
    if rng.random() < 0.2:  # one arm raised (waving)
        sway_r = -0.45
    arm_w = 0.16 if not child else 0.14
    p.line([(0.3, top + 0.04), (0.14 - sway_l * 0.5, top + 0.22 + sway_l * 0.3)], shade(c, 0.85), arm_w)
    p.line([(0.7, top + 0.04), (0.86 + abs(sway_r) * 0.3, top + 0.22 + sway_r * 0.35)], shade(c, 0.85), arm_w)
    p.circle(0.14 - sway_l * 0.5, top + 0.23 + sway_l * 0.3, 0.07, skin, outline=False)
    p.circle(0.86 + abs(sway_r) * 0.3, top + 0.23 + sway_r * 0.35, 0.07, skin, outline=False)
    hip = top + (0.26 if child else 0.33)
    if variant == "woman" and rng.random() < 0.65:
        # dress / skirt, legs below
        p.poly([(0.3, top), (0.7, top), (0.84, hip + 0.2), (0.16, hip + 0.2)], c)
        for lx in (0.36, 0.56):
            p.rect(lx, hip + 0.2, lx + 0.09, 0.95, skin, outline=False)
    else:
        trousers = rng.choice(TROUSERS)
        p.rect(0.3, top, 0.7, hip + 0.02, c, radius=0.15)
        p.rect(0.31, hip, 0.49, 0.95, trousers)
        p.rect(0.51, hip, 0.69, 0.95, trousers)
    shoe = (30, 30, 30) if rng.random() < 0.7 else (235, 235, 235)
    p.ellipse(0.26, 0.93, 0.5, 1.0, shoe, outline=False)
    p.ellipse(0.5, 0.93, 0.74, 1.0, shoe, outline=False)
    # neck + head + hair
    p.rect(0.44, hy, 0.56, top + 0.02, skin, outline=False)
    if variant == "woman":
        p.ellipse(0.5 - hr * 1.25, hy - hr_y * 1.1, 0.5 + hr * 1.25, hy + 0.13, hair, outline=False)
    p.circle(0.5, hy, hr, skin)
    p.chord(0.5 - hr * 1.08, hy - hr_y * 1.12, 0.5 + hr * 1.08, hy + hr_y * 0.5, 180, 360, hair, outline=False)
    p.circle(0.42, hy + 0.005, 0.035, (25, 25, 25), outline=False)
    p.circle(0.58, hy + 0.005, 0.035, (25, 25, 25), outline=False)


def _quadruped(p: Pen, rng: random.Random, body: RGB, leg_w: float, long_legs: bool = False) -> None:
    """Body ellipse and four legs shared by the four-legged animals."""
    bot = 0.97
    ly = 0.58 if not long_legs else 0.55
    for lx in (0.2, 0.3, 0.58, 0.68):
        p.rect(lx, ly, lx + leg_w, bot, shade(body, 0.9 if lx in (0.3, 0.68) else 0.8))
    p.ellipse(0.13, 0.32, 0.78, 0.68 if not long_legs else 0.62, body)


def draw_dog(p: Pen, rng: random.Random, c: RGB, variant: str) -> None:
    """Dog: body, thick legs, short raised tail, head with muzzle, floppy ears, collar."""
    tail_up = rng.uniform(-0.1, 0.15)
    p.line([(0.16, 0.42), (0.04, 0.22 + tail_up)], shade(c, 0.9), 0.09)
    _quadruped(p, rng, c, 0.1)
    if rng.random() < 0.5:  # patches
        p.spots(rng, 0.25, 0.38, 0.65, 0.6, rng.randint(1, 3), shade(c, 0.55) if c[0] > 90 else (235, 235, 230), 0.12)
    p.rect(0.66, 0.22, 0.82, 0.5, c, outline=False)  # neck
    p.circle(0.8, 0.26, 0.17, c)
    p.rect(0.84, 0.24, 0.99, 0.38, shade(c, 1.15), radius=0.06)  # muzzle
    p.circle(0.97, 0.27, 0.035, (20, 20, 20), outline=False)
    p.circle(0.82, 0.2, 0.03, (20, 20, 20), outline=False)
    ear = shade(c, 0.6)
    p.ellipse(0.68, 0.12, 0.77, 0.4, ear)
    if rng.random() < 0.6:
        p.line([(0.7, 0.38), (0.76, 0.46)], rng.choice(((200, 30, 30), (30, 60, 200), (40, 140, 60))), 0.05)


def draw_cat(p: Pen, rng: random.Random, c: RGB, variant: str) -> None:
    """Cat: slim body, thin legs, long curled tail, round face, pointed ears, whiskers, stripes."""
    curl = rng.uniform(0.0, 0.12)
    p.line([(0.17, 0.48), (0.06, 0.36), (0.04, 0.15), (0.1 + curl, 0.04)], shade(c, 0.9), 0.06)
    _quadruped(p, rng, c, 0.065)
    if rng.random() < 0.55:  # tabby stripes
        for x in (0.3, 0.4, 0.5, 0.6):
            p.line([(x, 0.35), (x - 0.03, 0.5)], shade(c, 0.55), 0.04)
    p.circle(0.8, 0.32, 0.15, c)
    p.poly([(0.69, 0.26), (0.72, 0.04), (0.79, 0.2)], c)
    p.poly([(0.81, 0.2), (0.88, 0.04), (0.91, 0.26)], c)
    p.poly([(0.71, 0.22), (0.725, 0.1), (0.76, 0.2)], (230, 150, 160), outline=False)
    eye = rng.choice(((80, 170, 60), (220, 190, 40), (60, 140, 200)))
    p.circle(0.76, 0.3, 0.03, eye, outline=False)
    p.circle(0.86, 0.3, 0.03, eye, outline=False)
    p.circle(0.82, 0.37, 0.018, (220, 120, 130), outline=False)
    wh = (235, 235, 235) if sum(c) < 300 else (50, 50, 50)
    for dy in (-0.02, 0.02):
        p.line([(0.84, 0.38), (0.99, 0.36 + dy * 2)], wh, 0.012)
        p.line([(0.78, 0.38), (0.66, 0.36 + dy * 2)], wh, 0.012)


def draw_horse(p: Pen, rng: random.Random, c: RGB, variant: str) -> None:
    """Horse: long legs, long neck, elongated head, mane and tail."""
    mane = shade(c, 0.45) if rng.random() < 0.7 else (235, 230, 220)
    p.line([(0.15, 0.36), (0.07, 0.55), (0.08, 0.75)], mane, 0.08)
    _quadruped(p, rng, c, 0.07, long_legs=True)
    for lx in (0.2, 0.3, 0.58, 0.68):
        p.rect(lx, 0.92, lx + 0.07, 0.99, (40, 35, 30), outline=False)
    p.poly([(0.62, 0.42), (0.74, 0.1), (0.84, 0.1), (0.78, 0.5)], c)  # neck
    p.poly([(0.74, 0.06), (0.86, 0.02), (0.99, 0.24), (0.94, 0.3), (0.76, 0.18)], c)  # head
    p.line([(0.73, 0.08), (0.64, 0.38)], mane, 0.05)
    p.poly([(0.77, 0.05), (0.79, -0.0), (0.81, 0.05)], c)
    p.circle(0.85, 0.1, 0.02, (20, 20, 20), outline=False)


def draw_bird(p: Pen, rng: random.Random, c: RGB, variant: str) -> None:
    """Bird: oval body, round head, beak, darker wing, tail and thin legs."""
    flying = rng.random() < 0.3
    legc = (200, 140, 60)
    if not flying:
        p.line([(0.42, 0.7), (0.4, 0.95)], legc, 0.03)
        p.line([(0.54, 0.7), (0.56, 0.95)], legc, 0.03)
    p.poly([(0.22, 0.5), (0.0, 0.42), (0.02, 0.62)], shade(c, 0.7))
    p.ellipse(0.15, 0.35, 0.75, 0.78, c)
    belly = mix(c, (240, 235, 220), 0.5)
    p.ellipse(0.38, 0.55, 0.72, 0.76, belly, outline=False)
    p.circle(0.74, 0.33, 0.17, c)
    p.poly([(0.86, 0.28), (1.0, 0.36), (0.86, 0.4)], (230, 170, 40))
    p.circle(0.78, 0.29, 0.035, (15, 15, 15), outline=False)
    wing = shade(c, 0.65)
    if flying:
        p.poly([(0.3, 0.45), (0.45, 0.0), (0.62, 0.48)], wing)
    else:
        p.ellipse(0.24, 0.42, 0.6, 0.66, wing)


def draw_teddy_bear(p: Pen, rng: random.Random, c: RGB, variant: str) -> None:
    """Sitting teddy bear seen from the front: round head and ears, muzzle, arms, feet pads."""
    light = shade(c, 1.35)
    p.circle(0.27, 0.1, 0.11, c)
    p.circle(0.73, 0.1, 0.11, c)
    p.circle(0.27, 0.1, 0.05, light, outline=False)
    p.circle(0.73, 0.1, 0.05, light, outline=False)
    p.ellipse(0.2, 0.38, 0.8, 0.92, c)
    p.ellipse(0.33, 0.5, 0.67, 0.85, light, outline=False)
    p.ellipse(0.04, 0.42, 0.28, 0.68, c)
    p.ellipse(0.72, 0.42, 0.96, 0.68, c)
    for x0 in (0.12, 0.58):
        p.ellipse(x0, 0.76, x0 + 0.3, 1.0, c)
        p.ellipse(x0 + 0.07, 0.82, x0 + 0.23, 0.97, light, outline=False)
    p.circle(0.5, 0.24, 0.25, c)
    p.ellipse(0.38, 0.26, 0.62, 0.4, light, outline=False)
    p.circle(0.5, 0.29, 0.04, (30, 20, 15), outline=False)
    p.circle(0.41, 0.19, 0.035, (15, 15, 15), outline=False)
    p.circle(0.59, 0.19, 0.035, (15, 15, 15), outline=False)
    if rng.random() < 0.5:  # ribbon
        p.line([(0.38, 0.44), (0.62, 0.44)], rng.choice(((200, 30, 40), (40, 80, 200), (240, 200, 40))), 0.05)


def draw_potted_plant(p: Pen, rng: random.Random, c: RGB, variant: str) -> None:
    """Potted plant: pot (main colour) with rim, and a fan of green leaves."""
    greens = ((40, 130, 50), (70, 160, 60), (30, 100, 45), (100, 170, 70))
    n = rng.randint(5, 9)
    base_x, base_y = 0.5, 0.6
    for i in range(n):
        a = math.radians(-75 + 150 * (i + rng.uniform(0.2, 0.8)) / n)
        ln = rng.uniform(0.4, 0.6)
        tip = (base_x + 0.48 * math.sin(a) * ln / 0.6, base_y - ln * math.cos(a) * 0.98)
        mid = ((base_x + tip[0]) / 2, (base_y + tip[1]) / 2)
        nx, ny = math.cos(a) * 0.07, math.sin(a) * 0.04
        col = jitter(rng.choice(greens), rng, 10)
        leaf = [(base_x, base_y), (mid[0] - nx, mid[1] - ny), tip, (mid[0] + nx, mid[1] + ny)]
        p.poly(leaf, col, outline=shade(col, 0.6))
    p.poly([(0.2, 0.6), (0.8, 0.6), (0.7, 1.0), (0.3, 1.0)], c)
    p.rect(0.16, 0.56, 0.84, 0.66, shade(c, 0.85))
    if rng.random() < 0.4:
        p.line([(0.25, 0.8), (0.75, 0.8)], shade(c, 1.4), 0.04)
