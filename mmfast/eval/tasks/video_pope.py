"""POPE over the video world's clips as an evaluation task (``video_pope``): "Is there a X in the
video?" per clip, each clip's frames given to the model as one video, scored by the official POPE rule.

Input: a directory written by ``python -m mmfast.world.video`` (``eval.video_pope.video_world``; see
docs/video_world.md). Its question files, ``pope/video_pope_{split}.json``, are read as the world writes
them (:func:`mmfast.world.video_pope.read_video_pope`: POPE JSON Lines with a ``video`` field, the
clip's directory under ``clips/``), and must be the bytes the world recorded in ``video_world.json``
(``sha256``): question files from another world or edited by hand are refused. Splits, prompt
template, answer parser and scoring are POPE's (:mod:`mmfast.eval.tasks.pope`, :mod:`mmfast.eval.pope`),
with the clip as the resampled unit of the intervals; answers the official rule reads as neither yes
nor no are counted (``metrics.video_pope.unparsed``, :mod:`mmfast.eval.unparsed`).

Frames: every frame of a clip by default; ``num_frames`` (uniform, rounded by the family's processor
rule) or ``fps`` with ``video_fps`` sample them as ``generate(videos=...)`` does (:mod:`mmfast.video`).
Only families with video input (``ModelFeatures.video``) run it; the runner refuses the others before
any compute.

**No accuracy is reported on these clips**: no model shipped with mmfast was trained on video, so the
figures this task writes are for exactness (a method against its reference, resumed against
uninterrupted runs) and cost, never a measure of a method's accuracy.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ...config import EvalConfig, opt
from ...errors import ConfigError, InputError
from ...registry import TASKS
from ...video import VideoSampling
from ...world.video import VIDEO_WORLD_FILE
from ...world.video_pope import VideoPopeQuestion, read_video_pope, video_pope_file_name
from ..data import EvalData
from ..pope import parse_answer
from ..unparsed import count_pope_unparsed
from .base import Sample, Task
from .pope import check_prompt, intervals_protocol, score_splits

NAME = "video_pope"
_WRITE = "python -m mmfast.world.video --out DIR --clips 32 --frames 16"


@dataclass(frozen=True)
class VideoPopeTaskConfig:
    video_world: str | None = opt(None, doc="directory written by python -m mmfast.world.video (required)")
    splits: tuple[Literal["random", "popular", "adversarial"], ...] = ("random", "popular", "adversarial")
    prompt: str = opt("{question}", doc="'{question}' is replaced by the POPE question")
    parser: Literal["pope", "opera", "vcd", "lmms"] = "pope"
    max_new_tokens: int = opt(16, lo=1, hi=1024)
    num_frames: int | None = opt(None, lo=1, doc="frames sampled uniformly per clip (default: every frame)")
    fps: float | None = opt(None, doc="frames sampled per second of video_fps (instead of num_frames)")
    video_fps: float | None = opt(None, doc="frames per second of the clips (the processors assume 24 without it)")

    def __post_init__(self) -> None:
        if len(set(self.splits)) != len(self.splits):
            raise ConfigError(f"eval.{NAME}.splits", f"{list(self.splits)} lists a split twice; list each once")
        try:
            sampling = self.sampling
        except InputError as exc:
            raise ConfigError(f"eval.{NAME}", str(exc)) from None
        if sampling.fps is not None and sampling.video_fps is None:
            raise ConfigError(
                f"eval.{NAME}.fps",
                "fps sampling needs the clips' frame rate: set video_fps too, or sample with num_frames",
            )

    @property
    def sampling(self) -> VideoSampling:
        """The frame sampling every clip gets (:class:`mmfast.video.VideoSampling`)."""
        return VideoSampling(self.num_frames, self.fps, self.video_fps)


def world_info(opts: VideoPopeTaskConfig) -> tuple[Path, dict[str, Any]]:
    """The video world's directory and its ``video_world.json``; refuses a missing or invalid one."""
    where = f"eval.{NAME}.video_world"
    if not opts.video_world:
        raise ConfigError(
            where,
            f"set it to a directory written by the video world generator ({_WRITE}), in the recipe or with "
            f"--set {where}=DIR",
        )
    root = Path(opts.video_world).expanduser()
    if not root.is_dir():
        raise InputError(f"{where} {str(root)!r} is not a directory; write the video world there first ({_WRITE})")
    path = root / VIDEO_WORLD_FILE
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(
            f"{where} {str(root)!r} is not a video world (no {VIDEO_WORLD_FILE}); write one there ({_WRITE})"
        ) from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise InputError(f"{path} cannot be read ({exc}); write the video world again ({_WRITE})") from None
    if not isinstance(info, dict) or info.get("generator") != "mmfast.world.video":
        raise InputError(f"{path} is not written by mmfast.world.video; write the video world again ({_WRITE})")
    try:
        frames = int(info["counts"]["frames"])
        pope_clips = int(info["counts"]["pope_clips"])
        dict(info["sha256"])
    except (KeyError, TypeError, ValueError) as exc:
        raise InputError(
            f"{path} lacks {exc} (an incomplete or older video world); write it again ({_WRITE})"
        ) from None
    if pope_clips == 0:
        raise InputError(
            f"the video world {str(root)!r} has no POPE questions (written with --pope-clips 0); write it again "
            "without --pope-clips 0"
        )
    if opts.num_frames is not None and opts.num_frames > frames:
        raise ConfigError(
            f"eval.{NAME}.num_frames",
            f"{opts.num_frames} frames asked, but the clips of {str(root)!r} have {frames}; ask for at most {frames}",
        )
    return root, info


