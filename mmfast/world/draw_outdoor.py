"""Drawing routines for vehicles, street furniture and sports / outdoor objects.

Same signature as every drawing routine: ``draw_x(p, rng, c, variant)`` (see
:mod:`mmfast.world.draw_living`). Vehicles face right; the renderer flips half of them.
Bicycle and motorcycle share wheels-and-frame geometry on purpose (a confusable pair at 12 px).
"""

from __future__ import annotations

import math
import random

from .draw_base import RGB, Pen, jitter, mix, shade

BLACK: RGB = (28, 28, 30)
GLASS: RGB = (150, 195, 225)
METAL: RGB = (165, 168, 172)


def _wheel(p: Pen, cx: float, cy: float, r: float, hub: bool = True) -> None:
    p.circle(cx, cy, r, BLACK)
    if hub:
        p.circle(cx, cy, r * 0.5, METAL)


def draw_car(p: Pen, rng: random.Random, c: RGB, variant: str) -> None:
    """Car side view: lower body, cabin with two windows, two wheels, lights."""
    roof = rng.uniform(0.05, 0.18)
    p.poly([(0.2, 0.45), (0.3, roof), (0.68, roof), (0.82, 0.45)], c)
    p.poly([(0.27, 0.43), (0.34, roof + 0.06), (0.48, roof + 0.06), (0.48, 0.43)], GLASS, outline=False)
    p.poly([(0.51, 0.43), (0.51, roof + 0.06), (0.65, roof + 0.06), (0.76, 0.43)], GLASS, outline=False)
    p.rect(0.01, 0.4, 0.99, 0.78, c, radius=0.12)
    p.line([(0.05, 0.58), (0.95, 0.58)], shade(c, 0.7), 0.02)
    p.rect(0.92, 0.46, 0.99, 0.53, (250, 230, 120), outline=False)
    p.rect(0.01, 0.46, 0.05, 0.54, (210, 30, 30), outline=False)
    _wheel(p, 0.24, 0.78, 0.22)
    _wheel(p, 0.76, 0.78, 0.22)


def draw_bus(p: Pen, rng: random.Random, c: RGB, variant: str) -> None:
    """Bus side view: long box, a row of windows, door, destination sign, wheels."""
    p.rect(0.01, 0.04, 0.99, 0.86, c, radius=0.08)
    n = rng.randint(4, 6)
    for i in range(n):
        x0 = 0.05 + i * 0.78 / n
        p.rect(x0, 0.16, x0 + 0.78 / n - 0.02, 0.45, GLASS)
    p.rect(0.86, 0.16, 0.96, 0.78, GLASS)  # door
    p.line([(0.91, 0.16), (0.91, 0.78)], shade(c, 0.6), 0.02)
    p.rect(0.3, 0.06, 0.7, 0.13, (30, 30, 30), outline=False)
    p.rect(0.32, 0.08, 0.5, 0.11, (250, 180, 40), outline=False)
    if rng.random() < 0.6:
        p.rect(0.02, 0.55, 0.84, 0.62, shade(c, 1.4), outline=False)
    _wheel(p, 0.18, 0.86, 0.14)
    _wheel(p, 0.78, 0.86, 0.14)


def draw_truck(p: Pen, rng: random.Random, c: RGB, variant: str) -> None:
    """Truck side view: tall cargo box, separate cab with window, three wheels."""
    box = mix(c, (235, 235, 235), rng.choice((0.0, 0.7)))
    p.rect(0.01, 0.02, 0.66, 0.78, box)
    p.poly([(0.68, 0.78), (0.68, 0.18), (0.86, 0.18), (0.99, 0.45), (0.99, 0.78)], c)
    p.poly([(0.72, 0.24), (0.85, 0.24), (0.94, 0.44), (0.72, 0.44)], GLASS, outline=False)
    p.rect(0.0, 0.74, 0.99, 0.8, (50, 50, 50), outline=False)
    for x in (0.16, 0.34, 0.84):
        _wheel(p, x, 0.82, 0.17)


