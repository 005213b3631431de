"""Video container files (mp4, mkv, webm, ...) read with PyAV (the ``av`` package, which transformers'
video utilities and lmms-eval use): the first video stream's frame count and average rate
(:func:`probe_video_file`), and its sampled frames decoded in one pass that keeps only those
(:func:`decode_frames`), as transformers' ``read_video_pyav`` does.

PyAV is optional (``pip install 'mmfast[video]'``); without it a video file is refused before any
compute, with the frames-directory alternative. The frame count is the stream header's; a container
that records none (Matroska, WebM) has its packets counted (demuxed, not decoded).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from .errors import InputError

#: video container suffixes decoded with PyAV
VIDEO_SUFFIXES = frozenset({".mp4", ".avi", ".mov", ".mkv", ".webm", ".m4v", ".mpg", ".mpeg"})


def is_video_file(video: Any) -> bool:
    """Whether ``video`` names a video container file (by its suffix, :data:`VIDEO_SUFFIXES`)."""
    if not isinstance(video, (str, os.PathLike)):
        return False
    path = Path(video)
    return path.suffix.lower() in VIDEO_SUFFIXES and not path.is_dir()


@dataclass(frozen=True)
class VideoFileInfo:
    """What a container's first video stream says about itself."""

    total_frames: int
    fps: float | None  # the stream's average frame rate; None when the container records none


def _extract_hint(path: Path) -> str:
    return f"ffmpeg -i {path.name} frames/%05d.png, then pass the frames directory"


def _av(path: Path, what: str) -> Any:
    """The ``av`` module, or the refusal that names how to get it."""
    try:
        import av
    except ImportError:
        raise InputError(
            f"{what} {str(path)!r} is a video file, which mmfast decodes with PyAV, not installed here: "
            f"pip install 'mmfast[video]' (or pip install av), or extract its frames first ({_extract_hint(path)})"
        ) from None
    return av


@contextmanager
def _video_stream(path: Path, what: str) -> Iterator[tuple[Any, Any]]:
    """The open container and its first video stream; errors name the file."""
    if not path.is_file():
        raise InputError(f"{what} {str(path)!r} not found (check the path or the data root)")
    av = _av(path, what)
    try:
        container = av.open(str(path))
    except (av.error.FFmpegError, OSError) as exc:
        raise InputError(
            f"{what} {str(path)!r} cannot be read as a video ({exc}); is the file corrupt or not a video? "
            f"Re-encode it, or extract its frames ({_extract_hint(path)})"
        ) from None
    try:
        if not container.streams.video:
            raise InputError(
                f"{what} {str(path)!r} has no video stream (an incomplete file, or audio only); re-encode it or "
                f"extract its frames ({_extract_hint(path)})"
            )
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        yield container, stream
    except av.error.FFmpegError as exc:
        raise InputError(
            f"{what} {str(path)!r} cannot be decoded ({exc}); is the file corrupt? Re-encode it, or extract its "
            f"frames ({_extract_hint(path)})"
        ) from None
    finally:
        container.close()


def probe_video_file(path: Path, what: str = "video") -> VideoFileInfo:
    """The frame count and average rate of ``path``'s first video stream; refuses a file without frames."""
    with _video_stream(path, what) as (container, stream):
        total = int(stream.frames or 0)
        if total == 0:  # the container records no count: count the stream's packets (no decoding)
            total = sum(1 for packet in container.demux(stream) if packet.size)
        rate = stream.average_rate
    if total == 0:
        raise InputError(f"{what} {str(path)!r} has no frames; pass a video with at least one frame")
    return VideoFileInfo(total, float(rate) if rate else None)


def decode_frames(path: Path, indices: Sequence[int], what: str = "video") -> list[Image.Image]:
    """The frames at ``indices`` (ascending) of ``path``'s first video stream, RGB, decoded in order;
    only those frames are kept. Refuses a file that decodes fewer frames than its header says."""
    want = set(indices)
    last = max(want)
    frames: dict[int, Image.Image] = {}
    decoded = 0
    with _video_stream(path, what) as (container, stream):
        for i, frame in enumerate(container.decode(stream)):
            decoded = i + 1
            if i in want:
                frames[i] = frame.to_image()  # rgb24
            if i >= last:
                break
    if len(frames) != len(want):
        raise InputError(
            f"{what} {str(path)!r} decodes {decoded} frame(s), fewer than its header says (frame "
            f"{min(want - frames.keys())} is missing): the file is truncated or its header is wrong; re-encode it, "
            f"or extract its frames ({_extract_hint(path)})"
        )
    return [frames[i] for i in indices]
