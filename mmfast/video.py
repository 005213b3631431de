"""Video input: :func:`open_video` turns what a caller passes as one video into a :class:`VideoClip`
of sampled RGB frames, with clear errors before any compute.

A video is a list of frames (PIL images or image paths), a numpy array ``[T, H, W, 3]`` (uint8), a
directory of frame images (read in sorted file-name order), or a video file (``.mp4``, ``.mkv``,
``.webm``, ... :data:`VIDEO_SUFFIXES`), decoded with PyAV (``pip install 'mmfast[video]'``;
:mod:`mmfast._video_files`): its first video stream's frame count and average rate are read, the
indices are sampled by the rule below (the rate is ``video_fps`` unless the caller gives one), and only
the sampled frames are kept while the file is decoded. Without PyAV, decode one to frames first
(``ffmpeg -i clip.mp4 frames/%05d.png``) and pass the directory.

Sampling follows transformers' video processors (``sample_frames``), but only when asked (Qwen3-VL's processor samples
at 2 fps by default; pass ``fps=2`` to match it):

* without ``num_frames`` or ``fps`` every frame is kept;
* ``num_frames=n``: ``n`` frames uniformly, indices ``arange(0, T, T / n).int()``; the Qwen2-VL /
  Qwen2.5-VL processors first round ``n`` to a multiple of the temporal patch size (2);
  ``Qwen3VLVideoProcessor`` keeps ``n`` as asked and takes ``linspace(0, T - 1, n).round()`` (the last
  frame included; an odd count is padded by repeating the last frame, as for every Qwen-VL video);
* ``fps=f``: ``f`` frames per second of the source, which needs the source's rate ``video_fps``
  (a frame list carries none; a video file's is its stream's average rate): ``int(T / video_fps * f)``
  frames; the Qwen-VL processors clamp that to [min_frames, max_frames] (Qwen2-VL / Qwen2.5-VL also
  floor it to a multiple of the temporal patch size; Qwen3-VL spreads it with ``linspace`` as above).

``video_fps`` is also what the models' time axis reads (Qwen2.5-VL's temporal position spacing,
Qwen3-VL's frame timestamps); without it the processors assume 24 frames per second, as
transformers does for frames without metadata.

:func:`with_videos` puts the videos' vision items (``VLMAdapter.video_items``) into a prepared batch.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from PIL import Image

from ._video_files import VIDEO_SUFFIXES, decode_frames, is_video_file, probe_video_file
from .errors import InputError
from .inputs import PreparedBatch, VideoClip, VisionItem, open_image

if TYPE_CHECKING:
    from .models.base import VideoItems, VLMAdapter

#: file suffixes read as frames from a directory
FRAME_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".webp", ".gif", ".tif", ".tiff"})


@dataclass(frozen=True)
class FrameRule:
    """How a family's processor rounds a sampled frame count (Qwen-VL: to its temporal patch size)."""

    multiple: int = 1  # sampled counts are multiples of this
    min_frames: int = 1  # fps sampling: at least this many
    max_frames: int | None = None  # fps sampling: at most this many
    #: how n indices spread over T frames: "arange" (``arange(0, T, T / n).int()``, Qwen2-VL's and the base
    #: processors') or "linspace" (``linspace(0, T - 1, n).round()``, ``Qwen3VLVideoProcessor``)
    spacing: Literal["arange", "linspace"] = "arange"


@dataclass(frozen=True)
class VideoSampling:
    """A call's sampling request (``generate(..., num_frames=, fps=, video_fps=)``)."""

    num_frames: int | None = None
    fps: float | None = None
    video_fps: float | None = None

    def __post_init__(self) -> None:
        if self.num_frames is not None and self.fps is not None:
            raise InputError("num_frames and fps both given; pass one of them (they are two ways to sample frames)")
        for name in ("num_frames", "fps", "video_fps"):
            v = getattr(self, name)
            if v is not None and (
                isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or not math.isfinite(v)
            ):
                raise InputError(f"{name} must be a positive finite number, got {v!r}")
        if self.num_frames is not None and int(self.num_frames) != self.num_frames:
            raise InputError(f"num_frames must be a whole number, got {self.num_frames!r}")


