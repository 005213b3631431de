"""LLaVA-OneVision family adapter (``LlavaOnevisionForConditionalGeneration``, model_type ``llava_onevision``).

Layout in transformers 5.x: ``model.model.vision_tower`` (SigLIP, no CLS token, no pooling head),
``model.model.multi_modal_projector``, ``model.model.image_newline``, ``model.model.language_model``
(Qwen2: 1-D RoPE, biased q/k/v projections) and ``model.lm_head``.

Images (anyres-max): the processor resizes each image to the best resolution of
``image_grid_pinpoints`` and cuts it into tower-size tiles plus a downscaled base view; every tile goes
through SigLIP; the feature layer (``vision_feature_layer``, -1 for the hub checkpoints) is selected
with ``vision_feature_select_strategy`` ("full": every patch, there is no CLS to drop); the projected
tile mosaic is unpadded to the image's aspect ratio, bilinearly downscaled when it holds more than
``max_num_patches`` (``vision_aspect_ratio`` = ``anyres_max_<max>``) base views' worth of patches, and a
learned ``image_newline`` ends every row. The model's own ``pack_image_features`` does that packing here,
so the tokens spliced into the prompt are exactly HF's: the base view's square grid first, then the
newline-separated mosaic. All counts come from the config (tile size, patch size, pinpoints, the
``anyres_max`` number); nothing is hard-coded.

Multi-image prompts: mmfast processes a batch's images as one flat list, as HF's processor does for a
flat list, so every image is tiled. (HF's processor given a *nested* per-sample list uses only the base
view of images in multi-image samples; mmfast does not reproduce that mode.)

Video (``videos=``): a video is one vision item, its frames resized to the tower's input size
(:mod:`mmfast.models._video`; the ``pixel_values_videos`` of ``LlavaOnevisionVideoProcessor``) and
spliced at the ``<video>`` slot. As the model's ``get_video_features``: every frame goes through the
tower, the feature layer and the projector, then the model's own ``apply_pooling`` (bilinear, to
ceil(rows / 2) x ceil(cols / 2)) per frame; the frames' pooled tokens follow each other and one learned
``image_newline`` closes the video (F * ceil(rows/2) * ceil(cols/2) + 1 tokens, the processor's count).
``patch_ids`` number the pooled (frame, row, col) grid in raster order; the newline gets -1. The
tokens carry the ``VIDEO`` / ``FRAME`` tags (:mod:`mmfast.models.base`).

What runs on it: the methods that act inside the LLM on the spliced sequence, the feature stages that
select among an item's packed tokens (DivPrune, random drop), the video stages on videos (DyCoke, ToMe,
HICom, FastVID with ``siglip_head``), every decoder that neither reads the tower's CLS nor changes the
image size (all but DAMRO and RITUAL), and every drafter (see ``docs/methods.md``, "Model families:
LLaVA-OneVision"). Stages that need one square patch grid (or a CLS token) per image are refused for
this family.
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace
from typing import Any

import torch

from ..inputs import VideoClip, VisionItem
from ._video import VideoSettings, frames_tensor
from .base import VideoItems, VisionBatch, tag_video_tokens
from .features import ModelFeatures
from .llava import LlavaAdapter


class LlavaOnevisionAdapter(LlavaAdapter):
    family = "llava_onevision"

    #: SigLIP prepends no CLS token (``features_of`` reads it from the tower type)
    features = replace(LlavaAdapter.features, cls_token=False, tiles="anyres_max", video=True)
    video_token = "<video>"

    @classmethod
    def features_of(cls, config: Any) -> ModelFeatures:
        """No CLS token whatever the tower: the encoding drops it (``with_cls=False``), even from a CLIP tower."""
        return cls.features

    @classmethod
    def config_image_tokens(cls, config: Any) -> int | None:
        return None  # LLaVA-OneVision's vision-token count depends on the image size (anyres-max tiling)

    def video_items(self, clip: VideoClip, video: int, settings: VideoSettings) -> VideoItems:
        """One item: the frames at the tower's input size ([1, F, 3, S, S]); its size row is (S, S)."""
        side = int(self.vision_config.image_size)
        height, width = settings.size.get("height", side), settings.size.get("width", side)
        frames = frames_tensor(clip.frames, height, width, settings)  # [F, 3, S, S]
        item = VisionItem(video=video, n_frames=len(clip.frames))
        tokens = len(clip.frames) * math.prod(self._pooled_side()) + 1  # + the closing newline
        return VideoItems(
            [frames[None]], [torch.tensor([[height, width]])], [item], self.video_token, len(clip.frames), tokens
        )

    def _pooled_side(self) -> tuple[int, int]:
        rows, cols = self.grid
        return math.ceil(rows / 2), math.ceil(cols / 2)

    def encode_video(self, frames: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(features [F * N, Dv] before the projector, tokens [F * n + 1, d]) of one video's frames
        ([F, 3, S, S]), as the model's ``get_video_features`` and its closing newline."""
        base, tower = self.base, self.vision_tower
        selected = self.tower_layers(frames.to(device=tower.device, dtype=tower.dtype))  # [F, N', Dv]
        patches = selected[:, 1:] if self.select_strategy == "default" else selected  # [F, N, Dv]
        pooled = base.apply_pooling(self.projector(patches))  # [F, n, d]
        tokens = torch.cat([pooled.reshape(-1, pooled.shape[-1]), base.image_newline[None].to(pooled)])
        return patches.reshape(-1, patches.shape[-1]), tokens

    def tiles_per_image(self, image_sizes: torch.Tensor) -> list[int]:
        """Tower inputs per image (base view + tiles of the best pinpoint resolution), as HF counts them."""
        from transformers.models.llava_onevision.modeling_llava_onevision import image_size_to_num_patches

        cfg = self.model.config
        return [
            image_size_to_num_patches(
                image_size=s, grid_pinpoints=cfg.image_grid_pinpoints, patch_size=cfg.vision_config.image_size
            )
            for s in image_sizes
        ]

    def encode_images(
        self,
        pixel_values: torch.Tensor,
        image_sizes: torch.Tensor | None = None,
        items: list[VisionItem] | None = None,
    ) -> VisionBatch:
        """Images and videos (``items``; None = all images): videos through :meth:`encode_video`, the
        images through :meth:`_encode_images`, in item order."""
        if not items:
            return self._encode_images(pixel_values, image_sizes)
        images = [i for i, it in enumerate(items) if not it.is_video]
        parts: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]] = {}
        if images:
            sub = self._encode_images(pixel_values[images], None if image_sizes is None else image_sizes[images])
            for k, i in enumerate(images):
                parts[i] = (sub.features[k], sub.projected[k], sub.patch_ids[k], sub.extras["n_tiles"][k])
        n_pooled = math.prod(self._pooled_side())
        for i, it in enumerate(items):
            if it.is_video:
                feats, tokens = self.encode_video(pixel_values[i, : it.n_frames])
                pid = torch.arange(tokens.shape[0], device=tokens.device)
                pid[-1] = -1  # the closing newline
                parts[i] = (feats, tokens, pid, it.n_frames)
        order = [parts[i] for i in range(len(items))]
        vision = VisionBatch(
            features=[p[0] for p in order],
            patch_ids=[p[2] for p in order],
            cls=None,
            grid=self.grid,
            pixel_values=pixel_values,
            projected=[p[1] for p in order],
            extras={"n_tiles": [p[3] for p in order]},
        )
        tag_video_tokens(vision, items, [n_pooled] * len(items))
        return vision

    def _encode_images(self, pixel_values: torch.Tensor, image_sizes: torch.Tensor | None = None) -> VisionBatch:
        """SigLIP on every tile, feature selection, projection and the model's own anyres-max packing
        (:meth:`~mmfast.models.llava.LlavaAdapter.encode_tiles`; ``cls`` is None: no CLS token)."""
        if image_sizes is None:
            raise ValueError("LLaVA-OneVision needs image_sizes from its image processor")
        base, cfg = self.base, self.model.config

        def pack(tiles: list[torch.Tensor]) -> list[torch.Tensor]:
            return base.pack_image_features(
                tiles, image_sizes, image_newline=base.image_newline, vision_aspect_ratio=cfg.vision_aspect_ratio
            )[0]

        return self.encode_tiles(pixel_values, self.tiles_per_image(image_sizes), pack, with_cls=False)


