"""Base class for vision-token pruning and merging stages.

A stage acts at one or more hook points, declared in ``hook_points``:

- ``vision_tower``: hooks inside the vision encoder (ToMe, MustDrop's window merge);
- ``vision_features``: edits the selected features before the projector (VisionZip, HICom, ...),
  through :meth:`Pruner.prune_vision`;
- ``llm_layer``: drops tokens at decoder layers during prefill, through ``session.runner.prune_at``;
- ``kv_cache``: edits the cache after prefill or per decode step (MustDrop, ZipVL, Dynamic-LLaVA);
- ``attention_probe``: reads attention rows through ``session.probe``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from ..models.base import VisionBatch

if TYPE_CHECKING:
    from ..config import Recipe
    from ..model import PreparedBatch
    from ..models.base import VLMAdapter
    from ..pipeline import Session


class Pruner:
    """A vision-token reduction stage. Subclasses define ``Config`` and override what they use."""

    Config: ClassVar[type]
    hook_points: ClassVar[frozenset[str]] = frozenset()
    supports_batch: ClassVar[bool] = True
    needs_cls: ClassVar[bool] = False
    #: "original": kept tokens keep their position ids; "compact": survivors are renumbered.
    position_mode: ClassVar[str] = "original"
    #: model families the stage runs on (LLaVA-NeXT's anyres mosaic has no single square grid)
    families: ClassVar[frozenset[str]] = frozenset({"llava"})

    def __init__(self, config: Any, session: Session) -> None:
        self.config = config
        self.session = session
        self.adapter = session.adapter
        self.last_stats: dict[str, Any] = {}

    def install(self) -> None:
        """Register hooks and probes (called once when the session opens)."""

    def prune_vision(self, vision: VisionBatch, batch: PreparedBatch) -> VisionBatch:
        """Feature-stage edit; identity by default."""
        return vision

    @classmethod
    def noop_params(cls, adapter: VLMAdapter) -> dict[str, Any]:
        """Recipe params of the setting that must reproduce the unpruned model exactly (tests)."""
        raise NotImplementedError(f"{cls.__name__} must define its no-op setting")

    @classmethod
    def test_params(cls, adapter: VLMAdapter) -> dict[str, Any]:
        """Recipe params that really prune on a tiny test model (tests)."""
        raise NotImplementedError(f"{cls.__name__} must define a pruning setting for tests")

    @classmethod
    def check_model(cls, adapter: VLMAdapter) -> str | None:
        """A reason this stage cannot run on ``adapter``'s model, or None."""
        if adapter.family not in cls.families:
            from ..registry import PRUNERS

            ok = [e.name for e in PRUNERS.entries() if adapter.family in e.cls.families]
            return (
                f"does not support the {adapter.family} family (it needs one square patch grid per image; "
                f"LLaVA-NeXT's anyres tiles are a newline-separated mosaic). Stages that run there: {', '.join(ok)}"
            )
        if cls.needs_cls and not adapter.has_cls:
            return "needs a CLS token in the vision tower, which this model does not have"
        return None

    @classmethod
    def check_recipe(cls, recipe: Recipe, index: int) -> str | None:
        """A reason this stage cannot run with the rest of ``recipe``, or None."""
        return None