@TASKS.register(NAME, description="POPE over the video world's clips (exactness and cost; no accuracy reported)")
class VideoPopeTask(Task):
    """POPE over the configured splits of a video world; each clip is one video input."""

    Config = VideoPopeTaskConfig
    needs = frozenset()  # no shared images or annotations: the clips and questions come from the video world

    @classmethod
    def required_files(cls, cfg: EvalConfig, data: EvalData) -> dict[str, Path]:
        opts: VideoPopeTaskConfig = cfg.task_config(NAME)
        check_prompt(opts.prompt, f"eval.{NAME}.prompt")  # before any file is read or any model loads
        root, _ = world_info(opts)
        return {s: root / "pope" / video_pope_file_name(s) for s in opts.splits}

    def __init__(self, cfg: EvalConfig, data: EvalData, cache_dir: Path | None = None) -> None:
        super().__init__(cfg, data, cache_dir)
        opts: VideoPopeTaskConfig = self.options
        self.root, self.info = world_info(opts)
        self.questions: dict[str, list[VideoPopeQuestion]] = {}
        self.file_sha256: dict[str, str] = {}
        for split, path in self.files.items():
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            recorded = self.info["sha256"].get(f"pope/{path.name}")
            if digest != recorded:
                raise InputError(
                    f"{path} is not the question file its video world wrote (sha256 {digest[:12]}..., "
                    f"{VIDEO_WORLD_FILE} records {str(recorded)[:12]}...); write the video world again ({_WRITE})"
                )
            try:
                qs = read_video_pope(path)
            except ValueError as exc:
                raise InputError(str(exc)) from None
            for q in qs:
                if q.label not in ("yes", "no") or Path(q.video).name != q.video or q.video in ("", ".", ".."):
                    raise InputError(
                        f"{path}: question {q.question_id} has video {q.video!r} and label {q.label!r}; a clip is a "
                        "directory name under clips/ and a label yes or no (write the video world again)"
                    )
            self.questions[split] = qs
            self.file_sha256[split] = digest

    def samples(self, limit: int | None) -> list[Sample]:
        opts: VideoPopeTaskConfig = self.options
        out = []
        for split, qs in self.questions.items():
            for q in qs[:limit] if limit else qs:
                out.append(
                    Sample(
                        doc_id=f"{NAME}_{split}/{q.question_id}",
                        task=f"{NAME}_{split}",
                        image=None,
                        video=self.root / "clips" / q.video,
                        video_sampling=opts.sampling,
                        prompt=opts.prompt.format(question=q.text),
                        target=q.label,
                        max_new_tokens=opts.max_new_tokens,
                        meta={"question_id": q.question_id, "question": q.text, "video_id": q.video_id},
                    )
                )
        return out

    def filter_response(self, text: str, sample: Sample) -> str:
        return parse_answer(text, self.options.parser, label=sample.target).pred

    def metrics(self, records: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
        by_split = {s: records[f"{NAME}_{s}"] for s in self.questions if records.get(f"{NAME}_{s}")}
        if not by_split:
            return {}
        out = score_splits(by_split, self.options.parser, unit="video")
        unparsed = count_pope_unparsed(r["resps"][0][0] for rs in by_split.values() for r in rs)
        out["unparsed"] = {**unparsed.as_dict(), "over_limit": unparsed.over_limit}
        return out

    def protocol(self) -> dict[str, Any]:
        o: VideoPopeTaskConfig = self.options
        return {
            "video_world": str(self.root),
            "world": {k: self.info.get(k) for k in ("seed", "version", "config", "counts", "clips_sha256")},
            "splits": list(o.splits),
            "prompt": o.prompt,
            "parser": o.parser,
            "max_new_tokens": o.max_new_tokens,
            "num_frames": o.num_frames,
            "fps": o.fps,
            "video_fps": o.video_fps,
            "files": {s: {"path": str(self.files[s]), "sha256": self.file_sha256[s]} for s in self.questions},
            "intervals": intervals_protocol(unit="clip"),
            "accuracy": "none reported: no shipped model was trained on video; these figures are for exactness and cost",
        }