def draw_motorcycle(p: Pen, rng: random.Random, c: RGB, variant: str) -> None:
    """Motorcycle: two thick wheels, engine block, tank (main colour), seat, fork, handlebar."""
    _wheel(p, 0.2, 0.7, 0.28)
    _wheel(p, 0.8, 0.7, 0.28)
    p.line([(0.8, 0.7), (0.7, 0.2)], METAL, 0.06)
    p.rect(0.38, 0.45, 0.6, 0.72, (80, 80, 85))
    p.poly([(0.2, 0.55), (0.4, 0.4), (0.7, 0.38), (0.66, 0.55)], shade(c, 0.8))
    p.ellipse(0.42, 0.25, 0.72, 0.47, c)
    p.rect(0.2, 0.3, 0.46, 0.38, BLACK, radius=0.05)
    p.line([(0.66, 0.14), (0.74, 0.22)], BLACK, 0.05)
    p.circle(0.76, 0.32, 0.06, (250, 230, 130))


def draw_bicycle(p: Pen, rng: random.Random, c: RGB, variant: str) -> None:
    """Bicycle: two thin spoked wheels, diamond frame (main colour), seat and handlebar."""
    r = 0.3
    for cx in (0.22, 0.78):
        p.circle(cx, 0.68, r, None, outline=BLACK, width=0.06)
        for k in range(4):
            a = k * math.pi / 4
            dx, dy = math.cos(a) * r * p.m / p.w, math.sin(a) * r * p.m / p.h
            p.line([(cx - dx, 0.68 - dy), (cx + dx, 0.68 + dy)], METAL, 0.012)
    fw = 0.05
    rear, ped, seat, head, front = (0.22, 0.68), (0.47, 0.7), (0.42, 0.3), (0.7, 0.32), (0.78, 0.68)
    for a, b in ((rear, ped), (ped, seat), (seat, rear), (ped, head), (seat, head), (head, front)):
        p.line([a, b], c, fw)
    p.line([(0.7, 0.32), (0.68, 0.18), (0.78, 0.2)], BLACK, 0.04)
    p.rect(0.33, 0.23, 0.48, 0.29, BLACK, outline=False, radius=0.03)
    p.circle(0.47, 0.7, 0.05, BLACK, outline=False)


def draw_traffic_light(p: Pen, rng: random.Random, c: RGB, variant: str) -> None:
    """Traffic light: pole, housing (main colour) with red / yellow / green lamps, one lit."""
    p.rect(0.42, 0.55, 0.58, 1.0, (90, 90, 95))
    p.rect(0.08, 0.0, 0.92, 0.6, c, radius=0.15)
    lit = rng.randrange(3)
    for i, col in enumerate(((230, 30, 30), (240, 200, 30), (40, 210, 80))):
        cy = 0.1 + i * 0.19
        p.rect(0.1, cy - 0.02, 0.9, cy - 0.005, shade(c, 0.6), outline=False)
        p.circle(0.5, cy + 0.02, 0.3, col if i == lit else shade(col, 0.35), outline=(20, 20, 20))


def draw_fire_hydrant(p: Pen, rng: random.Random, c: RGB, variant: str) -> None:
    """Fire hydrant: barrel, domed cap, side nozzles, wide base."""
    p.rect(0.05, 0.88, 0.95, 1.0, shade(c, 0.75))
    p.rect(0.0, 0.38, 1.0, 0.55, shade(c, 0.85), radius=0.1)
    p.rect(0.2, 0.25, 0.8, 0.92, c)
    p.chord(0.2, 0.08, 0.8, 0.42, 180, 360, c)
    p.rect(0.43, 0.0, 0.57, 0.12, shade(c, 0.8))
    p.rect(0.12, 0.22, 0.88, 0.28, shade(c, 0.7))
    p.circle(0.5, 0.47, 0.1, METAL)


