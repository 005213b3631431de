"""LLaVA-NeXT family adapter (``LlavaNextForConditionalGeneration``, model_type ``llava_next``).

Anyres: each image is resized to the best grid from ``image_grid_pinpoints`` and cut into tiles
plus a downscaled base view; every tile goes through the CLIP tower; the projected tile features are
unpadded to the image's aspect ratio and a learned ``image_newline`` ends every row
(``pack_image_features``, the model's own code). So the vision tokens of an image are the base view's
grid followed by a variable-size, newline-separated mosaic: not one square grid.

What runs on it: every drafter, every decoder that does not need one tower input per image (all but
RITUAL and DAMRO), the pruning stages that act inside the LLM on the spliced sequence (they see vision
slots, not a grid), and the feature stages that select among an image's packed tokens (DivPrune, random
drop; CDPruner per whole tile). Stages that need one square patch grid per image (merging inside the
tower, CLS-ranked selection and pooling: ToMe, VisionZip, MustDrop, HICom, average pooling) are rejected
for this family with a message naming the ones that work (the adapter's ``features``: ``tiles="anyres"``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from .base import VisionBatch
from .llava import LlavaAdapter


class LlavaNextAdapter(LlavaAdapter):
    family = "llava_next"
    features = replace(LlavaAdapter.features, tiles="anyres")

    @classmethod
    def config_image_tokens(cls, config: Any) -> int | None:
        return None  # LLaVA-NeXT's vision-token count depends on the image size (anyres tiling)

    def encode_images(self, pixel_values: torch.Tensor, image_sizes: torch.Tensor | None = None) -> VisionBatch:
        """Tower on every tile, feature selection, projection and the model's own anyres packing
        (:meth:`~mmfast.models.llava.LlavaAdapter.encode_tiles`; ``cls``: each image's first tile's)."""
        if image_sizes is None:
            raise ValueError("LLaVA-NeXT needs image_sizes from its image processor")
        from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

        base, cfg = self.base, self.model.config
        n_tiles = [
            image_size_to_num_patches(
                image_size=s, grid_pinpoints=cfg.image_grid_pinpoints, patch_size=cfg.vision_config.image_size
            )
            for s in image_sizes
        ]

        def pack(tiles: list[torch.Tensor]) -> list[torch.Tensor]:
            return base.pack_image_features(tiles, image_sizes, self.select_strategy, image_newline=base.image_newline)[
                0
            ]

        return self.encode_tiles(pixel_values, n_tiles, pack, with_cls=True)
