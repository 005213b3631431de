"""The video world: short clips of the image world's objects moving, with POPE questions per clip.

For exactness tests and cost benchmarks of video inputs (frames -> tokens, TTFT, memory per pruner).
**No shipped model was trained on video**, so no accuracy is reported on these clips: a model's
answers about a clip mean something only for a model that learned from video.

Clips are rendered by :func:`mmfast.world.video_render.render_clip` (the visibility rule and the
trajectories are documented there and in :mod:`mmfast.world._motion`); POPE files follow the
official rule (:mod:`mmfast.world.video_pope`). Layout written by :func:`write_video_world`::

    out_dir/
      clips/VWORLD_000001/frame_000.png ...   RGB PNG frames, image_size x image_size
      clips/VWORLD_000001/annotation.json     frames, tracks, per-frame and clip object sets
      pope/video_pope_{random,popular,adversarial}.json   POPE JSON Lines with a "video" field
      pope/video_objects.json                 the official builder's input (clip objects in annotation order)
      video_world.json                        protocol record (seed, config, rules, counts, sha256s)

Everything is a pure function of the arguments: re-running gives byte-identical files.

CLI: ``python -m mmfast.world.video --out DIR --clips 32 --frames 16 --seed 0``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image
from tqdm import tqdm

from .pope_official import write_objects
from .render import WORLD_VERSION
from .video_pope import VIDEO_OBJECTS_FILE, VIDEO_POPE_RULE, build_video_pope, clip_records, write_video_pope
from .video_render import (
    MAX_FRAMES,
    MIN_FRAMES,
    ClipAnnotation,
    Track,
    VideoConfig,
    clip_dir_name,
    frame_file_name,
    render_clip,
)

logger = logging.getLogger(__name__)

VIDEO_WORLD_FILE = "video_world.json"
ANNOTATION_FILE = "annotation.json"
MAX_CLIPS = 100_000
VISIBILITY_RULE = (
    "an instance is visible in a frame if >= min_visible of its sprite pixels (alpha >= 50%) are visible "
    "there (inside the frame, not covered by an object drawn in front) and >= 4 px; a category is in a "
    "frame's set if one of its instances is visible, and in the video if it is in at least one frame's set"
)


@dataclass(frozen=True)
class VideoWorldSummary:
    """What :func:`write_video_world` wrote."""

    out_dir: Path
    n_clips: int
    n_frames: int
    n_pope_clips: int
    seconds: float


def clip_to_json(ann: ClipAnnotation) -> dict[str, Any]:
    """The ``annotation.json`` object of a clip."""
    return {
        "clip_id": ann.clip_id,
        "name": ann.name,
        "scene": ann.scene,
        "width": ann.width,
        "height": ann.height,
        "num_frames": ann.num_frames,
        "min_visible": ann.min_visible,
        "frames": [frame_file_name(t) for t in range(ann.num_frames)],
        "frame_objects": [ann.frame_objects(t) for t in range(ann.num_frames)],
        "clip_objects": ann.clip_objects(),
        "tracks": [dataclasses.asdict(tr) for tr in ann.tracks],
    }


def clip_from_json(d: dict[str, Any]) -> ClipAnnotation:
    """Inverse of :func:`clip_to_json` (the derived object sets are recomputed, not read)."""
    tracks = tuple(
        Track(
            instance=int(t["instance"]),
            category_id=int(t["category_id"]),
            name=str(t["name"]),
            sample_index=int(t["sample_index"]),
            motion=str(t["motion"]),
            size=(int(t["size"][0]), int(t["size"][1])),
            full_area=int(t["full_area"]),
            positions=tuple((int(x), int(y)) for x, y in t["positions"]),
            areas=tuple(int(a) for a in t["areas"]),
            bboxes=tuple(None if b is None else (int(b[0]), int(b[1]), int(b[2]), int(b[3])) for b in t["bboxes"]),
        )
        for t in d["tracks"]
    )
    return ClipAnnotation(
        int(d["clip_id"]),
        str(d["name"]),
        str(d["scene"]),
        int(d["width"]),
        int(d["height"]),
        int(d["num_frames"]),
        float(d["min_visible"]),
        tracks,
    )


def load_clips(root: str | Path) -> list[ClipAnnotation]:
    """The clip annotations of a written video world, in clip-id order.

    Raises:
        FileNotFoundError: naming the missing file and the command that writes it.
    """
    r = Path(root)
    info_path = r / VIDEO_WORLD_FILE
    if not info_path.is_file():
        raise FileNotFoundError(f"{info_path} not found: write the video world with python -m mmfast.world.video")
    info = json.loads(info_path.read_text(encoding="utf-8"))
    out = []
    for i in range(1, int(info["counts"]["clips"]) + 1):
        path = r / "clips" / clip_dir_name(i) / ANNOTATION_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: the video world at {r} is incomplete; write it again")
        out.append(clip_from_json(json.loads(path.read_text(encoding="utf-8"))))
    return out


def load_clip_frames(root: str | Path, clip: ClipAnnotation) -> list[Image.Image]:
    """The RGB frames of a written clip, in order.

    Raises:
        FileNotFoundError: naming the missing frame.
    """
    d = Path(root) / "clips" / clip.name
    out = []
    for t in range(clip.num_frames):
        path = d / frame_file_name(t)
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: the video world at {root} is incomplete; write it again")
        with Image.open(path) as im:
            out.append(im.convert("RGB"))
    return out


def _prepare(out: Path) -> None:
    """Refuse a non-empty directory that is not a video world; drop a previous world's clips."""
    if out.exists() and any(out.iterdir()):
        if not (out / VIDEO_WORLD_FILE).is_file():
            raise FileExistsError(f"{out} is not empty and holds no {VIDEO_WORLD_FILE}: choose a new or empty --out")
        for d in (out / "clips").glob("VWORLD_*"):  # a previous video world's files, never other files
            shutil.rmtree(d)
        for f in (out / "pope").glob("video_pope_*.json"):
            f.unlink()
    (out / "clips").mkdir(parents=True, exist_ok=True)


