"""RITUAL (Woo et al., arXiv 2405.17821): random image transformations as complementary input.

Algorithm: for every query one transformation is drawn uniformly from the paper's pool (horizontal
flip, vertical flip, random rotation in [-180, 180], ColorJitter(1, 1, 1, 0.5), GaussianBlur(13,
sigma in [1.5, 2]), RandomResizedCrop to the model's input size) and applied to the raw image; the
transformed branch is *added*: ``l + alpha_pos l_T`` (alpha_pos = 3), with the plausibility cutoff
(beta = 0.1) on the original branch, then the warpers and sampling (T = 1, top-p = 1).
``alpha_neg > 0`` gives RITUAL + VCD: ``(1 + a_neg) l - a_neg l_noised + a_pos l_T`` (the form the two
weights of the released code imply; that code branches exclusively, so this combination is ours).
The transforms follow torchvision's parameter sampling, implemented with PIL/numpy (torchvision does
not install beside the CPU torch used here); the Gaussian blur uses the exact 13-tap kernel with
reflect padding. Hook points: one or two extra branches via the branch manager.

Qwen-VL families (qwen2_vl, qwen2_5_vl, qwen3_vl): refused: re-runs the image processor on a
transformed square view (CLIP crop size); the dynamic-resolution patch layout is not wired.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass
from typing import Literal

import numpy as np
from PIL import Image, ImageEnhance

from ..capabilities import Capabilities, Need
from ..config import opt
from ..registry import DECODERS
from .branches import Branch, MultiBranchDecoder, WarpedBranchConfig, additive, query_rng
from .vcd import noised_branch

Transform = Literal["hflip", "vflip", "rotate", "color_jitter", "blur", "resized_crop"]
POOL: tuple[Transform, ...] = ("hflip", "vflip", "rotate", "color_jitter", "blur", "resized_crop")


def _blur(im: Image.Image, sigma: float, ksize: int = 13) -> Image.Image:
    x = np.asarray(im, dtype=np.float32)  # [H, W, 3]
    half = ksize // 2
    k = np.exp(-0.5 * (np.arange(-half, half + 1) / sigma) ** 2)
    k /= k.sum()
    for axis in (0, 1):
        pad = [(0, 0)] * 3
        pad[axis] = (half, half)
        xp = np.pad(x, pad, mode="reflect")
        x = sum(k[i] * np.take(xp, range(i, i + x.shape[axis]), axis=axis) for i in range(ksize))
    return Image.fromarray(np.clip(np.rint(x), 0, 255).astype(np.uint8))


def _hue(im: Image.Image, factor: float) -> Image.Image:
    h, s, v = im.convert("HSV").split()
    shifted = (np.asarray(h, dtype=np.int16) + int(round(factor * 255))) % 256
    return Image.merge("HSV", (Image.fromarray(shifted.astype(np.uint8)), s, v)).convert("RGB")


def _resized_crop(im: Image.Image, size: int, rng: random.Random) -> Image.Image:
    w, h = im.size
    area = w * h
    for _ in range(10):  # torchvision's RandomResizedCrop.get_params
        target = area * rng.uniform(0.08, 1.0)
        ratio = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        cw, ch = int(round(math.sqrt(target * ratio))), int(round(math.sqrt(target / ratio)))
        if 0 < cw <= w and 0 < ch <= h:
            top, left = rng.randint(0, h - ch), rng.randint(0, w - cw)
            return im.resize((size, size), Image.BILINEAR, box=(left, top, left + cw, top + ch))
    # ten misses: torchvision's central crop, its aspect ratio clamped to [3/4, 4/3]
    if w / h < 3 / 4:
        cw, ch = w, int(round(w / (3 / 4)))
    elif w / h > 4 / 3:
        cw, ch = int(round(h * (4 / 3))), h
    else:
        cw, ch = w, h
    top, left = (h - ch) // 2, (w - cw) // 2
    return im.resize((size, size), Image.BILINEAR, box=(left, top, left + cw, top + ch))


def transform(im: Image.Image, kind: Transform, rng: random.Random, size: int) -> Image.Image:
    """One RITUAL transformation of an RGB image."""
    if kind == "hflip":
        return im.transpose(Image.FLIP_LEFT_RIGHT)
    if kind == "vflip":
        return im.transpose(Image.FLIP_TOP_BOTTOM)
    if kind == "rotate":
        return im.rotate(rng.uniform(-180, 180), resample=Image.NEAREST, fillcolor=(0, 0, 0))
    if kind == "blur":
        return _blur(im, rng.uniform(1.5, 2.0))
    if kind == "resized_crop":
        return _resized_crop(im, size, rng)
    ops = [0, 1, 2, 3]
    rng.shuffle(ops)  # ColorJitter applies its four adjustments in random order
    b, c, s, hue = rng.uniform(0, 2), rng.uniform(0, 2), rng.uniform(0, 2), rng.uniform(-0.5, 0.5)
    for op in ops:
        im = [
            lambda x: ImageEnhance.Brightness(x).enhance(b),
            lambda x: ImageEnhance.Contrast(x).enhance(c),
            lambda x: ImageEnhance.Color(x).enhance(s),
            lambda x: _hue(x, hue),
        ][op](im)
    return im


@DECODERS.register("ritual", description="RITUAL: add a randomly transformed view of the image (optionally + VCD)")
class Ritual(MultiBranchDecoder):
    """RITUAL."""

    # transforms change the image size: another anyres token layout
    caps = Capabilities(
        needs=frozenset({Need.UNTILED, Need.SQUARE_GRID}),
        why={
            Need.UNTILED: "its transforms change the image size, hence the tile layout, so its branch is not "
            "aligned with the clean one",
            Need.SQUARE_GRID: "it re-runs the image processor on a transformed square view (the tower's crop size); "
            "the dynamic-resolution patch layout is not wired",
        },
        search="branches",
    )

    @dataclass(frozen=True)
    class Config(WarpedBranchConfig):
        alpha: float = opt(3.0, lo=0.0, hi=20.0, doc="alpha_pos: weight of the transformed branch")
        alpha_neg: float = opt(0.0, lo=0.0, hi=20.0, doc="> 0: RITUAL + VCD with this contrast weight")
        noise_step: int = opt(500, lo=0, hi=999, doc="VCD noise step (RITUAL + VCD)")
        transforms: tuple[Transform, ...] = opt(POOL, min_items=1, doc="the pool one transform is drawn from per query")

    def branches(self, req):
        cfg, ctx = self.config, self.ctx
        size = int(req.batch.pixel_values.shape[-1])
        chosen, images = [], []
        for prompt, ims in zip(req.batch.prompts, req.batch.images):
            rng = query_rng(req.seed, prompt, ims[0])
            kind = rng.choice(cfg.transforms)
            chosen.append(kind)
            images.append([transform(im, kind, rng, size) for im in ims])
        flat = [im for ims in images for im in ims]
        pixels = ctx.image_processor(images=flat, return_tensors="pt")["pixel_values"]
        batch = dataclasses.replace(req.batch, images=images, pixel_values=pixels)
        out = [Branch("transformed", ctx.encode_branch(batch)[1], {"per_sample_transform": chosen})]
        if cfg.alpha_neg > 0:
            out.append(noised_branch(ctx, req, cfg.noise_step, req.seed))
        return out

    def fuse(self, logits, step):
        cfg = self.config
        clean = logits["clean"]
        if cfg.alpha_neg > 0:
            clean = (1 + cfg.alpha_neg) * clean - cfg.alpha_neg * logits["noised"]
        return additive(clean, logits["transformed"], cfg.alpha)
