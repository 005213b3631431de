"""The evaluation-task interface: :class:`Sample`, :class:`Task`, and :func:`build_tasks` (from the registry)."""

from __future__ import annotations

import abc
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from ...config import EvalConfig
from ...registry import TASKS
from ...video import VideoSampling
from ..data import SHARED_INPUTS, EvalData

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sample:
    """One prompt about one image, or about one video. ``doc_id`` is unique in the run (prefix it with
    the task's name); ``task`` is the record group the answer is scored in; ``target`` must be
    JSON-serialisable. Exactly one of ``image`` (an image file) and ``video`` (a directory of frame
    images, read in sorted file-name order, :mod:`mmfast.video`) is set; ``video_sampling`` says which
    frames of the video the model sees (the recipe's ``num_frames`` / ``fps`` / ``video_fps``)."""

    doc_id: str
    task: str  # record group: "pope_random", "chair", ...
    image: Path | None
    prompt: str
    target: Any
    max_new_tokens: int
    meta: dict[str, Any] = field(default_factory=dict)
    video: Path | None = None
    video_sampling: VideoSampling = VideoSampling()

    def __post_init__(self) -> None:
        if (self.image is None) == (self.video is None):
            raise ValueError(f"sample {self.doc_id!r}: give exactly one of image and video")
        if self.video is None and self.video_sampling != VideoSampling():
            raise ValueError(f"sample {self.doc_id!r}: video_sampling is for a video sample")

    @property
    def media(self) -> Path:
        """The sample's input: its image file or its video's frame directory."""
        return self.image if self.image is not None else self.video  # type: ignore[return-value]


class Task(abc.ABC):
    """One evaluation benchmark, built from the recipe's ``eval`` section and the located data.

    The runner builds every task named in ``eval.tasks`` before loading the model, generates an
    answer per :meth:`samples` item, appends a record per answer to ``samples.jsonl`` (``doc_id``,
    ``task``, ``target``, ``resps``, ``filtered_resps``, ``meta``, token accounting) and, at the end,
    calls :meth:`metrics` with this task's finished records grouped by ``Sample.task``.
    """

    Config: ClassVar[type | None] = None
    """The task's options dataclass (recipe section ``eval.<name>``; ranges via ``config.opt``)."""
    needs: ClassVar[frozenset[str]] = frozenset({"images"})
    """Shared inputs :func:`~mmfast.eval.data.resolve_data` locates and checks: ``images``, ``annotations``."""
    files_help: ClassVar[Mapping[str, str]] = {}
    """Where to get this task's own files (:meth:`required_files`), by ``eval.data.dataset``."""
    registered_name: ClassVar[str] = ""  # set by TASKS.register

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        unknown = set(cls.needs) - set(SHARED_INPUTS)
        if unknown:
            raise TypeError(
                f"{cls.__name__}.needs lists {sorted(unknown)}; the shared inputs are {list(SHARED_INPUTS)} "
                "(declare other files in required_files)"
            )

    def __init__(self, cfg: EvalConfig, data: EvalData, cache_dir: Path | None = None) -> None:
        self.cfg, self.data, self.cache_dir = cfg, data, cache_dir

    @property
    def name(self) -> str:
        """The registered name (``eval.tasks`` entry, ``metrics.<name>`` key in the summary)."""
        if not self.registered_name:
            raise TypeError(f"{type(self).__name__} is not registered: decorate it with @TASKS.register('name')")
        return self.registered_name

    @property
    def options(self) -> Any:
        """This task's options (an instance of ``Config``), from ``eval.<name>`` or its defaults."""
        return self.cfg.task_config(self.name)

    @property
    def files(self) -> dict[str, Path]:
        """This task's own files, located and checked (see :meth:`required_files`)."""
        return self.data.files_of(self.name)

    @classmethod
    def required_files(cls, cfg: EvalConfig, data: EvalData) -> dict[str, Path]:
        """This task's own input files by key (besides ``needs``): checked, all missing ones listed,
        before any model is loaded. ``data`` holds the located shared inputs and ``data.root``."""
        return {}

    @abc.abstractmethod
    def samples(self, limit: int | None) -> list[Sample]:
        """The planned samples, in a fixed order; ``limit`` caps each record group (smoke runs)."""

    def filter_response(self, text: str, sample: Sample) -> str:
        """The answer as scored (``filtered_resps`` in the records); the raw text by default."""
        return text

    @abc.abstractmethod
    def metrics(self, records: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
        """Metrics from this task's finished records by record group (``{}`` when there are none)."""

    def protocol(self) -> dict[str, Any]:
        """What the summary's ``protocol.tasks.<name>`` records: prompts, files + checksums, seeds."""
        return {}

    def side_files(self) -> dict[str, str]:
        """Extra files written next to ``samples.jsonl`` (file name -> text), e.g. CHAIR's image ids."""
        return {}


def build_tasks(cfg: EvalConfig, data: EvalData, cache_dir: Path | None = None) -> list[Task]:
    """Build the tasks of ``cfg.tasks`` (in order) from the registry; each gets ``cache_dir/<name>``."""
    tasks: list[Task] = []
    for name in cfg.tasks:
        cls = TASKS.get(name).cls
        if not (isinstance(cls, type) and issubclass(cls, Task)):
            raise TypeError(
                f"evaluation task {name!r} is registered as {cls!r}, which does not subclass mmfast.eval.tasks.Task"
            )
        tasks.append(cls(cfg, data, cache_dir / name if cache_dir is not None else None))
    return tasks
