"""VCD: Visual Contrastive Decoding (Leng et al., CVPR 2024, arXiv 2311.16922).

Algorithm: a second branch sees the image distorted by a DDPM forward step on the *normalised*
pixel tensor, ``x' = sqrt(abar_t) x + sqrt(1 - abar_t) eps`` (1000-step schedule
``beta_i = sigmoid(linspace(-6, 6)) * (5e-3 - 1e-5) + 1e-5``, t = 500). Next-token logits are
``(1 + alpha) l - alpha l_noised`` restricted to the clean branch's plausible set (beta), then the
usual warpers and multinomial sampling (the paper's setting: T = 1, top-p = 1, alpha = 1, beta = 0.1;
VCD's bash scripts use beta = 0.2).
Hook points: a second branch (own KV cache) through the branch manager; equal lengths, so both
branches run as one batched forward. Limits: none beyond those of the branch manager.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..capabilities import Capabilities
from ..config import opt
from ..registry import DECODERS
from .branches import Branch, MultiBranchDecoder, WarpedBranchConfig, contrastive, query_rng

if TYPE_CHECKING:
    from ..context import MethodContext


def ddpm_noise(pixel_values: torch.Tensor, step: int, generator: torch.Generator) -> torch.Tensor:
    """VCD's diffusion noise on normalised pixels ([N, 3, H, W], or [N, T, 3, H, W] padded tiles); step in [0, 999]."""
    betas = torch.sigmoid(torch.linspace(-6, 6, 1000, dtype=torch.float64)) * (0.5e-2 - 1e-5) + 1e-5
    abar = torch.cumprod(1 - betas, dim=0)[step]
    shape = pixel_values.shape
    # [N, T, 3, H, W] (anyres tiles, video frames) padded to the batch's most: one draw per tower input, so its noise
    # never depends on the padding after it (torch's CPU randn redraws a trailing partial block of 16 values); the
    # same values as one draw where a tower input holds a multiple of 16 values
    n, one = (shape[:2].numel(), shape[2:]) if pixel_values.dim() == 5 else (1, shape)
    draws = [torch.randn(one, generator=generator, dtype=torch.float32, device=generator.device) for _ in range(n)]
    eps = torch.stack(draws).view(shape)
    x = pixel_values.float()
    return (abar.sqrt() * x + (1 - abar).sqrt() * eps.to(x.device)).to(pixel_values.dtype)


def noised_branch(ctx: MethodContext, req, step: int, seed: int, name: str = "noised") -> Branch:
    """The batch with every image noised; each image's noise depends only on (seed, image, prompt),
    never on the sampling RNG or on the batch it is in."""
    noised = []
    batch = req.batch
    for i, owner in enumerate(batch.image_owner):
        item = batch.item(i)
        if item.is_video:  # the item's first frame names it (a video's items are its frame groups)
            frames = batch.videos[owner].frames
            image = frames[min(item.first_frame, len(frames) - 1)]
        else:
            k = sum(1 for j in range(i) if batch.image_owner[j] == owner and not batch.item(j).is_video)
            image = batch.images[owner][k]
        rng = query_rng(seed, batch.prompts[owner], image)
        gen = torch.Generator(device="cpu").manual_seed(rng.getrandbits(63))
        row = req.batch.pixel_values[i : i + 1].clone()
        sizes = None if req.batch.image_sizes is None else req.batch.image_sizes[i : i + 1]
        own = ctx.adapter.image_pixels(row, sizes)  # a view without batch padding (Qwen-VL)
        own.copy_(ddpm_noise(own, step, gen))
        noised.append(row)
    batch = dataclasses.replace(req.batch, pixel_values=torch.cat(noised))
    return Branch(name, ctx.encode_branch(batch)[1])


@DECODERS.register("vcd", description="VCD: contrast against a diffusion-noised image (baseline)")
class VCD(MultiBranchDecoder):
    """Visual Contrastive Decoding."""

    caps = Capabilities(search="branches")

    @dataclass(frozen=True)
    class Config(WarpedBranchConfig):
        alpha: float = opt(1.0, lo=0.0, hi=20.0, doc="contrast weight")
        noise_step: int = opt(500, lo=0, hi=999, doc="DDPM step of the distortion")

    def branches(self, req):
        return [noised_branch(self.ctx, req, self.config.noise_step, req.seed)]

    def fuse(self, logits, step):
        return contrastive(logits["clean"], logits["noised"], self.config.alpha)
