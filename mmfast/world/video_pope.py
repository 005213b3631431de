"""POPE questions about the video world's clips, by the official POPE rule.

Each clip is one POPE "image": its objects are the clip's object set (the categories visible in at
least one frame, :mod:`mmfast.world.video_render`) in annotation order, and the three splits are
built by :func:`mmfast.world.pope_official.build_pope_official` unchanged: clips with at least 3
objects are eligible and drawn in random order; the first 3 objects are the positives; after
each, one absent object: ``random`` draws one, ``popular`` takes the most frequent over the drawn
clips, ``adversarial`` the one co-occurring most with that positive (ties in first-appearance
order); one random stream seeded from the world seed.

Lines are JSON objects, POPE's JSON Lines format with the clip in place of the image:
``{"question_id", "video", "video_id", "text", "label"}``; ``video`` is the clip's directory
relative to ``clips/`` and ``text`` is ``"Is there a dog in the video?"``. Files:
``pope/video_pope_{random,popular,adversarial}.json``, and the builder's input
``pope/video_objects.json`` (one ``{"image", "image_id", "objects"}`` record per clip, the format of
the official builder's input, so the splits can be rebuilt from it alone).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from ._pope_common import POPE_SPLITS
from .pope_official import GroundTruthObjects, build_pope_official
from .text import article
from .video_render import ClipAnnotation

__all__ = [
    "VIDEO_OBJECTS_FILE",
    "VIDEO_POPE_RULE",
    "VideoPopeQuestion",
    "build_video_pope",
    "clip_records",
    "read_video_pope",
    "video_pope_bytes",
    "video_pope_file_name",
    "video_question",
    "write_video_pope",
]

VIDEO_OBJECTS_FILE = "video_objects.json"
VIDEO_QUESTION = "Is there {article} {obj} in the video?"
#: Recorded in ``video_world.json``.
VIDEO_POPE_RULE = (
    "official POPE (Li et al. 2023, RUCAIBox/POPE utils.py) over clips: first 3 clip objects in annotation "
    "order as positives; ties in first-appearance order; clips in drawn order; one random stream"
)


@dataclass(frozen=True)
class VideoPopeQuestion:
    """One line of a video POPE file (``to_json`` gives the dict written to the file)."""

    question_id: int
    video: str
    video_id: int
    text: str
    label: str

    def to_json(self) -> dict[str, object]:
        """The JSON object of this line."""
        return asdict(self)


def video_question(name: str) -> str:
    """``"Is there a dog in the video?"`` / ``"Is there an apple in the video?"``."""
    return VIDEO_QUESTION.format(article=article(name), obj=name)


def video_pope_file_name(split: str) -> str:
    """``video_pope_random.json`` etc."""
    if split not in POPE_SPLITS:
        raise ValueError(f"unknown POPE split {split!r}; choose from {POPE_SPLITS}")
    return f"video_pope_{split}.json"


def clip_records(annotations: Sequence[ClipAnnotation]) -> list[GroundTruthObjects]:
    """The official builder's input: one record per clip (clip-id order), its clip objects in annotation order."""
    return [
        GroundTruthObjects(a.name, a.clip_id, tuple(a.clip_objects()))
        for a in sorted(annotations, key=lambda a: a.clip_id)
    ]


def build_video_pope(
    records: Sequence[GroundTruthObjects], *, n_clips: int, seed: int = 0, n_pos: int = 3
) -> dict[str, list[VideoPopeQuestion]]:
    """Build the three splits with the official POPE rule (module docstring).

    Args:
        records: :func:`clip_records` of the clips.
        n_clips: Number of clips to draw (fewer if fewer have ``n_pos`` objects).
        seed: World seed (seeds the one random stream).
        n_pos: Positives (and negatives) per clip (3 in POPE).

    Returns:
        ``{"random": [...], "popular": [...], "adversarial": [...]}``.

    Raises:
        ValueError: if no clip has ``n_pos`` objects, or a clip has no absent object left.
    """
    splits = build_pope_official(records, n_images=n_clips, seed=seed, n_pos=n_pos, question=video_question)
    return {
        split: [VideoPopeQuestion(q.question_id, q.image, q.image_id, q.text, q.label) for q in qs]
        for split, qs in splits.items()
    }


def video_pope_bytes(questions: Sequence[VideoPopeQuestion]) -> bytes:
    """The exact bytes of a split's file."""
    return "".join(json.dumps(q.to_json()) + "\n" for q in questions).encode("utf-8")


def write_video_pope(out_dir: str | Path, splits: dict[str, list[VideoPopeQuestion]]) -> dict[str, Path]:
    """Write one JSON Lines file per split into ``out_dir``; returns their paths."""
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    for split, qs in splits.items():
        path = d / video_pope_file_name(split)
        path.write_bytes(video_pope_bytes(qs))
        paths[split] = path
    return paths


def read_video_pope(path: str | Path) -> list[VideoPopeQuestion]:
    """Read a video POPE file.

    Raises:
        ValueError: naming the file and line when a line is not a video POPE question.
    """
    out = []
    for i, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            out.append(
                VideoPopeQuestion(
                    int(d["question_id"]), str(d["video"]), int(d["video_id"]), str(d["text"]), str(d["label"])
                )
            )
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{i}: not a video POPE line ({e!r}); regenerate the video world") from e
    return out