@functools.cache
def image_processor_class():
    """``LlavaOnevisionProcessor`` without its video processor.

    transformers 5.23 builds the OneVision video processor on torchvision, which does not import beside
    the CPU torch wheel mmfast installs; mmfast feeds images only, so its processor has the image
    processor and the tokenizer, and the text/token expansion of HF's processor unchanged (a
    subclass that only drops the ``video_processor`` argument). Loads from the files of a hub
    checkpoint or of ``save_pretrained`` (it ignores the video processor's file). Built on first use
    (transformers is imported lazily) and cached, so every caller gets the same class.
    """
    from transformers import LlavaOnevisionProcessor

    class LlavaOnevisionImageProcessor(LlavaOnevisionProcessor):
        def __init__(
            self,
            image_processor=None,
            tokenizer=None,
            num_image_tokens=None,
            vision_feature_select_strategy=None,
            chat_template=None,
            image_token="<image>",
            video_token="<video>",
            vision_aspect_ratio="anyres_max_9",
            **kwargs,
        ):
            kwargs.pop("video_processor", None)
            super().__init__(
                image_processor,
                tokenizer,
                None,  # no video processor: ProcessorMixin only binds the attributes of this signature
                num_image_tokens=num_image_tokens,
                vision_feature_select_strategy=vision_feature_select_strategy,
                chat_template=chat_template,
                image_token=image_token,
                video_token=video_token,
                vision_aspect_ratio=vision_aspect_ratio,
                **kwargs,
            )

        def to_dict(self):
            out = super().to_dict()
            out["processor_class"] = "LlavaOnevisionProcessor"  # a checkpoint's files name HF's class
            return out

    return LlavaOnevisionImageProcessor