def draw_stop_sign(p: Pen, rng: random.Random, c: RGB, variant: str) -> None:
    """Stop sign: red octagon with white border and white letter strokes, on a gray pole."""
    p.rect(0.44, 0.5, 0.56, 1.0, METAL)
    k = p.m / p.h  # octagon spans the full width
    pts = []
    for i in range(8):
        a = math.radians(22.5 + 45 * i)
        pts.append((0.5 + 0.5 * math.cos(a), 0.5 * k + 0.5 * k * math.sin(a)))
    p.poly(pts, (240, 240, 240))
    inner = [(0.5 + 0.86 * (x - 0.5), 0.5 * k + 0.86 * (y - 0.5 * k)) for x, y in pts]
    p.poly(inner, c, outline=False)
    for i in range(4):
        x = 0.18 + i * 0.17
        p.rect(x, 0.4 * k, x + 0.11, 0.6 * k, (245, 245, 245), outline=False)


def draw_bench(p: Pen, rng: random.Random, c: RGB, variant: str) -> None:
    """Park bench: two or three back slats, a seat plank, dark metal legs and arm rests."""
    legc = (40, 40, 45)
    for x in (0.08, 0.86):
        p.rect(x, 0.05, x + 0.06, 1.0, legc, outline=False)
    n = rng.randint(2, 3)
    for i in range(n):
        y = 0.08 + i * 0.14
        p.rect(0.02, y, 0.98, y + 0.1, c)
    p.poly([(0.0, 0.55), (1.0, 0.55), (0.96, 0.7), (0.04, 0.7)], shade(c, 1.1))
    p.rect(0.0, 0.7, 1.0, 0.75, shade(c, 0.7))
    p.line([(0.1, 0.74), (0.04, 1.0)], legc, 0.1)
    p.line([(0.9, 0.74), (0.96, 1.0)], legc, 0.1)


def draw_umbrella(p: Pen, rng: random.Random, c: RGB, variant: str) -> None:
    """Open umbrella: scalloped canopy with alternating panels, shaft and hooked handle."""
    p.line([(0.5, 0.3), (0.5, 0.9)], (60, 60, 60), 0.04)
    p.arc(0.5, 0.82, 0.66, 0.98, 0, 180, (60, 60, 60), 0.04)
    alt = rng.choice(((240, 240, 240), shade(c, 0.7), c))
    n = 6
    for i in range(n):
        col = c if i % 2 == 0 else alt
        p.pieslice(0.0, 0.02, 1.0, 0.7, 180 + i * 180 / n, 180 + (i + 1) * 180 / n, col, outline=shade(c, 0.5))
    for i in range(n):
        x0 = i / n
        p.chord(x0, 0.3, x0 + 1 / n, 0.42, 0, 180, (0, 0, 0, 0), outline=False)  # type: ignore[arg-type]
    p.circle(0.5, 0.03, 0.025, (60, 60, 60), outline=False)


def draw_backpack(p: Pen, rng: random.Random, c: RGB, variant: str) -> None:
    """Backpack: rounded body, top handle, front pocket with zipper, side straps."""
    p.arc(0.35, 0.0, 0.65, 0.16, 180, 360, shade(c, 0.6), 0.06)
    p.rect(0.0, 0.2, 0.12, 0.85, shade(c, 0.7), radius=0.05)
    p.rect(0.88, 0.2, 1.0, 0.85, shade(c, 0.7), radius=0.05)
    p.rect(0.08, 0.06, 0.92, 1.0, c, radius=0.3)
    p.rect(0.2, 0.55, 0.8, 0.92, shade(c, 0.85), radius=0.15)
    p.line([(0.24, 0.62), (0.76, 0.62)], (40, 40, 40), 0.025)
    p.arc(0.14, 0.12, 0.86, 0.5, 200, 340, (40, 40, 40), 0.025)
    if rng.random() < 0.5:
        p.rect(0.2, 0.3, 0.8, 0.4, jitter((230, 230, 230), rng, 20), outline=False)


def draw_frisbee(p: Pen, rng: random.Random, c: RGB, variant: str) -> None:
    """Flying disc seen at an angle: flat ellipse with an inner ring."""
    p.ellipse(0.0, 0.05, 1.0, 0.95, shade(c, 0.7))
    p.ellipse(0.0, 0.0, 1.0, 0.85, c)
    p.ellipse(0.2, 0.18, 0.8, 0.66, None, outline=shade(c, 1.3), width=0.08)


