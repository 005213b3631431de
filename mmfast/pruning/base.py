"""Base class for vision-token pruning and merging stages.

A stage acts at one or more hook points, declared in ``hook_points`` (documentation; what the stage
does and needs for compatibility is its :class:`~mmfast.capabilities.Capabilities`, ``caps``):

- ``vision_tower``: hooks inside the vision encoder (ToMe, MustDrop's window merge);
- ``vision_features``: edits the selected features before the projector (VisionZip, HICom, ...),
  through :meth:`Pruner.prune_vision`;
- ``llm_layer``: drops tokens at decoder layers during prefill, through ``ctx.runner.prune_at``;
- ``kv_cache``: edits the cache after prefill or per decode step (MustDrop, ZipVL, Dynamic-LLaVA);
- ``attention_probe``: reads attention rows through ``ctx.probe``.

A stage gets a :class:`~mmfast.context.MethodContext`, never the session. What it decides about one
batch travels with that batch: per-token data as ``VisionBatch.tags`` (spliced into
``LMInputs.tags``), statistics in ``VisionBatch.stats`` / ``LMState.stats`` under its name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from ..capabilities import Capabilities
from ..config import from_dict, to_dict
from ..models.base import VisionBatch
from ..registry import Method

if TYPE_CHECKING:
    from ..context import MethodContext
    from ..inputs import PreparedBatch
    from ..models.base import VLMAdapter


class Pruner(Method):
    """A vision-token reduction stage. Subclasses define ``Config`` and override what they use."""

    hook_points: ClassVar[frozenset[str]] = frozenset()
    caps: ClassVar[Capabilities] = Capabilities()
    #: Config keys a ``budget:`` sets (a recipe may not set them in ``params`` too); empty = no budget.
    budget_knobs: ClassVar[tuple[str, ...]] = ()
    #: True: the budget is reached by :meth:`calibrate` after installation, not by :meth:`budget_params`.
    calibrated: ClassVar[bool] = False
    #: why a ``flops`` budget cannot be met (refused when the stage is installed); empty: it can.
    flops_refused: ClassVar[str] = ""
    #: True: on models whose images have different vision-token counts, the budget is mapped per image
    #: count (:meth:`config_for`, read by the method's per-image code); False: once, for a ``tokens`` budget.
    budget_per_image: ClassVar[bool] = True

    def __init__(self, config: Any, ctx: MethodContext) -> None:
        super().__init__(config, ctx)
        self.adapter = ctx.adapter

        self.budget_tokens: int | None = None  # the stage's target when it is the same for every image
        self.budget_path = "budget"  # the recipe path of the budget, for errors (set by the session)
        #: the recipe's budget as a rule per image (``_budget.ImageBudget``; set by the session), or None
        self.budget_rule = None
        #: True when the budget's knobs are mapped per image count (:meth:`config_for`; set by the session)
        self.maps_per_image = False
        self._configs: dict[int, Any] = {}
        self.calibration = None  # a ``_budget.Calibration`` after :meth:`calibrate`

    def setting_path(self, param: str) -> str:
        """The recipe path a refusal of this stage's setting names: its budget's key (``pruning[i].budget.tokens``)
        when the stage has a budget, else ``pruning[i].params.<param>``, the knob that set it."""
        if self.budget_rule is not None:
            return f"{self.budget_path}.{self.budget_rule.budget.key}"
        return f"{self.budget_path.rsplit('.', 1)[0]}.params.{param}"  # budget_path: pruning[i].budget

    def install(self) -> None:
        """Register hooks and probes (called once when the session opens)."""

    def tower_per_image(self) -> bool:
        """Whether this call's tower must run one image at a time for this stage (a stage that declares
        ``tower_per_image`` may not need it where the tower is captured: MustDrop's padded merge)."""
        return True

    def observe_tower(self, vision: VisionBatch) -> None:
        """Right after the vision tower ran (on one image when a stage declaring ``tower_per_image`` says so in
        this call, :meth:`tower_per_image`, else on the batch): move what tower hooks saw into ``vision``."""

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
    def random_shape_params(cls) -> dict[str, Any]:
        """Recipe params that swap the method's trained parts for seeded, untrained ones of the right
        sizes: the bench times methods on random-weight model shapes, where no trained file can exist
        (their decisions are not meaningful there, only their cost). Methods without trained parts: {}."""
        return {}

    @classmethod
    def budget_params(cls, tokens: int, n: int | None, adapter: VLMAdapter, config: Any, path: str) -> dict[str, Any]:
        """Recipe params (over ``budget_knobs``) that realise ``tokens`` for an image of ``n`` vision
        tokens (None: a method with ``budget_per_image`` False on a model without one count) (see the
        method's docstring)."""
        raise NotImplementedError(f"{cls.__name__} takes no budget")

    def config_for(self, n: int) -> Any:
        """The stage's config for an image of ``n`` vision tokens: ``self.config``, or, when the budget is
        mapped per image (``maps_per_image``), the budget's knobs set for ``n`` (cached per count).
        Raises :class:`~mmfast.errors.ConfigError` when the budget is infeasible for that image."""
        if not self.maps_per_image:
            return self.config
        cfg = self._configs.get(n)
        if cfg is None:
            rule = self.budget_rule
            mapped = rule.knobs(type(self), rule.target(n), n, self.adapter, self.config)
            cfg = from_dict(type(self.config), {**to_dict(self.config), **mapped}, self.budget_path)
            self._configs[n] = cfg
        return cfg

    def calibrate(self, tokens: int) -> None:
        """Threshold methods: set the thresholds so the layer-averaged vision tokens meet ``tokens``
        (called once after every stage is installed; see ``pruning._budget.calibrate_scalar``)."""
        raise NotImplementedError(f"{type(self).__name__} is not calibrated")

    def calibrated_setting(self) -> dict:
        """What :meth:`calibrate` set (to reuse it in another session on the same model)."""
        raise NotImplementedError(f"{type(self).__name__} is not calibrated")

    def apply_calibrated(self, setting: dict) -> None:
        """Set what :meth:`calibrated_setting` returned."""
        raise NotImplementedError(f"{type(self).__name__} is not calibrated")
