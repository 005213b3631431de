"""What an lmms-eval task's ``doc_to_visual`` hands the mmfast plugin, sorted into a request's images
and its video (:func:`sort_visuals`), and the video opened with the plugin's frame sampling
(:class:`FrameSampling`, :func:`open_request_video`).

A visual is

- a PIL image, or a path to an image file: an image;
- a path (``str`` or ``PathLike``) to a video file (``.mp4``, ``.mkv``, ... :data:`mmfast.video.VIDEO_SUFFIXES`;
  lmms-eval's video tasks, e.g. Video-MME and MVBench, return these) or to a directory of frame images: a video;
- a dict ``{"type": "video", "path": ...}`` (lmms-eval's form; ``"url"`` is read as ``"path"``) with,
  optionally, ``"sampling": {"num_frames", "fps", "video_fps"}``, the task's own frame sampling
  (``mmfast lmms-task`` writes it for ``video_pope``, so lmms-eval samples the frames ``mmfast eval``
  samples); ``video_start`` / ``video_end`` (a time window) are refused.

A request takes at most one video, placed before its images (the chat templates put a video first); a
request listing an image before its video, or two videos, is refused, as is a video on a family
without video input, before any compute.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image

from ..errors import InputError
from ..inputs import VideoClip
from ..video import FRAME_SUFFIXES, VIDEO_SUFFIXES, FrameRule, VideoSampling, open_video, sample_indices, source_frames

_DICT_KEYS = frozenset({"type", "path", "url", "sampling"})
_SAMPLING_KEYS = ("num_frames", "fps", "video_fps")


@dataclass(frozen=True)
class FrameSampling:
    """The plugin's frame sampling (``--model_args``, as lmms-eval's Qwen-VL models spell them).

    ``max_num_frames``: at most this many frames per video, uniformly (a shorter video keeps every
    frame; on a family that samples frames in groups, Qwen-VL's pairs, the largest whole number of groups
    within it); ``fps``: frames per second of the source instead, capped at ``max_num_frames``;
    ``video_fps``: the frame rate of frame directories (video files carry their own).
    """

    max_num_frames: int = 32
    fps: float | None = None
    video_fps: float | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_frames", "fps", "video_fps"):
            v = getattr(self, name)
            if v is None and name != "max_num_frames":
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise InputError(f"--model_args {name}={v!r}: a positive number is needed")
        if int(self.max_num_frames) != self.max_num_frames:
            raise InputError(f"--model_args max_num_frames={self.max_num_frames!r}: a whole number is needed")

    def for_source(self, total: int, rate: float | None, rule: FrameRule, what: str) -> VideoSampling:
        """The sampling of a video of ``total`` frames at ``rate`` frames per second (None: unknown)."""
        if self.fps is not None:
            if rate is None:
                raise InputError(
                    f"{what}: fps={self.fps} sampling needs the video's frame rate, which a frame directory does not "
                    "carry; pass --model_args video_fps=<its rate>, or sample with max_num_frames= alone"
                )
            by_rate = VideoSampling(fps=self.fps, video_fps=rate)
            if len(sample_indices(total, by_rate, rule, what)) <= self.max_num_frames:
                return by_rate
        elif total <= self.max_num_frames:
            return VideoSampling(video_fps=rate)  # every frame
        cap = int(self.max_num_frames) // rule.multiple * rule.multiple  # the processor rounds to its multiple
        if cap < 1:
            raise InputError(
                f"{what}: max_num_frames={self.max_num_frames} is below this model's frame multiple "
                f"({rule.multiple}: it samples frames in groups of that many); pass --model_args "
                f"max_num_frames={rule.multiple} or more"
            )
        return VideoSampling(num_frames=cap, video_fps=rate)


@dataclass(frozen=True)
class VideoRef:
    """A request's video before it is opened: the file or frame directory, and the task's own sampling."""

    source: Path
    sampling: VideoSampling | None = None  # None: the plugin's FrameSampling


@dataclass
class RequestVisuals:
    """A request's images (PIL images or image paths, in order) and its video."""

    images: list[Any] = field(default_factory=list)
    video: VideoRef | None = None


def _video_dict(visual: dict, what: str) -> VideoRef:
    if "video_start" in visual or "video_end" in visual:
        raise InputError(
            f"{what} asks for a time window of a video (video_start / video_end); mmfast takes whole videos: cut "
            "the clip first (ffmpeg -ss START -to END -i IN OUT)"
        )
    if visual.get("type") != "video" or set(visual) - _DICT_KEYS:
        raise InputError(
            f"{what} is a dict with type {visual.get('type')!r} and keys {sorted(visual)}; mmfast reads video dicts "
            "{'type': 'video', 'path': ..., 'sampling': {...}} (or a plain path)"
        )
    source = visual.get("path", visual.get("url"))
    if not isinstance(source, (str, os.PathLike)):
        raise InputError(f"{what} is a video dict without a 'path' (or 'url'); give the video file or frame directory")
    sampling = visual.get("sampling")
    if sampling is None:
        return VideoRef(_local(source, what))
    if not isinstance(sampling, dict) or set(sampling) - set(_SAMPLING_KEYS):
        raise InputError(f"{what}: 'sampling' must be a dict of {', '.join(_SAMPLING_KEYS)}, got {sampling!r}")
    return VideoRef(_local(source, what), VideoSampling(**{k: sampling.get(k) for k in _SAMPLING_KEYS}))


def _local(source: str | os.PathLike, what: str) -> Path:
    if isinstance(source, str) and "://" in source:
        raise InputError(f"{what} {source!r} is a URL; mmfast reads local files: download the video first")
    return Path(source)


def sort_visuals(visuals: Any, what: str) -> RequestVisuals:
    """The request's images and video (nothing is decoded yet; see the module docstring)."""
    out = RequestVisuals()
    if isinstance(visuals, (str, os.PathLike, dict, Image.Image)):  # one visual, not in a list
        visuals = [visuals]
    for k, v in enumerate(visuals or []):
        here = f"{what}, visual {k}"
        if isinstance(v, Image.Image):
            out.images.append(v)
            continue
        if isinstance(v, dict):
            ref = _video_dict(v, here)
        elif isinstance(v, (str, os.PathLike)):
            path = _local(v, here)
            suffix = path.suffix.lower()
            if path.is_dir() or suffix in VIDEO_SUFFIXES:
                ref = VideoRef(path)
            elif suffix in FRAME_SUFFIXES:
                out.images.append(path)
                continue
            else:
                raise InputError(
                    f"{here} {str(path)!r} is neither an image file, a video file "
                    f"({', '.join(sorted(VIDEO_SUFFIXES))}) "
                    "nor a directory of frames"
                )
        else:
            raise InputError(
                f"{here} is a {type(v).__name__}; mmfast takes PIL images, image or video file paths, frame "
                "directories and {'type': 'video', 'path': ...} dicts"
            )
        if out.video is not None:
            raise InputError(f"{here} is a second video; mmfast takes one video per request")
        if out.images:
            raise InputError(
                f"{here} is a video listed after an image; the chat templates put a request's video before its "
                "images, so this order cannot be kept: list the video first"
            )
        out.video = ref
    return out


def open_request_video(ref: VideoRef, sampling: FrameSampling, rule: FrameRule, what: str) -> VideoClip:
    """The request's video with the task's own sampling, else the plugin's (``sampling``)."""
    if ref.sampling is not None:
        return open_video(ref.source, ref.sampling, rule, what)
    total, rate = source_frames(ref.source, what)
    chosen = sampling.for_source(total, rate if rate is not None else sampling.video_fps, rule, what)
    return open_video(ref.source, chosen, rule, what)
