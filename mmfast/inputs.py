"""A batch's inputs after the chat template and the image processor (:class:`PreparedBatch`), and
:func:`open_image`.

Shared by the model (which builds batches), the session, and the pruners and decoders (which read
them); it imports no method package and nothing above :mod:`mmfast.errors`, so any module may import
it at the top.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from PIL import Image, UnidentifiedImageError

from .errors import InputError


@dataclass
class PreparedBatch:
    """Prompts and images of one batch after the chat template and the image processor."""

    images: list[list[Image.Image]]  # per sample
    prompts: list[str]
    texts: list[str]  # after the chat template
    token_ids: list[list[int]]  # one image token per image (expanded later to the feature count)
    pixel_values: torch.Tensor  # [n_images, 3, H, W] ([n_images, n_tiles, 3, H, W] anyres; [n_images, max P, D] Qwen-VL)
    image_owner: list[int]  # sample index of each image
    meta: list[dict[str, Any]] = field(default_factory=list)  # per-sample info from the caller
    image_sizes: torch.Tensor | None = None  # [n_images, 2] original (H, W), anyres; [n_images, 3] grid_thw, Qwen-VL

    @property
    def batch_size(self) -> int:
        return len(self.prompts)


def open_image(image: Any) -> Image.Image:
    """A PIL RGB image from a PIL image or a path; clear error for a missing or corrupt file."""
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    path = Path(image)
    if not path.is_file():
        raise InputError(f"image {str(path)!r} not found (check the path or the data root)")
    try:
        with Image.open(path) as im:
            return im.convert("RGB")
    except Image.DecompressionBombError as exc:
        raise InputError(
            f"image {str(path)!r} is too large to decode safely ({exc}); downscale it below "
            f"{Image.MAX_IMAGE_PIXELS} pixels first"
        ) from None
    except (UnidentifiedImageError, OSError) as exc:
        raise InputError(f"image {str(path)!r} cannot be read ({exc}); is the file corrupt or not an image?") from None
