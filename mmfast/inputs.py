"""A batch's inputs after the chat template and the image processor (:class:`PreparedBatch`), and
:func:`open_image`.

Shared by the model (which builds batches), the session, and the pruners and decoders (which read
them); it imports no method package and nothing above :mod:`mmfast.errors`, so any module may import
it at the top.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from .errors import InputError

logger = logging.getLogger(__name__)


@dataclass
class PreparedBatch:
    """Prompts and images of one batch after the chat template and the image processor."""

    images: list[list[Image.Image]]  # per sample
    prompts: list[str]
    texts: list[str]  # after the chat template
    token_ids: list[list[int]]  # one image token per image (expanded later to the feature count)
    pixel_values: (
        torch.Tensor
    )  # [n_images, 3, H, W] ([n_images, n_tiles, 3, H, W] anyres; [n_images, max P, D] Qwen-VL)
    image_owner: list[int]  # sample index of each image
    meta: list[dict[str, Any]] = field(default_factory=list)  # per-sample info from the caller
    image_sizes: torch.Tensor | None = None  # [n_images, 2] original (H, W), anyres; [n_images, 3] grid_thw, Qwen-VL

    @property
    def batch_size(self) -> int:
        return len(self.prompts)


MAX_ASPECT_RATIO = 200
"""Longest over shortest side an image may have: image processors resize the shortest side to the
tower's size, so a 40000x1 strip becomes a 13-million-pixel-wide image (minutes and GBs; Qwen2-VL's
processor refuses past 200 too)."""

_EXIF_ROTATION_LOGGED = False


def _check_image_size(im: Image.Image, what: str) -> None:
    """Refuse an extreme aspect ratio or pixel count before any processing (from the header only)."""
    w, h = im.size
    if min(w, h) < 1 or max(w, h) > MAX_ASPECT_RATIO * min(w, h):
        raise InputError(
            f"{what} is {w}x{h} pixels, an aspect ratio over {MAX_ASPECT_RATIO}:1 that the image processor would "
            f"blow up to millions of pixels; crop or pad it to at most {MAX_ASPECT_RATIO}:1 first"
        )
    if Image.MAX_IMAGE_PIXELS and w * h > Image.MAX_IMAGE_PIXELS:
        raise InputError(
            f"{what} is {w}x{h} = {w * h} pixels, over the {Image.MAX_IMAGE_PIXELS}-pixel limit; downscale it first"
        )


def _upright(im: Image.Image, what: str) -> Image.Image:
    """``im`` turned as its EXIF orientation says (as cameras save photos and viewers show them); the
    first turned image is logged once per process."""
    global _EXIF_ROTATION_LOGGED

    orientation = im.getexif().get(0x0112, 1)  # Orientation tag; 1 = upright
    if orientation in (None, 1):
        return im
    if not _EXIF_ROTATION_LOGGED:
        logger.info(
            "%s has EXIF orientation %s: turned upright before processing (as viewers show it); "
            "further such images are turned without a message",
            what,
            orientation,
        )
        _EXIF_ROTATION_LOGGED = True
    return ImageOps.exif_transpose(im)


def open_image(image: Any) -> Image.Image:
    """A PIL RGB image from a PIL image or a path, turned upright by its EXIF orientation; clear error
    for a missing or corrupt file, an extreme aspect ratio or too many pixels."""
    if isinstance(image, Image.Image):
        _check_image_size(image, "an image")
        return _upright(image, "an image").convert("RGB")
    path = Path(image)
    if not path.is_file():
        raise InputError(f"image {str(path)!r} not found (check the path or the data root)")
    try:
        with Image.open(path) as im:
            _check_image_size(im, f"image {str(path)!r}")
            return _upright(im, f"image {str(path)!r}").convert("RGB")
    except Image.DecompressionBombError as exc:
        raise InputError(
            f"image {str(path)!r} is too large to decode safely ({exc}); downscale it below "
            f"{Image.MAX_IMAGE_PIXELS} pixels first"
        ) from None
    except (UnidentifiedImageError, OSError) as exc:
        raise InputError(f"image {str(path)!r} cannot be read ({exc}); is the file corrupt or not an image?") from None
