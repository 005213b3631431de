"""Video files (mp4, mkv, ...) as video input, decoded with PyAV (:mod:`mmfast._video_files`).

Small clips are written here with PyAV itself (one solid colour per frame, so each decoded frame says
which source frame it is). A file must give the frames, sampled indices and answers that the same
frames given as a list give; files PyAV cannot read, and a missing PyAV, are refused before compute
with an error naming the file and the fix. Only the tests that decode need ``av``; the refusal
without it runs everywhere (its absence is simulated).
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
from PIL import Image

import mmfast
from mmfast.errors import InputError
from mmfast.video import FrameRule, VideoSampling, open_video, sample_indices, source_frames

N, RATE, SIDE = 12, 6, 32
QWEN_RULE = FrameRule(multiple=2, min_frames=4, max_frames=768)  # the Qwen-VL processors' defaults


def _colour(i: int) -> tuple[int, int, int]:
    return (20 * i) % 256, 255 - (20 * i) % 256, (50 * i) % 256


def _write(path, n: int = N, codec: str = "mpeg4", rate: int = RATE, options: dict | None = None):
    """A clip of ``n`` solid-colour frames (frame i has :func:`_colour` ``(i)``); returns the written frames."""
    av = pytest.importorskip("av")
    frames = [np.full((SIDE, SIDE, 3), _colour(i), np.uint8) for i in range(n)]
    with av.open(str(path), "w", options=options or {}) as container:
        stream = container.add_stream(codec, rate=rate)
        stream.width = stream.height = SIDE
        stream.pix_fmt = "yuv420p"
        for a in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(a, format="rgb24")))
        container.mux(stream.encode())
    return frames


def _decode_all(path) -> list[np.ndarray]:
    """Every frame of ``path``, decoded by PyAV directly (the reference the sampled frames index)."""
    import av

    with av.open(str(path)) as container:
        return [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    """An mp4 whose header records its frame count, and a Matroska file whose header does not."""
    pytest.importorskip("av")
    root = tmp_path_factory.mktemp("clips")
    out = {}
    for name, codec in (("clip.mp4", "mpeg4"), ("clip.mkv", "ffv1")):
        written = _write(root / name, codec=codec)
        out[name] = (root / name, written)
    return out


@pytest.mark.parametrize("name", ["clip.mp4", "clip.mkv"])
def test_every_frame_decodes_to_the_written_colour(clips, name):
    path, written = clips[name]
    assert source_frames(path) == (N, float(RATE))
    clip = open_video(path)
    assert clip.indices == list(range(N)) and clip.total_frames == N and clip.fps == RATE
    assert all(im.mode == "RGB" and im.size == (SIDE, SIDE) for im in clip.frames)
    for im, want in zip(clip.frames, written):
        assert np.abs(np.asarray(im).astype(int) - want).max() <= 8  # lossy codec, solid colours
    assert all(np.array_equal(np.asarray(im), a) for im, a in zip(clip.frames, _decode_all(path), strict=True))


@pytest.mark.parametrize("name", ["clip.mp4", "clip.mkv"])
@pytest.mark.parametrize("rule", [FrameRule(), QWEN_RULE], ids=["plain", "qwen"])
@pytest.mark.parametrize(
    "sampling",
    [
        VideoSampling(num_frames=4),
        VideoSampling(num_frames=5),
        VideoSampling(num_frames=N),
        VideoSampling(fps=3.0),
        VideoSampling(fps=2.5),
        VideoSampling(fps=1.0, video_fps=3.0),  # a rate given by the caller wins over the file's
    ],
    ids=lambda s: f"n{s.num_frames}-fps{s.fps}-vfps{s.video_fps}",
)
def test_sampling_equals_the_frame_list_path(clips, name, rule, sampling):
    """A file samples the indices the same frames sampled as a list (with the file's rate as
    ``video_fps``) get, and its frames are those of decoding everything and indexing."""
    path, _ = clips[name]
    every = _decode_all(path)
    vfps = sampling.video_fps or float(RATE)
    as_list = VideoSampling(sampling.num_frames, sampling.fps, vfps)
    want = open_video([Image.fromarray(a) for a in every], as_list, rule)
    got = open_video(path, sampling, rule)
    assert got.indices == want.indices == sample_indices(N, as_list, rule)
    assert got.fps == want.fps == vfps and got.total_frames == N
    assert all(np.array_equal(np.asarray(im), every[i]) for im, i in zip(got.frames, got.indices, strict=True))


def test_fps_sampling_reads_the_files_rate(clips):
    path, written = clips["clip.mp4"]
    clip = open_video(path, VideoSampling(fps=3.0))  # 12 frames at 6 per second: 6 frames, every other
    assert clip.indices == [0, 2, 4, 6, 8, 10] and clip.sampled_fps == 3.0
    for im, i in zip(clip.frames, clip.indices):
        assert np.abs(np.asarray(im).astype(int) - written[i]).max() <= 8


def test_generate_on_a_file_equals_its_frames_as_a_list(clips):
    """``generate(videos=[path])`` on Qwen2.5-VL (whose temporal positions read the rate) answers as the
    decoded frames passed as a list with the file's rate; batched with a frame list it answers the same."""
    from mmfast.models.factory import random_qwen_vl

    mm = mmfast.load(*random_qwen_vl("qwen2_5_vl", seed=1))
    path, _ = clips["clip.mp4"]
    frames = [Image.fromarray(a) for a in _decode_all(path)]
    assert mm.prepare(None, "Go.", videos=path, num_frames=4).videos[0].fps == RATE
    got = {}
    for kw in ({"num_frames": 4}, {"fps": 2.0}):
        (got[str(kw)],) = mm.generate(None, "Describe the video.", videos=path, max_new_tokens=6, **kw)
        (want,) = mm.generate(None, "Describe the video.", videos=frames, video_fps=float(RATE), max_new_tokens=6, **kw)
        assert got[str(kw)].token_ids == want.token_ids and got[str(kw)].n_vision_tokens == want.n_vision_tokens
    both = mm.generate(
        None, ["Describe the video.", "What?"], videos=[path, frames[:6]], num_frames=4, max_new_tokens=6
    )
    assert both[0].token_ids == got[str({"num_frames": 4})].token_ids


