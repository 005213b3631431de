"""Video frames -> the pixel tensors the models' video paths take, without torchvision.

transformers' video processors (``Qwen2VLVideoProcessor``, ``LlavaOnevisionVideoProcessor``, ...) are
built on torchvision, which mmfast does not install (it does not import beside the CPU torch wheel).
This module reproduces what they output, on PIL and torch:

* Qwen-VL (``pixel_values_videos`` [P, C * T * p * p], ``video_grid_thw`` (t, h, w)): each frame is
  resized to ``smart_resize(H, W, factor=patch_size * merge_size, min_pixels=size.shortest_edge,
  max_pixels=size.longest_edge)`` (the same size for all frames of a video; Qwen3-VL's processor bounds
  the whole video's pixels, t x H x W, instead: :func:`qwen3_video_size`), rescaled and normalised;
  the frame count is padded to a multiple of ``temporal_patch_size`` by repeating the last frame, and
  the frames are cut into patches in the processor's order (the image processors' layout with real
  frames on the temporal axis instead of a repeated image).
* LLaVA-OneVision (``pixel_values_videos`` [F, 3, S, S]): each frame resized to ``size`` (the tower's
  input size), rescaled and normalised.

Deviations: frames are resized with PIL's resampling (bicubic, as the processors' ``resample``), not
torchvision's tensor resize: pixel values differ slightly where a frame is actually resized (frames
already at the target size are identical). Qwen2-VL's optional ``cap_pixels_per_frame`` (off by
default in 5.17..5.24) is not applied.

Settings come from the processor's video processor when it has one, else the checkpoint's
``video_preprocessor_config.json``, else the image processor (same normalisation, patch and merge
sizes): :func:`video_settings`. A video config's ``min_pixels`` / ``max_pixels`` override its ``size`` edges, as
``Qwen2VLVideoProcessor`` lets them (Qwen3-VL's video processor reads ``size`` alone).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from huggingface_hub import try_to_load_from_cache
from PIL import Image

from .. import compat

logger = logging.getLogger(__name__)

_KEYS = ("image_mean", "image_std", "rescale_factor", "resample", "size", "patch_size", "temporal_patch_size")
_KEYS += ("merge_size", "min_frames", "max_frames", "min_pixels", "max_pixels")


@dataclass(frozen=True)
class VideoSettings:
    """What the video processor does to frames (read from the checkpoint's processor files)."""

    mean: tuple[float, ...]
    std: tuple[float, ...]
    rescale: float
    resample: int  # PIL resampling filter
    size: dict[str, int]  # Qwen-VL: shortest_edge / longest_edge (pixels); OneVision: height / width
    patch_size: int = 14
    temporal_patch_size: int = 1
    merge_size: int = 1
    min_frames: int = 4
    max_frames: int = 768
    source: str = "image processor"


def _attrs(obj: Any) -> dict[str, Any]:
    return {k: getattr(obj, k) for k in _KEYS if getattr(obj, k, None) is not None}


def _checkpoint_file(checkpoint: str, name: str) -> Path | None:
    """``name`` of a local checkpoint directory, or of a hub checkpoint in the local cache (no download)."""
    path = Path(checkpoint)
    if path.is_dir():
        return path / name if (path / name).is_file() else None
    try:
        found = try_to_load_from_cache(repo_id=checkpoint, filename=name)
    except ValueError:  # not a hub id (an in-memory model's class name)
        return None
    return Path(found) if isinstance(found, str) else None


def _checkpoint_video_config(checkpoint: str) -> tuple[dict[str, Any], str] | None:
    """The video processor's saved settings: ``video_preprocessor_config.json``, or the
    ``video_processor`` entry of ``processor_config.json`` (as transformers 5 saves processors)."""
    for name in ("video_preprocessor_config.json", "processor_config.json"):
        f = _checkpoint_file(checkpoint, name)
        if f is None:
            continue
        data = json.loads(f.read_text())
        data = data.get("video_processor") if name == "processor_config.json" else data
        if isinstance(data, dict) and data:
            return data, str(f)
    return None


def video_settings(processor: Any, checkpoint: str | None = None) -> VideoSettings:
    """The frame settings of ``processor`` (see the module docstring for the order they are read in)."""
    conf: dict[str, Any] = {}
    source = "image processor"
    kind = ""  # the video processor's class, where known
    if getattr(processor, "video_processor", None) is not None:
        conf, source = _attrs(processor.video_processor), "video processor"
        kind = type(processor.video_processor).__name__
    elif checkpoint is not None:
        found = _checkpoint_video_config(checkpoint)
        if found is not None:
            conf, source = {k: v for k, v in found[0].items() if k in _KEYS}, found[1]
            kind = str(found[0].get("video_processor_type") or "")
    # Qwen2VLVideoProcessor (Qwen2-VL, Qwen2.5-VL) lets its min_pixels / max_pixels override size's edges (its
    # backward compatibility); Qwen3VLVideoProcessor reads size alone
    override = conf if not kind.startswith("Qwen3VL") else {}
    base = _attrs(processor.image_processor)
    conf = {**base, **conf}
    size = dict(conf.get("size") or {})
    for key, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
        if override.get(key) is not None:
            size[edge] = int(override[key])
        elif edge not in size and conf.get(key) is not None:
            size[edge] = int(conf[key])
    resample = conf.get("resample", Image.BICUBIC)
    return VideoSettings(
        mean=tuple(float(x) for x in conf["image_mean"]),
        std=tuple(float(x) for x in conf["image_std"]),
        rescale=float(conf.get("rescale_factor", 1 / 255)),
        resample=int(getattr(resample, "value", resample)),
        size={k: int(v) for k, v in size.items() if v is not None},
        patch_size=int(conf.get("patch_size", 14)),
        temporal_patch_size=int(conf.get("temporal_patch_size", 1)),
        merge_size=int(conf.get("merge_size", 1)),
        min_frames=int(conf.get("min_frames", 4)),
        max_frames=int(conf.get("max_frames", 768)),
        source=source,
    )


def frames_tensor(frames: list[Image.Image], height: int, width: int, s: VideoSettings) -> torch.Tensor:
    """[F, 3, height, width] float32: frames resized (PIL, ``s.resample``), rescaled and normalised."""
    arr = np.stack(
        [
            np.asarray(f if f.size == (width, height) else f.resize((width, height), Image.Resampling(s.resample)))
            for f in frames
        ]
    )  # [F, H, W, 3] uint8
    x = torch.from_numpy(arr).permute(0, 3, 1, 2).float() * s.rescale
    mean = torch.tensor(s.mean).view(1, -1, 1, 1)
    std = torch.tensor(s.std).view(1, -1, 1, 1)
    return (x - mean) / std


def qwen2_video_size(n_frames: int, height: int, width: int, s: VideoSettings) -> tuple[int, int]:
    """``Qwen2VLVideoProcessor``'s frame size: ``smart_resize`` of one frame (its pixels within
    [shortest_edge, longest_edge])."""
    p, m = s.patch_size, s.merge_size
    return compat.qwen_smart_resize(
        height, width, factor=p * m, min_pixels=s.size["shortest_edge"], max_pixels=s.size["longest_edge"]
    )


def qwen3_video_size(n_frames: int, height: int, width: int, s: VideoSettings) -> tuple[int, int]:
    """``Qwen3VLVideoProcessor``'s frame size (:func:`~mmfast.compat.qwen3_video_smart_resize`): the *whole
    video's* pixels within [shortest_edge, longest_edge]. Deviation: a one-frame video is sized as two frames
    (the processor raises on it). Settings read from the image processor (no video processor config) bound
    one frame, as an image's pixels (:func:`qwen2_video_size`)."""
    if s.source == "image processor":
        return qwen2_video_size(n_frames, height, width, s)
    tf = s.temporal_patch_size
    return compat.qwen3_video_smart_resize(
        max(n_frames, tf),
        height,
        width,
        temporal_factor=tf,
        factor=s.patch_size * s.merge_size,
        min_pixels=s.size["shortest_edge"],
        max_pixels=s.size["longest_edge"],
    )


def qwen_video_patches(
    frames: list[Image.Image], s: VideoSettings, size: Callable[..., tuple[int, int]] = qwen2_video_size
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Qwen-VL's ``pixel_values_videos`` rows of one video ([t * h * w, 3 * T * p * p]) and its
    ``video_grid_thw`` (t, h, w) in patches, as ``Qwen2VLVideoProcessor`` makes them (``size``: the
    frame-size rule, :func:`qwen2_video_size` or Qwen3-VL's :func:`qwen3_video_size`)."""
    w0, h0 = frames[0].size
    p, m, tp = s.patch_size, s.merge_size, s.temporal_patch_size
    height, width = size(len(frames), h0, w0, s)
    x = frames_tensor(frames, height, width, s)  # [F, C, H, W]
    if pad := -x.shape[0] % tp:  # repeat the last frame up to a multiple of the temporal patch
        x = torch.cat([x, x[-1:].expand(pad, -1, -1, -1)])
    f, c = x.shape[:2]
    t, gh, gw = f // tp, height // p, width // p
    patches = x.view(t, tp, c, gh // m, m, p, gw // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return patches.reshape(t * gh * gw, c * tp * p * p), (t, gh, gw)


def qwen3_timestamps(indices: list[int], fps: float | None, temporal_patch_size: int) -> list[float]:
    """Seconds of each frame group, as ``Qwen3VLProcessor._calculate_timestamps`` computes them (the
    mean of the group's first and last frame; 24 fps when the rate is unknown)."""
    idx = list(indices)
    if len(idx) % temporal_patch_size:
        idx += [idx[-1]] * (temporal_patch_size - len(idx) % temporal_patch_size)
    secs = [i / (fps or 24) for i in idx]
    return [(secs[i] + secs[i + temporal_patch_size - 1]) / 2 for i in range(0, len(secs), temporal_patch_size)]