def sample_indices(
    total: int, sampling: VideoSampling, rule: FrameRule = FrameRule(), what: str = "video"
) -> list[int]:
    """Indices of the frames to keep out of ``total``, as transformers' ``sample_frames`` picks them."""
    n: int | None = None
    if sampling.num_frames is not None:
        n = round(int(sampling.num_frames) / rule.multiple) * rule.multiple
    elif sampling.fps is not None:
        if sampling.video_fps is None:
            raise InputError(
                f"{what}: fps={sampling.fps} sampling needs the source's frame rate; pass video_fps= (frames per "
                "second of the frames given) or sample with num_frames="
            )
        limit = min(rule.max_frames or total, total)
        top = math.floor(limit / rule.multiple) * rule.multiple
        want = total / sampling.video_fps * sampling.fps
        if rule.multiple > 1 or rule.max_frames is not None:  # the Qwen-VL rule (Qwen3-VL: multiple 1)
            n = math.floor(min(max(want, rule.min_frames), top, total) / rule.multiple) * rule.multiple
        else:
            n = int(want)
    if n is None:
        return list(range(total))
    if n < 1:
        raise InputError(
            f"{what}: sampling leaves no frame ({total} frame(s), {sampling}); ask for more frames "
            f"(the count is rounded to a multiple of {rule.multiple})"
        )
    if n > total:
        rounded = sampling.num_frames is not None and n != sampling.num_frames
        how = f" (num_frames={sampling.num_frames} rounded to a multiple of {rule.multiple})" if rounded else ""
        raise InputError(
            f"{what}: asked for {n} frames{how} but the video has {total}; lower num_frames / fps or pass no "
            "sampling (all frames are used)"
        )
    if rule.spacing == "linspace":
        return np.linspace(0, total - 1, n).round().astype(int).tolist()
    return torch.arange(0, total, total / n).int().tolist()


def frame_files(directory: Path) -> list[Path]:
    """The frame images of a directory, in the order they are read as a video (sorted file names;
    hidden files and files without a :data:`FRAME_SUFFIXES` suffix are left out)."""
    return sorted(p for p in directory.iterdir() if p.suffix.lower() in FRAME_SUFFIXES and not p.name.startswith("."))


def _frames_of(video: Any, what: str) -> list[Any]:
    """The frames (PIL images, paths or arrays) a video input holds, in order."""
    if isinstance(video, np.ndarray):
        if video.ndim != 4 or video.shape[-1] != 3:
            raise InputError(
                f"{what} is an array of shape {tuple(video.shape)}; a video array is [T, H, W, 3] (RGB frames)"
            )
        if video.dtype != np.uint8:
            raise InputError(f"{what} is a {video.dtype} array; pass uint8 RGB frames (0..255)")
        return list(video)
    if isinstance(video, (str, os.PathLike)):
        path = Path(video)
        if path.is_dir():
            files = frame_files(path)
            if not files:
                raise InputError(
                    f"{what} {str(path)!r} is a directory without frame images ({', '.join(sorted(FRAME_SUFFIXES))})"
                )
            return files
        raise InputError(
            f"{what} {str(path)!r} is not a directory of frames nor a video file "
            f"({', '.join(sorted(VIDEO_SUFFIXES))}); "
            "pass a video file, a directory, a frame list or an array"
        )
    if isinstance(video, (list, tuple)):
        return list(video)
    raise InputError(
        f"{what} is a {type(video).__name__}; pass a list of frames (PIL images or paths), a uint8 array "
        "[T, H, W, 3], a directory of frame images or a video file"
    )


def source_frames(video: Any, what: str = "video") -> tuple[int, float | None]:
    """The frame count of ``video`` before sampling, and its frame rate where it records one (a video
    file's average rate; None for frames). Reads a file's header, decodes nothing."""
    if isinstance(video, VideoClip):
        return video.total_frames, video.fps
    if is_video_file(video):
        info = probe_video_file(Path(video), what)
        return info.total_frames, info.fps
    return len(_frames_of(video, what)), None


def sample_source(
    total: int, rate: float | None, sampling: VideoSampling, rule: FrameRule, what: str
) -> tuple[list[int], VideoSampling]:
    """The indices ``sampling`` keeps of a source of ``total`` frames at ``rate`` frames per second (its own rate
    stands in for a missing ``video_fps``), and the sampling with that rate."""
    if sampling.video_fps is None and rate is not None:
        sampling = dataclasses.replace(sampling, video_fps=rate)
    return sample_indices(total, sampling, rule, what), sampling