# -- refusals -----------------------------------------------------------------------------------------
def test_without_pyav_a_file_is_refused_with_the_install_and_the_frames_alternative(tmp_path, monkeypatch):
    path = tmp_path / "clip.mp4"
    path.write_bytes(b"\0" * 64)  # never read: the refusal comes first
    monkeypatch.setitem(sys.modules, "av", None)  # `import av` raises ImportError
    match = (
        r"video 0 '.*clip\.mp4' is a video file, which mmfast decodes with PyAV, not installed here: "
        r"pip install 'mmfast\[video\]'.*ffmpeg -i clip\.mp4 frames/%05d\.png"
    )
    with pytest.raises(InputError, match=match):
        open_video(path, what="video 0")
    from mmfast.models.factory import random_qwen_vl

    mm = mmfast.load(*random_qwen_vl("qwen2_vl", seed=1))
    with pytest.raises(InputError, match="pip install 'mmfast\\[video\\]'"):
        mm.generate(None, "Go.", videos=str(path), max_new_tokens=2)


def test_missing_file_is_refused_without_pyav_too(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "av", None)
    with pytest.raises(InputError, match=r"video '.*nothere\.mkv' not found"):
        open_video(tmp_path / "nothere.mkv")


def test_unreadable_files_are_refused_naming_the_file(tmp_path):
    av = pytest.importorskip("av")
    garbage = tmp_path / "garbage.mp4"
    garbage.write_bytes(np.random.default_rng(0).integers(0, 255, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(InputError, match=r"'.*garbage\.mp4' cannot be read as a video .*corrupt"):
        open_video(garbage)

    empty = tmp_path / "empty.mp4"  # a video stream and no frame: the mp4 muxer writes no track
    with av.open(str(empty), "w") as container:
        stream = container.add_stream("mpeg4", rate=RATE)
        stream.width = stream.height = SIDE
        stream.pix_fmt = "yuv420p"
        container.start_encoding()
    with pytest.raises(InputError, match=r"'.*empty\.mp4' has no video stream"):
        source_frames(empty)

    whole = tmp_path / "whole.mp4"  # header first, so a cut file still says 12 frames
    _write(whole, options={"movflags": "faststart"})
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    assert source_frames(cut) == (N, float(RATE))
    with pytest.raises(InputError, match=r"'.*cut\.mp4' decodes \d+ frame\(s\), fewer than its header says"):
        open_video(cut)

    with pytest.raises(InputError, match=r"'.*notes\.txt' is not a directory of frames nor a video file"):
        open_video(tmp_path / "notes.txt")