def write_video_world(
    out_dir: str | Path,
    seed: int = 0,
    n_clips: int = 32,
    *,
    pope_clips: int | None = None,
    config: VideoConfig | None = None,
    progress: bool = True,
) -> VideoWorldSummary:
    """Generate and write the video world (module docstring for the layout).

    Args:
        out_dir: Output directory: new, empty, or a previous video world (replaced).
        seed: World seed; the output is a pure function of the arguments.
        n_clips: Number of clips (ids 1..n_clips).
        pope_clips: Clips drawn for POPE (all eligible ones if None; 0 writes no POPE files).
        config: Generator settings (frames per clip, image size, ...).
        progress: Show a tqdm progress bar.

    Returns:
        A :class:`VideoWorldSummary`.

    Raises:
        ValueError: for a bad count; FileExistsError: for a non-empty directory that is not a video world.
    """
    if not 1 <= n_clips <= MAX_CLIPS:
        raise ValueError(f"n_clips must be in [1, {MAX_CLIPS}], got {n_clips}")
    if pope_clips is not None and pope_clips < 0:
        raise ValueError(f"pope_clips must be >= 0, got {pope_clips}")
    t0 = time.perf_counter()
    cfg = config or VideoConfig()
    out = Path(out_dir)
    _prepare(out)
    anns: list[ClipAnnotation] = []
    clips_hash = hashlib.sha256()
    for clip_id in tqdm(range(1, n_clips + 1), desc="video world", unit="clip", disable=not progress):
        r = render_clip(seed, clip_id, cfg)
        d = out / "clips" / r.annotation.name
        d.mkdir()
        for t, frame in enumerate(r.frames):
            frame.save(d / frame_file_name(t), format="PNG", compress_level=6)
            clips_hash.update((d / frame_file_name(t)).read_bytes())
        text = json.dumps(clip_to_json(r.annotation), separators=(",", ":")) + "\n"
        (d / ANNOTATION_FILE).write_text(text, encoding="utf-8")
        clips_hash.update(text.encode("utf-8"))
        anns.append(r.annotation)
    records = clip_records(anns)
    files = {f"pope/{VIDEO_OBJECTS_FILE}": write_objects(out / "pope" / VIDEO_OBJECTS_FILE, records)}
    n_pope, questions = 0, {}
    if pope_clips != 0:
        try:
            splits = build_video_pope(records, n_clips=n_clips if pope_clips is None else pope_clips, seed=seed)
        except ValueError as e:
            raise ValueError(
                f"POPE over {n_clips} clips: {e}; generate more clips or pass pope_clips=0 (--pope-clips 0)"
            ) from e
        for split, path in write_video_pope(out / "pope", splits).items():
            files[f"pope/{path.name}"] = path
            questions[split] = len(splits[split])
        n_pope = len(splits["random"]) // 6
    info = {
        "generator": "mmfast.world.video",
        "version": WORLD_VERSION,
        "seed": seed,
        "config": dataclasses.asdict(cfg),
        "counts": {"clips": n_clips, "frames": cfg.frames, "pope_clips": n_pope, "questions": questions},
        "visibility_rule": VISIBILITY_RULE,
        "object_order": "scene model sampling order (Track.sample_index), as the image world's annotation order",
        "pope_rule": VIDEO_POPE_RULE if n_pope else None,
        "accuracy": "none reported: no shipped model was trained on video",
        "sha256": {name: hashlib.sha256(p.read_bytes()).hexdigest() for name, p in files.items()},
        "clips_sha256": clips_hash.hexdigest(),
    }
    (out / VIDEO_WORLD_FILE).write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")
    secs = time.perf_counter() - t0
    logger.info("video world written to %s in %.1fs", out, secs)
    return VideoWorldSummary(out, n_clips, cfg.frames, n_pope, secs)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point: ``python -m mmfast.world.video --out DIR ...``; bad arguments exit 2."""
    ap = argparse.ArgumentParser(prog="python -m mmfast.world.video", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="output directory (new, empty, or a previous video world)")
    ap.add_argument("--clips", type=int, default=32, help=f"number of clips, 1..{MAX_CLIPS} (default 32)")
    ap.add_argument("--frames", type=int, default=16, help=f"frames per clip, {MIN_FRAMES}..{MAX_FRAMES} (default 16)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--image-size", type=int, default=192, help="frame side in pixels, 32..2048 (default 192)")
    ap.add_argument("--pope-clips", type=int, default=None, help="clips drawn for POPE (default: all; 0: none)")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if not 1 <= args.clips <= MAX_CLIPS:
        ap.error(f"--clips must be in [1, {MAX_CLIPS}], got {args.clips}")
    if args.pope_clips is not None and args.pope_clips < 0:
        ap.error(f"--pope-clips must be >= 0, got {args.pope_clips}")
    try:
        cfg = VideoConfig(frames=args.frames, image_size=args.image_size)
    except ValueError as e:
        ap.error(f"--frames / --image-size: {e}")
    try:
        s = write_video_world(
            args.out, args.seed, args.clips, pope_clips=args.pope_clips, config=cfg, progress=not args.no_progress
        )
    except (FileExistsError, OSError, ValueError) as e:
        logger.error("%s", e)
        return 2
    logger.info("done: %d clips of %d frames, %d POPE clips, %.1fs", s.n_clips, s.n_frames, s.n_pope_clips, s.seconds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
