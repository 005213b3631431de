"""What a model family offers the methods (:class:`ModelFeatures`, declared once by its adapter) and
what a method may need of it (:class:`Need`).

A method never names a family: it declares needs in its ``Capabilities``, and
:func:`mmfast.capabilities.refusal` derives support or a refusal from the two (docs/architecture.md,
"Adding a model family"). This module imports nothing of mmfast, so adapters and the capability
check can both use it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal

#: how an image's vision tokens are packed: "none" = one tower input per image; "anyres" = the image
#: is cut into tiles plus a base view, the projected tiles are unpadded to the image's aspect ratio
#: and a learned newline token ends every row (LLaVA-NeXT); "anyres_max" = as "anyres", and the
#: mosaic is bilinearly downscaled across tiles when it is too large (LLaVA-OneVision)
Tiles = Literal["none", "anyres", "anyres_max"]
#: "square": every tower input is one fixed square patch grid (LLaVA-1.5's 24 x 24); "dynamic":
#: each image gets its own grid from its size (Qwen-VL's ``grid_thw``, merged units)
PatchGrid = Literal["square", "dynamic"]
#: "1d": one position per token; "mrope": multimodal RoPE, (temporal, height, width) per token
Rope = Literal["1d", "mrope"]
#: "global": every tower layer attends over the whole input; "windowed": some layers attend within
#: fixed windows of the patch grid (Qwen2.5-VL)
TowerAttention = Literal["global", "windowed"]
VideoItemsLayout = Literal["one_item", "item_per_frame"]


@dataclass(frozen=True)
class ModelFeatures:
    """A family's model, as methods see it. Every adapter declares one (``VLMAdapter.features``)."""

    #: the vision tower prepends a CLS token whose attention ranks patches (CLIP; not SigLIP or Qwen-VL)
    cls_token: bool
    patch_grid: PatchGrid
    tiles: Tiles
    rope: Rope
    #: takes ``videos=`` (the adapter's video path)
    video: bool
    tower_attention: TowerAttention
    #: the tower was trained with a text tower whose embeddings score its patches (CLIP, SigLIP)
    paired_text_tower: bool
    #: a video's frames: "one_item" = one vision item (one grid over time); "item_per_frame" = every frame
    #: group its own item with its own timestamp span (Qwen3-VL; a method declaring ``video_join`` gets each
    #: video's items joined into one by the session, which meets its ``VIDEO_ONE_ITEM``:
    #: ``capabilities.unmet_need``)
    video_items: VideoItemsLayout = "one_item"


class Need(enum.Enum):
    """What a method may need of the model. The value is what the refusal says the method needs."""

    CLS = "a CLS token in the vision tower"
    UNTILED = "one tower input per image (no anyres tiles re-packed after the projector)"
    SQUARE_GRID = "one fixed square patch grid per image"
    WHOLE_TILES = "anyres tiles kept whole (no downscale across tiles)"
    ROPE_1D = "1-D RoPE positions"
    GLOBAL_TOWER_ATTENTION = "a vision tower whose layers attend over the whole image (no windows)"
    DYNAMIC_GRID = "per-image dynamic-resolution grids (Qwen-VL's grid_thw merged units)"
    PAIRED_TEXT_TOWER = "a vision tower with a paired text tower (CLIP, SigLIP)"
    VIDEO = "video input"
    VIDEO_ONE_ITEM = "a video as one vision item (all its frames in one grid)"


def has(features: ModelFeatures, need: Need) -> bool:
    """Whether a model with ``features`` meets ``need``."""
    return {
        Need.CLS: features.cls_token,
        Need.UNTILED: features.tiles == "none",
        Need.SQUARE_GRID: features.patch_grid == "square",
        Need.WHOLE_TILES: features.tiles != "anyres_max",
        Need.ROPE_1D: features.rope == "1d",
        Need.GLOBAL_TOWER_ATTENTION: features.tower_attention == "global",
        Need.DYNAMIC_GRID: features.patch_grid == "dynamic",
        Need.PAIRED_TEXT_TOWER: features.paired_text_tower,
        Need.VIDEO: features.video,
        Need.VIDEO_ONE_ITEM: features.video and features.video_items == "one_item",
    }[need]


def what_it_has(features: ModelFeatures, need: Need) -> str:
    """What a model with ``features`` has instead of ``need`` (quoted in refusals)."""
    if need is Need.CLS:
        return "its vision tower has no CLS token"
    if need in (Need.UNTILED, Need.WHOLE_TILES):
        return {
            "anyres": "it packs each image's anyres tiles into an unpadded, newline-separated mosaic after the "
            "projector",
            "anyres_max": "it packs each image's anyres tiles into an unpadded, newline-separated mosaic after the "
            "projector, bilinearly downscaled across tiles",
        }[features.tiles]
    if need is Need.SQUARE_GRID:
        return "it resizes each image to its own patch grid (dynamic resolution)"
    if need is Need.ROPE_1D:
        return "its LLM takes multimodal RoPE positions (temporal, height, width)"
    if need is Need.GLOBAL_TOWER_ATTENTION:
        return "its vision tower attends within windows"
    if need is Need.DYNAMIC_GRID:
        return "its images are fixed square grids"
    if need is Need.VIDEO or (need is Need.VIDEO_ONE_ITEM and not features.video):
        return "it takes no video input"
    if need is Need.VIDEO_ONE_ITEM:
        return "every frame group of a video is its own vision item with its own timestamp span"
    return "its vision tower has no paired text tower"


#: checked in this order, so the most specific reason comes first; a model without video input is refused a
#: video method for that before anything else (its other needs, e.g. FastVID's ``siglip_head`` route, cannot help)
NEED_ORDER = (Need.CLS, Need.VIDEO, *(n for n in Need if n not in (Need.CLS, Need.VIDEO)))