def draw_sports_ball(p: Pen, rng: random.Random, c: RGB, variant: str) -> None:
    """Ball; the variant (soccer / basketball / tennis / baseball) sets the pattern."""
    if variant == "soccer":
        p.circle(0.5, 0.5, 0.49, (240, 240, 240), outline=(40, 40, 40))
        p.circle(0.5, 0.5, 0.14, (25, 25, 25), outline=False)
        for k in range(5):
            a = math.radians(90 + 72 * k)
            p.circle(0.5 + 0.38 * math.cos(a), 0.5 - 0.38 * math.sin(a), 0.11, (25, 25, 25), outline=False)
    elif variant == "basketball":
        p.circle(0.5, 0.5, 0.49, c)
        p.line([(0.02, 0.5), (0.98, 0.5)], (30, 20, 15), 0.03)
        p.line([(0.5, 0.02), (0.5, 0.98)], (30, 20, 15), 0.03)
        p.arc(-0.3, 0.1, 0.35, 0.9, -60, 60, (30, 20, 15), 0.03)
        p.arc(0.65, 0.1, 1.3, 0.9, 120, 240, (30, 20, 15), 0.03)
    elif variant == "tennis":
        p.circle(0.5, 0.5, 0.49, c, outline=shade(c, 0.6))
        p.arc(-0.4, 0.1, 0.4, 0.9, -70, 70, (245, 245, 245), 0.06)
        p.arc(0.6, 0.1, 1.4, 0.9, 110, 250, (245, 245, 245), 0.06)
    else:  # baseball
        p.circle(0.5, 0.5, 0.49, (238, 236, 228), outline=(120, 120, 120))
        p.arc(-0.4, 0.1, 0.4, 0.9, -70, 70, (200, 30, 30), 0.04)
        p.arc(0.6, 0.1, 1.4, 0.9, 110, 250, (200, 30, 30), 0.04)
    p.circle(0.36, 0.32, 0.08, (255, 255, 255), outline=False)


def draw_kite(p: Pen, rng: random.Random, c: RGB, variant: str) -> None:
    """Diamond kite with two-colour panels, cross sticks and a wavy tail with bows."""
    other = rng.choice(((240, 240, 240), (240, 200, 40), (40, 90, 200), (200, 40, 40)))
    top, left, right, bot = (0.5, 0.0), (0.0, 0.22), (1.0, 0.22), (0.5, 0.62)
    mid = (0.5, 0.22)
    p.poly([top, left, mid], c)
    p.poly([top, right, mid], other)
    p.poly([left, bot, mid], other)
    p.poly([right, bot, mid], c)
    p.line([top, bot], (60, 45, 30), 0.025)
    p.line([left, right], (60, 45, 30), 0.025)
    pts = [(0.5 + 0.12 * math.sin(i * 1.3), 0.62 + i * 0.065) for i in range(6)]
    p.line(pts, (60, 60, 60), 0.02)
    for x, y in pts[1::2]:
        p.poly(
            [(x - 0.1, y - 0.025), (x + 0.1, y + 0.025), (x + 0.1, y - 0.025), (x - 0.1, y + 0.025)],
            jitter(other, rng, 20),
            outline=False,
        )


def draw_skateboard(p: Pen, rng: random.Random, c: RGB, variant: str) -> None:
    """Skateboard side view: deck with kicked-up ends and a stripe, trucks and four wheels."""
    p.poly([(0.0, 0.05), (0.1, 0.3), (0.9, 0.3), (1.0, 0.05), (1.0, 0.22), (0.92, 0.5), (0.08, 0.5), (0.0, 0.22)], c)
    p.line([(0.12, 0.4), (0.88, 0.4)], shade(c, 1.4), 0.08)
    for x in (0.2, 0.8):
        p.rect(x - 0.05, 0.5, x + 0.05, 0.62, METAL, outline=False)
        p.circle(x - 0.06, 0.78, 0.2, (235, 235, 225))
        p.circle(x + 0.06, 0.78, 0.2, (215, 215, 205))