def open_video(
    video: Any, sampling: VideoSampling = VideoSampling(), rule: FrameRule = FrameRule(), what: str = "video"
) -> VideoClip:
    """The sampled frames of one video (see the module docstring for the accepted forms)."""
    if isinstance(video, VideoClip):
        return video
    if is_video_file(video):
        path = Path(video)
        info = probe_video_file(path, what)
        keep, sampling = sample_source(info.total_frames, info.fps, sampling, rule, what)
        return _clip(dict(zip(keep, decode_frames(path, keep, what))), keep, info.total_frames, sampling, what)
    frames = _frames_of(video, what)
    if not frames:
        raise InputError(f"{what} has no frames; pass at least one frame")
    keep = sample_indices(len(frames), sampling, rule, what)
    return _clip({i: frames[i] for i in keep}, keep, len(frames), sampling, what)


def _clip(frames: dict[int, Any], keep: list[int], total: int, sampling: VideoSampling, what: str) -> VideoClip:
    """The clip of the sampled ``frames`` (source index -> PIL image, path or array), checked and opened."""
    opened = []
    for i in keep:
        f = frames[i]
        if isinstance(f, np.ndarray) and (f.ndim != 3 or f.shape[-1] != 3 or f.dtype != np.uint8):
            raise InputError(
                f"{what}, frame {i} is a {f.dtype} array of shape {tuple(f.shape)}, not a uint8 [H, W, 3] frame "
                "(with a single prompt string, videos= is that prompt's one video; pass a list of prompts for "
                "one video per prompt)"
            )
        if not isinstance(f, (Image.Image, np.ndarray, str, os.PathLike)):
            raise InputError(
                f"{what}, frame {i} is a {type(f).__name__}; frames are PIL images, image paths or uint8 arrays"
            )
        try:
            im = Image.fromarray(f) if isinstance(f, np.ndarray) else f
            opened.append(open_image(im))
        except InputError as exc:
            raise InputError(f"{what}, frame {i}: {exc}") from None
    sizes = {im.size for im in opened}
    if len(sizes) > 1:
        raise InputError(
            f"{what} has frames of different sizes ({', '.join(f'{w}x{h}' for w, h in sorted(sizes))}); "
            "a video's frames must share one size: resize them first"
        )
    return VideoClip(opened, keep, total, None if sampling.video_fps is None else float(sampling.video_fps))


def _pad_rows(rows: list[torch.Tensor]) -> torch.Tensor:
    """Per-item pixel rows ([1, n_i, ...]) zero-padded on dim 1 to the longest and stacked: [n, max n_i, ...]."""
    longest = max(r.shape[1] for r in rows)
    out = rows[0].new_zeros(len(rows), longest, *rows[0].shape[2:])
    for i, r in enumerate(rows):
        out[i, : r.shape[1]] = r[0]
    return out


def with_videos(
    batch: PreparedBatch, clips: list[VideoClip | None], vids: list[VideoItems | None], adapter: VLMAdapter
) -> PreparedBatch:
    """``batch`` (images only) with the videos' items (``vids[b]``, from ``VLMAdapter.video_items``) put
    in: every sample's items in its slot order, pixel rows padded to one tensor."""
    image_id, video_id = adapter.image_token_id, adapter.video_token_id
    rows, sizes, items, owner = [], [], [], []
    k = 0  # next image row
    for b, ids in enumerate(batch.token_ids):
        j = 0  # next item of the sample's video
        for t in ids:
            if t == image_id:
                rows.append(batch.pixel_values[k : k + 1])
                sizes.append(batch.image_sizes[k : k + 1])
                items.append(VisionItem())
                k += 1
            elif t == video_id:
                v = vids[b]
                rows.append(v.pixels[j])
                sizes.append(v.sizes[j].to(batch.image_sizes.dtype if batch.image_sizes is not None else torch.long))
                items.append(v.items[j])
                j += 1
            else:
                continue
            owner.append(b)
    return dataclasses.replace(
        batch,
        pixel_values=_pad_rows(rows),
        image_sizes=torch.cat(sizes),
        image_owner=owner,
        items=items,
        videos=list(clips),
    )
