"""Qwen-VL family adapters: Qwen2-VL, Qwen2.5-VL and Qwen3-VL (transformers 5.x classes
``Qwen2VLForConditionalGeneration``, ``Qwen2_5_VLForConditionalGeneration``,
``Qwen3VLForConditionalGeneration``; model_type ``qwen2_vl``, ``qwen2_5_vl``, ``qwen3_vl``).

Layout: ``model.model.visual`` (the ViT: ``patch_embed``, ``blocks``, ``merger``; Qwen3-VL adds
``deepstack_merger_list``), ``model.model.language_model`` (decoder, layers at ``.layers``), and
``model.lm_head``. Geometry, all read from the config and the image processor's ``image_grid_thw``:

* dynamic resolution: each image is resized to a multiple of ``patch_size * spatial_merge_size`` and
  cut into (t, H, W) patches (``temporal_patch_size`` frames per patch); the processor flattens them.
  ``pack_pixels`` pads them per image ([n_images, max P_i, D]), ``image_sizes`` carries ``grid_thw``.
* the merger (PatchMerger) maps each 2x2 block of patches to one LLM token: an image has
  t * (H/2) * (W/2) vision tokens. mmfast's vision token = one merge unit: ``VisionBatch.features[i]``
  is [N_i, 4 * Dv] (the tower's last hidden states of the unit's 4 patches, in raster order of the
  merged grid) and ``project`` is the merger, so feature-stage pruners select whole LLM tokens;
  ``patch_ids`` index the merged grid ``extras["grid_thw"][i]`` = (t, H/2, W/2).
* Qwen2.5-VL's tower runs window attention (``window_size`` pixels, full attention in
  ``fullatt_block_indexes``) on units permuted into window order; the features are returned in
  raster order (the model's own ``reverse_indices``).
* Qwen3-VL's deepstack: the tower's ``deepstack_visual_indexes`` layers each give, through their own
  merger, a [N_i, d] feature added to the vision tokens' hidden states after LLM layers 0, 1, ...
  They travel with the vision tokens as the per-token tag ``DEEPSTACK`` ([N_i, n_levels, d]), so a
  stage that selects or drops tokens keeps the right rows, and the runner adds them to the slots that
  remain (``LMRunner``'s deepstack hooks).
* no CLS token; positions are multimodal RoPE ([B, L, 3], :mod:`mmfast.models.mrope`).

Video (``videos=``): frames become the processor's ``pixel_values_videos`` rows and
``video_grid_thw`` (:mod:`mmfast.models._video`), and the tower runs on them as on an image whose
temporal grid ``t`` is the number of frame groups (``temporal_patch_size`` frames each; the model's
own ``get_video_features`` is the same tower call). A video is one vision item on Qwen2-VL and
Qwen2.5-VL, spliced at the ``<|video_pad|>`` slot; its tokens' M-RoPE temporal ids are the frame
group index (Qwen2-VL) or ``int(i * tokens_per_second * second_per_grid_t)`` with
``second_per_grid_t = temporal_patch_size / sampled fps`` (Qwen2.5-VL,
:func:`mmfast.compat.qwen25_time_interval`). Qwen3-VL's processor writes every frame group as its
own span ``<{t:.1f} seconds><|vision_start|><|video_pad|>...<|vision_end|>`` (timestamps as
``Qwen3VLProcessor`` computes them), and its ``get_rope_index`` numbers each group as a one-frame
grid, so there each frame group is one vision item (the tower attends within a frame either way).
Video tokens carry the ``VIDEO`` / ``FRAME`` tags (:mod:`mmfast.models.base`) for pruners.

``grid`` is a nominal 24 x 24 grid (what the model facts and the methods' test settings read), not a
geometry: every image has its own token count, and a budget applies to that count (``tokens: N``
keeps N, ``ratio: r`` round(r N_i); docs/methods.md, "One budget vocabulary").
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from .. import compat
from ..inputs import PreparedBatch, VideoClip, VisionItem
from ..video import FrameRule
from ._video import VideoSettings, qwen3_timestamps, qwen3_video_size, qwen_video_patches
from .base import VideoItems, VisionBatch, VLMAdapter, tag_video_tokens
from .features import ModelFeatures
from .mrope import sample_positions
from .qwen_processor import pad_patches

DEEPSTACK = "deepstack"  # VisionBatch / LMInputs tag of Qwen3-VL's multi-level features
BUDGET_REFERENCE_GRID = (24, 24)


class Qwen2VLAdapter(VLMAdapter):
    family = "qwen2_vl"
    features = ModelFeatures(
        cls_token=False,
        patch_grid="dynamic",
        tiles="none",
        rope="mrope",
        video=True,
        tower_attention="global",  # within each image
        paired_text_tower=False,
    )
    video_token = "<|video_pad|>"

    @classmethod
    def config_shape(cls, config: Any) -> tuple[int, int, tuple[int, int]]:
        """Dynamic resolution: the grid is the budget reference grid."""
        return int(config.text_config.num_hidden_layers), int(config.vision_config.depth), BUDGET_REFERENCE_GRID

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.features = self.features_of(model.config)
        self.merge = int(model.config.vision_config.spatial_merge_size)

    # -- structure -------------------------------------------------------------------------------
    @property
    def vision_tower(self) -> nn.Module:
        return self.base.visual

    @property
    def projector(self) -> nn.Module:
        return self.vision_tower.merger

    @property
    def vision_layers(self) -> nn.ModuleList:
        return self.vision_tower.blocks

    @property
    def grid(self) -> tuple[int, int]:
        return BUDGET_REFERENCE_GRID

    @property
    def deepstack_levels(self) -> int:
        return 0

    def vision_feature_layer_index(self) -> int:
        return len(self.vision_layers) - 1  # the merger reads the last block

    # -- positions -------------------------------------------------------------------------------
    def lm_position_ids(self, positions: torch.Tensor) -> torch.Tensor:
        """[B, L, 3] -> [3, B, L] (HF's layout; the LM builds no text-position row from it)."""
        return positions.permute(2, 0, 1) if positions.dim() == 3 else positions

    def mrope_positions(self, pieces: list, device: torch.device) -> torch.Tensor:
        return sample_positions(pieces, device)

    def image_pixels(self, pixel_values, image_sizes):
        return pixel_values[:, : int(image_sizes[0].prod())]  # [1, P_i, D] of the padded [1, max P, D]

    def pack_pixels(self, processed):
        grid = processed["image_grid_thw"]
        return pad_patches(processed["pixel_values"], grid), grid

    # -- video ---------------------------------------------------------------------------------
    def _time_interval(self, clip: VideoClip, settings: VideoSettings) -> float:
        return 1.0  # Qwen2-VL: the frame group index

    def video_items(self, clip: VideoClip, video: int, settings: VideoSettings) -> VideoItems:
        """One item: the video's patches ([1, t * h * w, D]) and ``video_grid_thw`` ([1, 3])."""
        patches, thw = qwen_video_patches(clip.frames, settings)
        item = VisionItem(video=video, time_interval=self._time_interval(clip, settings))
        tokens = patches.shape[0] // self.merge**2
        return VideoItems([patches[None]], [torch.tensor([thw])], [item], self.video_token, len(clip.frames), tokens)

    def frame_rule(self, settings: VideoSettings) -> FrameRule:
        """``Qwen2VLVideoProcessor.sample_frames``: counts in multiples of the temporal patch size."""
        return FrameRule(settings.temporal_patch_size, settings.min_frames, settings.max_frames)

    # -- compute ---------------------------------------------------------------------------------
    def counts_before_tower(self, batch: PreparedBatch) -> list[int] | None:
        """An item of grid (t, H, W) has t * H * W / merge^2 vision tokens (``encode_images``)."""
        if batch.image_sizes is None:
            return None
        return [int(t * h * w) // self.merge**2 for t, h, w in batch.image_sizes.tolist()]

    def _run_tower(self, pixels: torch.Tensor, grid_thw: torch.Tensor):
        """Tower output: (hidden [P, Dv] in merge-unit raster order, deepstack list or None)."""
        out = self.vision_tower(pixels, grid_thw=grid_thw, return_dict=True)
        return out.last_hidden_state, None

    def encode_images(
        self,
        pixel_values: torch.Tensor,
        image_sizes: torch.Tensor | None = None,
        items: list[VisionItem] | None = None,
    ) -> VisionBatch:
        """Tower on the items' patches (``pixel_values`` [n, max P_i, D] padded, ``image_sizes`` =
        ``image_grid_thw`` / ``video_grid_thw`` rows [n, 3]); features per merge unit, pre-merger
        (module docstring). ``items`` (None: all images) marks videos: their time spacing goes to
        ``extras["time_interval"]`` and their tokens get the ``VIDEO`` / ``FRAME`` tags."""
        if image_sizes is None:
            raise ValueError(f"{self.family} needs image_grid_thw (passed as image_sizes) from its image processor")
        tower = self.vision_tower
        grid_thw = image_sizes.to(pixel_values.device).long()
        counts = grid_thw.prod(-1).tolist()
        pixels = torch.cat([pv[:n] for pv, n in zip(pixel_values, counts)]).to(device=tower.device, dtype=tower.dtype)
        hidden, deep = self._run_tower(pixels, grid_thw.to(tower.device))  # [P, Dv], levels x [P/4, d]
        unit = self.merge * self.merge
        units = hidden.reshape(-1, unit * hidden.shape[-1])  # [sum N_i, 4 * Dv]
        n_tok = [c // unit for c in counts]
        feats = list(torch.split(units, n_tok))
        merged = [(int(t), int(h) // self.merge, int(w) // self.merge) for t, h, w in grid_thw.tolist()]
        vision = VisionBatch(
            features=feats,
            patch_ids=[torch.arange(n, device=units.device) for n in n_tok],
            cls=None,
            grid=self.grid,
            pixel_values=pixel_values,
            extras={"grid_thw": merged, "n_patches": counts},  # n_patches: real rows of pixel_values[i]
        )
        if deep is not None:
            stacked = torch.stack(deep, dim=1)  # [sum N_i, n_levels, d]
            vision.tags[DEEPSTACK] = list(torch.split(stacked, n_tok))
        if items:  # a batch with a video
            vision.extras["time_interval"] = [it.time_interval for it in items]
            tag_video_tokens(vision, items, [h * w for _, h, w in merged])
        return vision

    def project(self, vision: VisionBatch) -> list[torch.Tensor]:
        """The merger on every image a stage has not projected: [N_i, 4 * Dv] -> [N_i, d]."""
        dv = (
            self.vision_config.embed_dim if hasattr(self.vision_config, "embed_dim") else self.vision_config.hidden_size
        )
        return [
            p if p is not None else self.projector(f.reshape(-1, dv)) for f, p in zip(vision.features, vision.projected)
        ]

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_tokens(ids)


class Qwen2_5_VLAdapter(Qwen2VLAdapter):
    family = "qwen2_5_vl"
    features = replace(Qwen2VLAdapter.features, tower_attention="windowed")  # full attention in a few blocks

    def _time_interval(self, clip: VideoClip, settings: VideoSettings) -> float:
        """``tokens_per_second * second_per_grid_t``, ``second_per_grid_t = temporal_patch_size /
        sampled fps`` (``Qwen2_5_VLProcessor``)."""
        tps = float(self.vision_config.tokens_per_second)
        return compat.qwen25_time_interval(tps, settings.temporal_patch_size / clip.sampled_fps)

    def _run_tower(self, pixels, grid_thw):
        """The tower's blocks run on window-ordered units; return them to raster order (as the model
        does after its merger with ``reverse_indices``)."""
        from transformers.vision_utils import get_vision_window_index

        tower = self.vision_tower
        out = tower(pixels, grid_thw=grid_thw, return_dict=True)
        window_index, _ = get_vision_window_index(
            grid_thw,
            spatial_merge_size=tower.spatial_merge_size,
            window_size=tower.window_size,
            patch_size=tower.patch_size,
            kwargs={},
        )
        hidden = out.last_hidden_state  # [P, Dv], units in window order
        unit = tower.spatial_merge_unit
        units = hidden.reshape(-1, unit, hidden.shape[-1])[torch.argsort(window_index)]
        return units.reshape(hidden.shape), None


class Qwen3VLAdapter(Qwen2VLAdapter):
    family = "qwen3_vl"
    features = replace(Qwen2VLAdapter.features, video_items="item_per_frame")

    def video_items(self, clip: VideoClip, video: int, settings: VideoSettings) -> VideoItems:
        """One item per frame group ([1, h * w, D], grid (1, h, w)), each in its own timestamped span."""
        patches, (t, h, w) = qwen_video_patches(clip.frames, settings, size=qwen3_video_size)
        stamps = qwen3_timestamps(clip.indices, clip.fps, settings.temporal_patch_size)
        text = "".join(f"<{s:.1f} seconds><|vision_start|>{self.video_token}<|vision_end|>" for s in stamps[:t])
        rows = [p[None] for p in patches.split(h * w)]
        items = [VisionItem(video=video, first_frame=i) for i in range(t)]
        sizes = [torch.tensor([[1, h, w]]) for _ in range(t)]
        return VideoItems(rows, sizes, items, text, len(clip.frames), patches.shape[0] // self.merge**2)

    def frame_rule(self, settings: VideoSettings) -> FrameRule:
        """``Qwen3VLVideoProcessor.sample_frames``: the count as asked (not rounded to the temporal patch;
        fps sampling clamped to [min_frames, max_frames]), indices ``linspace(0, T - 1, n).round()``."""
        return FrameRule(1, settings.min_frames, settings.max_frames, spacing="linspace")

    @property
    def deepstack_levels(self) -> int:
        return len(self.vision_config.deepstack_visual_indexes)

    def _run_tower(self, pixels, grid_thw):
        out = self.vision_tower(pixels, grid_thw=grid_thw, return_dict=True)
        return out.last_hidden_state, list(out.deepstack_features)
