"""LLaVA-1.5 family adapter (``LlavaForConditionalGeneration``, model_type ``llava``).

Layout in transformers 5.x: ``model.model.vision_tower`` (CLIP), ``model.model.multi_modal_projector``,
``model.model.language_model`` (a bare decoder, layers at ``.layers``) and ``model.lm_head``. The
feature layer (``vision_feature_layer``, -2 for LLaVA-1.5) and select strategy (``default`` drops CLS)
come from the config, as do the image token id and the patch grid: no magic 576 or 35:611.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from .. import compat
from .base import VisionBatch, VLMAdapter
from .features import ModelFeatures

#: vision-tower config types without a CLS token (SigLIP)
CLS_LESS_TOWERS = frozenset({"siglip_vision_model", "siglip2_vision_model"})


class LlavaAdapter(VLMAdapter):
    family = "llava"
    features = ModelFeatures(
        cls_token=True,  # CLIP prepends CLS; the "default" strategy drops it before the projector
        patch_grid="square",
        tiles="none",
        rope="1d",
        video=False,
        tower_attention="global",
        paired_text_tower=True,
    )

    @classmethod
    def features_of(cls, config: Any) -> ModelFeatures:
        """The declared features; a SigLIP tower has no CLS token."""
        tower = getattr(config.vision_config, "model_type", "")
        return replace(cls.features, cls_token=tower not in CLS_LESS_TOWERS)

    @classmethod
    def config_shape(cls, config: Any) -> tuple[int, int, tuple[int, int]]:
        vision = config.vision_config
        side = int(vision.image_size) // int(vision.patch_size)
        return int(config.text_config.num_hidden_layers), int(vision.num_hidden_layers), (side, side)

    @classmethod
    def config_image_tokens(cls, config: Any) -> int | None:
        rows, cols = cls.config_shape(config)[2]
        return rows * cols + (1 if config.vision_feature_select_strategy == "full" else 0)

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.features = self.features_of(model.config)
        cfg = model.config
        if not isinstance(cfg.vision_feature_layer, int):
            # A list of layers is concatenated along channels; pruners need one layer's CLS/attention.
            self._feature_layers = list(cfg.vision_feature_layer)
        else:
            self._feature_layers = [cfg.vision_feature_layer]
        self.select_strategy = cfg.vision_feature_select_strategy

    # -- structure -------------------------------------------------------------------------------
    @property
    def vision_tower(self) -> nn.Module:
        return self.base.vision_tower

    @property
    def projector(self) -> nn.Module:
        return self.base.multi_modal_projector

    @property
    def vision_layers(self) -> nn.ModuleList:
        return compat.vision_encoder(self.vision_tower).layers

    @property
    def grid(self) -> tuple[int, int]:
        side = self.vision_config.image_size // self.vision_config.patch_size
        return (side, side)

    #: the session's :class:`~mmfast.models.captured_tower.CapturedTower` (an instance attribute it sets and
    #: restores): :meth:`tower_layers` runs through it; None: eagerly
    tower_graphs: Any = None

    def tower_layers(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[n, 1 + N, Dv'] the tower's feature layers, concatenated over channels, for ``pixel_values``
        ([n, 3, H, W] images, tiles or frames, on the tower's device and dtype); through the session's
        captured tower where it set one."""
        if self.tower_graphs is not None:
            return self.tower_graphs(self._tower_layers, pixel_values)
        return self._tower_layers(pixel_values)

    def _tower_layers(self, pixel_values: torch.Tensor) -> torch.Tensor:
        out = self.vision_tower(pixel_values, output_hidden_states=True, return_dict=True)
        return torch.cat([out.hidden_states[k] for k in self._feature_layers], dim=-1)  # [n, 1 + N, Dv']

    def vision_feature_layer_index(self) -> int:
        """0-based encoder layer producing the features (hidden_states[k] is the output of layer k-1)."""
        n = len(self.vision_layers)
        k = self._feature_layers[-1]
        k = k if k >= 0 else n + 1 + k  # index into hidden_states (embeddings + n layers)
        return k - 1

    # -- compute ---------------------------------------------------------------------------------
    def encode_images(self, pixel_values: torch.Tensor, image_sizes: torch.Tensor | None = None) -> VisionBatch:
        """Run the tower and select the feature layer. Returns pre-projection patch features."""
        tower = self.vision_tower
        pixel_values = pixel_values.to(device=tower.device, dtype=tower.dtype)
        selected = self.tower_layers(pixel_values)  # [n_img, 1 + N, Dv']
        if self.select_strategy == "default":
            cls, patches = selected[:, 0], selected[:, 1:]  # [n_img, Dv'], [n_img, N, Dv']
            ids = torch.arange(patches.shape[1], device=patches.device)
        else:
            cls, patches = selected[:, 0], selected
            ids = torch.cat([torch.tensor([-1]), torch.arange(patches.shape[1] - 1)]).to(patches.device)
        return VisionBatch(
            features=list(patches.unbind(0)),
            patch_ids=[ids.clone() for _ in range(patches.shape[0])],
            cls=cls,
            grid=self.grid,
            pixel_values=pixel_values,
        )

    def encode_tiles(self, pixel_values: torch.Tensor, n_tiles: list[int], pack: Any, with_cls: bool) -> VisionBatch:
        """The anyres families' (LLaVA-NeXT, LLaVA-OneVision) tower on every image's real tiles, feature
        selection, projection and the model's own packing ``pack`` (per image ``[tiles_i, N, d]`` projected
        tiles -> per image packed ``[n_i, d]``).

        The packed, projected tokens go to ``VisionBatch.projected``; ``features`` keep each image's
        pre-projection tile features (``[n_tiles * N, Dv]``) for reference. ``patch_ids`` number the base
        view's grid (0..N-1); mosaic tokens and newlines get -1. ``cls``: each image's first tile's CLS
        (``with_cls``) or None.
        """
        tower = self.vision_tower
        pv = pixel_values
        if pv.dim() == 5:  # [n_images, max_tiles, 3, H, W] padded: keep each image's real tiles
            pv = torch.cat([p[:n] for p, n in zip(pv, n_tiles)], dim=0)
        pv = pv.to(device=tower.device, dtype=tower.dtype)
        selected = self.tower_layers(pv)  # [tiles, (1 +) N, Dv]
        patches = selected[:, 1:] if self.select_strategy == "default" else selected
        packed = pack(list(torch.split(self.projector(patches), n_tiles, dim=0)))  # per image [n_i, d]
        n_base = patches.shape[1]
        ids = []
        for p in packed:
            pid = torch.full((p.shape[0],), -1, dtype=torch.long, device=p.device)
            pid[:n_base] = torch.arange(n_base, device=p.device)  # the base view is the square grid
            ids.append(pid)
        cls = None
        if with_cls:
            first_tile = torch.tensor([0, *torch.tensor(n_tiles).cumsum(0)[:-1].tolist()])
            cls = selected[:, 0][first_tile.to(selected.device)]  # [n_images, Dv]
        return VisionBatch(
            features=[f.reshape(-1, f.shape[-1]) for f in torch.split(patches, n_tiles, dim=0)],
            patch_ids=ids,
            cls=cls,
            grid=self.grid,
            pixel_values=pv,
            projected=list(packed),
            extras={"n_tiles": n_tiles},
        )

    def project(self, vision: VisionBatch) -> list[torch.Tensor]:
        """Projector on every image that a stage has not already projected. Returns [N_i, d] each."""
        out = []
        for feats, proj in zip(vision.features, vision.projected):
            out.append(proj if proj is not None else self.projector(feats.unsqueeze(0)).squeeze(0))
        return out

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_tokens(ids)
