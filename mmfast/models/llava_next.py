"""LLaVA-NeXT family adapter (``LlavaNextForConditionalGeneration``, model_type ``llava_next``).

Anyres: each image is resized to the best grid from ``image_grid_pinpoints`` and cut into tiles
plus a downscaled base view; every tile goes through the CLIP tower; the projected tile features are
unpadded to the image's aspect ratio and a learned ``image_newline`` ends every row
(``pack_image_features``, the model's own code). So the vision tokens of an image are the base view's
grid followed by a variable-size, newline-separated mosaic: not one square grid.

What runs on it: every decoder and drafter, and the pruning stages that act inside the LLM on the
spliced sequence (they see vision slots, not a grid). Stages that need one square patch grid per image
(merging inside the tower, feature-stage selection and pooling) are rejected for this family with a
message naming the ones that work (the adapter's ``features``: ``tiles="anyres"``).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .base import VisionBatch
from .llava import LlavaAdapter


class LlavaNextAdapter(LlavaAdapter):
    family = "llava_next"
    features = replace(LlavaAdapter.features, tiles="anyres")

    @property
    def n_image_tokens(self) -> int:
        raise AttributeError("LLaVA-NeXT's vision-token count depends on the image size (anyres tiling)")

    def encode_images(self, pixel_values: torch.Tensor, image_sizes: torch.Tensor | None = None) -> VisionBatch:
        """Tower on every tile, feature selection, projection and the model's own anyres packing.

        The packed, projected tokens go to ``VisionBatch.projected``; ``features`` keep each image's
        pre-projection tile features (``[n_tiles * N, Dv]``) for reference.
        """
        if image_sizes is None:
            raise ValueError("LLaVA-NeXT needs image_sizes from its image processor")
        from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

        base, cfg = self.base, self.model.config
        tower = self.vision_tower
        n_tiles = [
            image_size_to_num_patches(
                image_size=s, grid_pinpoints=cfg.image_grid_pinpoints, patch_size=cfg.vision_config.image_size
            )
            for s in image_sizes
        ]
        pv = pixel_values
        if pv.dim() == 5:  # [n_images, max_tiles, 3, H, W] padded: keep each image's real tiles
            pv = torch.cat([p[:n] for p, n in zip(pv, n_tiles)], dim=0)
        pv = pv.to(device=tower.device, dtype=tower.dtype)
        selected = self.tower_layers(pv)  # [tiles, 1+N, Dv]
        cls = selected[:, 0]
        patches = selected[:, 1:] if self.select_strategy == "default" else selected
        projected = torch.split(self.projector(patches), n_tiles, dim=0)  # per image [tiles_i, N, d]
        packed, _ = base.pack_image_features(
            list(projected), image_sizes, self.select_strategy, image_newline=base.image_newline
        )
        feats = [f.reshape(-1, f.shape[-1]) for f in torch.split(patches, n_tiles, dim=0)]
        n_base = patches.shape[1]
        ids = []
        for p in packed:
            pid = torch.full((p.shape[0],), -1, dtype=torch.long, device=p.device)
            pid[:n_base] = torch.arange(n_base, device=p.device)  # the base view is the square grid
            ids.append(pid)
        first_tile = torch.tensor([0, *torch.tensor(n_tiles).cumsum(0)[:-1].tolist()])
        return VisionBatch(
            features=feats,
            patch_ids=ids,
            cls=cls[first_tile.to(cls.device)],
            grid=self.grid,
            pixel_values=pv,
            projected=list(packed),
            extras={"n_tiles": n_tiles},
        )
