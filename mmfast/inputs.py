"""A batch's inputs after the chat template and the image processor (:class:`PreparedBatch`), the
video types (:class:`VideoClip`, :class:`VisionItem`), and :func:`open_image`.

Shared by the model (which builds batches), the session, and the pruners and decoders (which read
them); it imports no method package and nothing above :mod:`mmfast.errors`, so any module may import
it at the top.
"""

from __future__ import annotations

import logging
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from .errors import InputError

logger = logging.getLogger(__name__)


@dataclass
class VideoClip:
    """One video's sampled frames (``mmfast.video.open_video``)."""

    frames: list[Image.Image]  # the sampled frames, RGB, all of one size
    indices: list[int]  # each sampled frame's index in the source frames
    total_frames: int  # frames of the source before sampling
    fps: float | None = None  # the source's frames per second (None: unknown; the processors then assume 24)

    @property
    def sampled_fps(self) -> float:
        """Frames per second of the sampled frames, as transformers' ``VideoMetadata.sampled_fps``."""
        if self.fps is None:
            return 24.0
        return len(self.indices) / self.total_frames * self.fps


@dataclass(frozen=True)
class VisionItem:
    """What one row of ``PreparedBatch.pixel_values`` is: an image, or (part of) a video."""

    video: int = -1  # which video of its sample (0, 1, ...); -1: an image
    first_frame: int = 0  # temporal index (merged frame group) of the item's first frame within its video
    time_interval: float = 1.0  # M-RoPE temporal spacing of the item's frame groups (Qwen2.5-VL)
    n_frames: int = 0  # frames in the item's pixel row, for families that stack frames (OneVision)

    @property
    def is_video(self) -> bool:
        return self.video >= 0


@dataclass
class PreparedBatch:
    """Prompts, images and videos of one batch after the chat template and the image / video processing.

    A *vision item* is one row of ``pixel_values``: an image, a video (Qwen2-VL, Qwen2.5-VL, OneVision)
    or one frame group of a video (Qwen3-VL, whose prompt gives every frame group its own timestamped
    span). ``image_owner`` gives each item's sample and ``items`` says what it is (empty when the batch
    has no video: every item is an image). Items are in prompt order within each sample.
    """

    images: list[list[Image.Image]]  # per sample
    prompts: list[str]
    texts: list[str]  # after the chat template
    token_ids: list[list[int]]  # one image token per image (expanded later to the feature count)
    pixel_values: (
        torch.Tensor
    )  # [n_images, 3, H, W] ([n_images, n_tiles, 3, H, W] anyres; [n_images, max P, D] Qwen-VL)
    image_owner: list[int]  # sample index of each vision item (image or video part)
    meta: list[dict[str, Any]] = field(default_factory=list)  # per-sample info from the caller
    image_sizes: torch.Tensor | None = None  # [n_images, 2] original (H, W), anyres; [n_images, 3] grid_thw, Qwen-VL
    videos: list[VideoClip | None] = field(default_factory=list)  # per sample (empty: no video in the batch)
    items: list[VisionItem] = field(default_factory=list)  # per vision item (empty: all images)

    def item(self, i: int) -> VisionItem:
        """What vision item ``i`` is (an image when the batch has no video)."""
        return self.items[i] if self.items else _IMAGE

    @property
    def has_video(self) -> bool:
        return any(it.is_video for it in self.items)

    @property
    def batch_size(self) -> int:
        return len(self.prompts)


_IMAGE = VisionItem()

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

    try:
        orientation = im.getexif().get(0x0112, 1)  # Orientation tag; 1 = upright
    except (SyntaxError, ValueError, TypeError, struct.error) as exc:  # PIL's errors for a malformed EXIF block
        logger.warning("%s has unreadable EXIF metadata (%s); its pixels are used as stored", what, exc)
        return im
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


def _rgb(im: Image.Image, what: str) -> Image.Image:
    """``im`` as 8-bit RGB, transparency composited onto white. 16-bit grey (``I;16``, or ``I`` within
    0..65535) is scaled to 8 bits: PIL's ``convert`` clips it at 255, which turns a 16-bit photo white.
    Float pixels (``F``) have no fixed range and are refused (``convert`` clips them too: an image in
    0..1 turns black)."""
    if im.mode == "F":
        raise InputError(
            f"{what} has 32-bit float pixels (PIL mode F), whose range is not fixed; convert it to 8-bit RGB first"
        )
    if im.mode.startswith("I;16") or im.mode == "I":
        wide = im.convert("I")  # I;16B and I;16L have no getextrema
        lo, hi = wide.getextrema()
        if lo < 0 or hi > 65535:
            raise InputError(
                f"{what} has 32-bit integer pixels (PIL mode I) from {lo} to {hi}, outside 16-bit range; "
                "convert it to 8-bit RGB first"
            )
        if im.mode != "I" or hi > 255:  # 16-bit data: 0..65535 -> 0..255
            im = wide.point(lambda v: v * (255 / 65535))
    if "A" in im.getbands() or im.info.get("transparency") is not None:
        # onto white, as the checkpoint's processor does (transformers' convert_to_rgb): convert("RGB") dropped
        # the alpha, showing whatever colour the transparent pixels store (often black)
        white = Image.new("RGBA", im.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, im.convert("RGBA")).convert("RGB")
    return im.convert("RGB")


def open_image(image: Any) -> Image.Image:
    """A PIL RGB image from a PIL image or a path, turned upright by its EXIF orientation; clear error
    for a missing or corrupt file, an extreme aspect ratio or too many pixels."""
    if isinstance(image, Image.Image):
        _check_image_size(image, "an image")
        try:  # a lazily opened image decodes here: a truncated or closed file fails now
            return _rgb(_upright(image, "an image"), "an image")
        except (OSError, ValueError) as exc:
            raise InputError(f"an image cannot be read ({exc}); is its file corrupt, or was it closed?") from None
    if not isinstance(image, (str, os.PathLike)):
        array = hasattr(image, "shape") and hasattr(image, "dtype")  # numpy / torch
        hint = "; wrap an array as PIL.Image.fromarray(a) ([H, W, 3] uint8; a tensor: t.permute(1, 2, 0).numpy())"
        raise InputError(
            f"an image is a PIL image or a file path, got {type(image).__name__} "
            + (f"of shape {tuple(image.shape)} and dtype {image.dtype}{hint}" if array else f"{image!r:.80}")
        )
    path = Path(image)
    try:
        is_dir, is_file = path.is_dir(), path.is_file()
    except OSError as exc:  # a name too long (a prompt passed as the image), ...
        raise InputError(
            f"image {str(path)!r:.120} is not a usable path ({exc.strerror}); give an image file"
        ) from None
    if is_dir:
        raise InputError(f"image {str(path)!r} is a directory; give an image file (a video's frames: videos=, --video)")
    if not is_file:
        raise InputError(f"image {str(path)!r} not found (check the path or the data root)")
    try:
        with Image.open(path) as im:
            _check_image_size(im, f"image {str(path)!r}")
            return _rgb(_upright(im, f"image {str(path)!r}"), f"image {str(path)!r}")
    except Image.DecompressionBombError as exc:
        raise InputError(
            f"image {str(path)!r} is too large to decode safely ({exc}); downscale it below "
            f"{Image.MAX_IMAGE_PIXELS} pixels first"
        ) from None
    except (UnidentifiedImageError, OSError) as exc:
        raise InputError(f"image {str(path)!r} cannot be read ({exc}); is the file corrupt or not an image?") from None
