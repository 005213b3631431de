"""Capabilities: what each method does and needs, and the one check that compares them.

Every pruning stage, decoder and drafter declares a :class:`Capabilities` (a class attribute
``caps``, or a ``capabilities(params)`` classmethod when a parameter changes what the method does).
:func:`check_recipe` compares the declarations of a recipe's methods before any model is loaded, and
:func:`check_model` compares them with the loaded model before any compute; each refusal says why and
what to do instead. No method inspects another method's name or parameters, and no method names a
model family: it declares what it needs of the model (:class:`~mmfast.models.features.Need`), every
adapter declares what its family offers (:class:`~mmfast.models.features.ModelFeatures`), and
:func:`refusal` derives support or a refusal from the two. ``Need`` is importable from here.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from .checkpoint import _resolve
from .errors import ConfigError, IncompatibleRecipeError, ModelLoadError
from .models import ADAPTERS
from .models.features import NEED_ORDER, ModelFeatures, Need, has, what_it_has
from .registry import DECODERS, DRAFTERS, PRUNERS, Registry

if TYPE_CHECKING:
    from .config import Recipe
    from .models.base import VLMAdapter

Search = Literal["single", "beam", "branches"]


@dataclass(frozen=True)
class Capabilities:
    """A method's declaration. Defaults describe a method that does nothing special and runs on
    every model family."""

    #: what the method needs of the model; a model whose adapter's features lack one is refused
    #: (:func:`refusal`; docs/architecture.md, "Adding a model family")
    needs: frozenset[Need] = frozenset()
    #: need -> why the method needs it, in its own words (quoted in the refusal)
    why: Mapping[Need, str] = field(default_factory=dict, hash=False)
    #: its need of a video as one vision item (``Need.VIDEO_ONE_ITEM``, declared or as a substitute) is its
    #: feature stage's alone (``prune_vision``, and per-item extras its ``observe_tower`` leaves): on a model
    #: whose frame groups are separate items (``ModelFeatures.video_items``) the session joins each video's
    #: items into one around its ``prune_vision`` and splits the rows back after
    #: (:mod:`mmfast.pruning._video_items`), which meets the need there (:func:`joins_videos`)
    video_join: bool = False
    #: need -> what a published substitute needs instead, where the model lacks the need (VisionZip's
    #: received-attention ranking replaces CLS attention on dynamic-grid towers: {CLS: {DYNAMIC_GRID}})
    substitutes: Mapping[Need, frozenset[Need]] = field(default_factory=dict, hash=False)

    # -- pruning stages ---------------------------------------------------------------------------
    #: changes the token set inside the vision tower (ToMe, MustDrop's window merge)
    merges_in_tower: bool = False
    #: the tower must run one image at a time (a per-image merge changes each image's length)
    tower_per_image: bool = False
    #: rebuilds an image's features from the full patch grid, so it must be the first stage that
    #: edits vision tokens (in the tower or on the features)
    needs_full_grid: bool = False
    #: edits vision features before the projector
    edits_features: bool = False
    #: removes cached slots after prefill (a KV policy over the prompt)
    kv_edit_prefill: bool = False
    #: removes or rewrites cached slots while decoding (one step at a time)
    kv_edit_decode: bool = False
    #: replaces the cache layers themselves (ZipVL's mixed-precision layers): no other stage may
    #: edit the cache, and nothing may roll it back or reorder it
    owns_kv_cache: bool = False
    #: decodes by recomputing the whole sequence (no KV cache)
    decodes_without_cache: bool = False
    #: how to set the stage so that it leaves decoding alone (named in refusals)
    decode_free_setting: str = ""
    #: replaces LLM attention computations through the probe wrapper's per-module override (ZipVL's
    #: sparse prefill; PAI, ClearSight and ONLY edit or extend attention): one such method per recipe
    overrides_llm_attention: bool = False

    # -- decoders ---------------------------------------------------------------------------------
    #: single: one sequence per sample; beam: several hypotheses reordered every step; branches:
    #: auxiliary inputs decoded beside the clean one (contrastive / ensemble decoders)
    search: Search = "single"
    #: draft-and-verify can reproduce this decoder's token choice exactly (greedy, sampling)
    speculative: bool = False
    #: needs every generated token cached in the last layer, and clones and re-forwards caches
    #: (OPERA's over-trust map, look-ahead and rollback)
    needs_full_decode_cache: bool = False
    #: reads the vision tower's unmerged tokens (DAMRO's outlier branch)
    needs_unmerged_tower: bool = False

    # -- any method ---------------------------------------------------------------------------------
    #: why the method cannot take a video (it transforms or re-prompts the images themselves); ""
    #: = a video's tokens are vision tokens to it. A batch with a video is refused before compute.
    images_only: str = ""
    #: why the method needs a video (it compresses across frames); "" = images serve it. A batch
    #: without a video is refused before compute.
    videos_only: str = ""
    #: what the method needs of the model for *images*, beyond ``needs``: a model that lacks one (and
    #: meets ``needs`` through a video substitute) runs the method on videos only, and a batch with an
    #: image is refused there before compute (:func:`image_refusal`)
    image_needs: frozenset[Need] = frozenset()
    #: why the method's decode-time hooks need the dynamic cache's step, whose keys are exactly the
    #: held tokens (a static step attends over the whole preallocated buffer); "" = the static-cache
    #: step serves it. ``model.compile`` falls back to the dynamic cache with this reason.
    dynamic_decode: str = ""
    #: why the method's decode-time hooks must run as Python in every decode step, so that a static step
    #: cannot be one captured CUDA graph (``model.compile: auto``); "" = it installs nothing that acts
    #: in decode steps (hooks that act at prefill only are installed ``prefill_only``). The installed
    #: hooks are what the runner checks (``LMRunner.capture_blocker``); this names the method and why.
    eager_decode: str = ""


def static_cache_blocker(methods: Iterable[tuple[str, Capabilities]]) -> str | None:
    """Why the static KV cache (``model.compile``) cannot serve these methods ((where, capabilities) pairs) in
    a call, or None. A method that owns the KV cache converts the static one after the prefill into static
    layers of its own over the same buffers (ZipVL's quantised segments)."""
    for where, c in methods:
        if c.dynamic_decode:
            return f"{where}: {c.dynamic_decode}"
        if c.decodes_without_cache:
            return f"{where} decodes without a KV cache"
    return None


def caps_of(cls: type, params: Any) -> Capabilities:
    """The declaration of method class ``cls`` under recipe ``params``."""
    fn = getattr(cls, "capabilities", None)
    if callable(fn):
        return fn(params)
    return getattr(cls, "caps", Capabilities())


@dataclass(frozen=True)
class _Declared:
    where: str  # "pruning[0] (fastv)", "decoding (vcd)", "speculative (msd)"
    name: str
    caps: Capabilities


def _declared(recipe: Recipe) -> tuple[list[_Declared], _Declared, _Declared | None]:
    stages = [
        _Declared(f"pruning[{i}] ({s.method})", s.method, caps_of(PRUNERS.get(s.method).cls, s.params))
        for i, s in enumerate(recipe.pruning)
    ]
    dec = recipe.decoding
    decoder = _Declared(f"decoding ({dec.method})", dec.method, caps_of(DECODERS.get(dec.method).cls, dec.params))
    drafter = None
    if recipe.speculative is not None:
        sp = recipe.speculative
        drafter = _Declared(f"speculative ({sp.method})", sp.method, caps_of(DRAFTERS.get(sp.method).cls, sp.params))
    return stages, decoder, drafter


def check_recipe(recipe: Recipe) -> str | None:
    """A reason the recipe's methods cannot run together, or None. Needs no model."""
    stages, decoder, drafter = _declared(recipe)
    d = decoder.caps
    if drafter is not None:
        if not d.speculative:
            return (
                f"{decoder.where} cannot be combined with speculative drafting ({drafter.where}): its search is "
                f"'{d.search}', which draft verification does not reproduce. Use decoding.method 'greedy' or 'sample' "
                "with a drafter, or remove the speculative section"
            )
        for st in stages:
            c = st.caps
            if c.kv_edit_decode or c.owns_kv_cache or c.decodes_without_cache:
                what = (
                    "owns the KV cache (quantised layers)"
                    if c.owns_kv_cache
                    else "decodes without a KV cache"
                    if c.decodes_without_cache
                    else "edits the KV cache at every decode step"
                )
                fix = f"set {c.decode_free_setting}" if c.decode_free_setting else "remove the speculative section"
                return (
                    f"{st.where} {what}, which speculative verification (several tokens per forward, then a "
                    f"rollback) cannot undo; {fix}"
                )
    for st in stages:
        c = st.caps
        if d.search != "single" and c.decodes_without_cache:
            return (
                f"{st.where} decodes without a KV cache, which only a single-sequence decoder can do; "
                f"{decoder.where} searches with '{d.search}'. Use decoding greedy or sample, or "
                + (f"set {c.decode_free_setting}" if c.decode_free_setting else "keep the cache")
            )
        if d.search == "beam" and c.owns_kv_cache:
            return (
                f"{st.where} owns the KV cache and defines decoding for one sequence per sample; {decoder.where} "
                "is a beam search. Use decoding greedy or sample"
            )
        if d.needs_full_decode_cache and (c.kv_edit_decode or c.decodes_without_cache):
            return (
                f"{decoder.where} needs every generated token cached in the last layer and clones its caches, but "
                f"{st.where} drops generated tokens from the cache while decoding (or decodes without one); "
                + (f"set {c.decode_free_setting}" if c.decode_free_setting else "use another decoder")
            )
        if d.needs_unmerged_tower and c.merges_in_tower:
            return (
                f"{decoder.where} reads the vision tower's unmerged tokens, but {st.where} merges tokens inside the "
                "tower; use a feature-stage pruner instead"
            )
    overriders = [m for m in (*stages, decoder) if m.caps.overrides_llm_attention]
    if len(overriders) > 1:
        a, b = overriders[0], overriders[1]
        return (
            f"{a.where} and {b.where} both replace the LLM's attention computation (one attention override per "
            f"layer); keep one of them, or set {b.name} to its no-op setting"
        )
    for i, st in enumerate(stages):
        c = st.caps
        if c.owns_kv_cache:
            other = next(
                (
                    o
                    for j, o in enumerate(stages)
                    if j != i and (o.caps.kv_edit_prefill or o.caps.kv_edit_decode or o.caps.owns_kv_cache)
                ),
                None,
            )
            if other is not None:
                return f"{st.where} owns the KV cache (mixed-precision layers) and cannot share it with {other.where}, which edits it"
        if c.needs_full_grid:
            # the tower runs before every feature stage, so a merge in the tower comes first wherever it is listed
            earlier = next((o for o in stages[:i] if o.caps.edits_features), None)
            earlier = earlier or next((o for j, o in enumerate(stages) if j != i and o.caps.merges_in_tower), None)
            if earlier is not None and earlier.caps.needs_full_grid:  # no order serves both
                return (
                    f"{st.where} and {earlier.where} both need every image's full patch grid and both change it, so "
                    "whichever runs second cannot have it; keep only one of them"
                )
            if earlier is not None:
                return (
                    f"{st.where} needs every image's full patch grid, but {earlier.where} changes the vision tokens "
                    f"before it; put {st.name} first, or keep only one of them"
                )
        if c.merges_in_tower:
            other = next((o for j, o in enumerate(stages) if j != i and o.caps.merges_in_tower), None)
            if other is not None:
                return f"{st.where} and {other.where} both merge tokens inside the vision tower; keep one of them"
    return None


@dataclass(frozen=True)
class ModelFacts:
    """What the methods' needs and parameters are checked against: read from a loaded model's adapter,
    or from the model's config alone (before any weights load)."""

    family: str
    llm_layers: int
    vision_layers: int
    grid: tuple[int, int]  # (rows, cols) of the base patch grid
    features: ModelFeatures
    image_tokens: int | None = None  # vision tokens of every image at the LLM input; None: each image its own

    @property
    def has_cls(self) -> bool:
        return self.features.cls_token

    @classmethod
    def of_adapter(cls, adapter: VLMAdapter) -> ModelFacts:
        return cls(
            adapter.family,
            len(adapter.layers),
            len(adapter.vision_layers),
            tuple(adapter.grid),
            adapter.features,
            adapter.n_image_tokens,
        )

    @classmethod
    def of_config(cls, config: Any) -> ModelFacts | None:
        """From a transformers config of a supported family (None for any other)."""
        adapter = ADAPTERS.get(getattr(config, "model_type", None))
        if adapter is None:
            return None
        llm_layers, vision_layers, grid = adapter.config_shape(config)
        features = adapter.features_of(config)
        return cls(adapter.family, llm_layers, vision_layers, grid, features, adapter.config_image_tokens(config))


def joins_videos(caps: Capabilities, features: ModelFeatures) -> bool:
    """Whether the session joins each video's frame-group items into one for a method declaring ``caps``
    on a model with ``features`` (``Capabilities.video_join`` on a model whose frame groups are items)."""
    return caps.video_join and features.video and features.video_items == "item_per_frame"


def _met(caps: Capabilities, features: ModelFeatures, need: Need) -> bool:
    """Whether a model with ``features`` meets ``need`` for a method declaring ``caps`` (a video as one
    item is met by the session's join where the method's feature stage alone needs it)."""
    return has(features, need) or (need is Need.VIDEO_ONE_ITEM and joins_videos(caps, features))


def unmet_need(caps: Capabilities, features: ModelFeatures) -> Need | None:
    """The first of the method's needs (``caps``) that a model with ``features`` lacks, with no
    usable substitute; None when the method runs there."""
    for need in NEED_ORDER:
        if need not in caps.needs or _met(caps, features, need):
            continue
        substitute = caps.substitutes.get(need)
        if substitute is not None and all(_met(caps, features, n) for n in substitute):
            continue
        return need
    return None


def image_refusal(where: str, caps: Capabilities, facts: ModelFacts) -> str | None:
    """Why the method at ``where`` takes no image on the model of ``facts`` (it runs there on videos
    only: an unmet ``image_needs``), or None."""
    need = next((n for n in NEED_ORDER if n in caps.image_needs and not has(facts.features, n)), None)
    if need is None:
        return None
    have = what_it_has(facts.features, need)
    why = caps.why.get(need, "")
    return (
        f"{where} needs a video on this model ({facts.family}) and takes no image: for images it needs "
        f"{need.value}, which this model does not have"
        + (f" ({have})" if have else "")
        + (f": {why}" if why else "")
        + "; pass videos=..., or use an image pruner (e.g. divprune, fastv) for images"
    )


def videos_only_on(caps: Capabilities, features: ModelFeatures) -> bool:
    """Whether a method declaring ``caps`` needs a video on a model with ``features`` (its
    ``videos_only``, or an ``image_needs`` the model lacks)."""
    return bool(caps.videos_only) or any(not has(features, n) for n in caps.image_needs)


def runs_on(registry: Registry, features: ModelFeatures) -> list[str]:
    """The methods of ``registry`` (at their defaults) that run on a model with ``features``."""
    return [e.name for e in registry.entries() if unmet_need(caps_of(e.cls, None), features) is None]


def supported_families(caps: Capabilities) -> list[str]:
    """The registered model families (``mmfast.models.ADAPTERS``) a method declaring ``caps`` runs on."""
    return [adapter.family for adapter in ADAPTERS.values() if unmet_need(caps, adapter.features) is None]


def supported_families_marked(caps: Capabilities, only: set[str] | None = None) -> list[str]:
    """:func:`supported_families` (those in ``only``, where given), each marked " (videos only)" where the
    method takes no image there (:func:`videos_only_on`)."""
    return [
        family + (" (videos only)" if videos_only_on(caps, ADAPTERS[family].features) else "")
        for family in supported_families(caps)
        if only is None or family in only
    ]


def listed_families(cls: type, config_cls: type | None) -> list[str]:
    """The families method class ``cls`` runs on (:func:`supported_families_marked`) with its defaults, then
    those only its ``family_params`` reach, each marked " with <those params>" (``mmfast list -v``)."""
    default = caps_of(cls, None)
    listed = sorted(supported_families_marked(default))
    if cls.family_params and config_cls is not None:
        caps = caps_of(cls, dataclasses.replace(config_cls(), **cls.family_params))
        more = set(supported_families(caps)) - set(supported_families(default))
        with_ = ", ".join(cls.family_params)
        listed += sorted(f"{f} with {with_}" for f in supported_families_marked(caps, only=more))
    return listed


def refusal(where: str, caps: Capabilities, facts: ModelFacts, registry: Registry) -> str | None:
    """Why the method at ``where`` (declaring ``caps``, one of ``registry``) cannot run on the model
    of ``facts``, or None: the need it lacks, the family, the method's own words on why, and what to
    use instead. The one place that decides family support."""
    need = unmet_need(caps, facts.features)
    if need is None:
        return None
    have = what_it_has(facts.features, need)
    why = caps.why.get(need, "")
    ok = runs_on(registry, facts.features)
    return (
        f"{where} needs {need.value}, which this model ({facts.family}) does not have"
        + (f" ({have})" if have else "")
        + (f": {why}" if why else "")
        + f"; {registry.kind} methods that run there: {', '.join(ok) or 'none'}"
    )


def _methods(recipe: Recipe):
    """(recipe path of the params, method class, params) of every method in the recipe."""
    for i, st in enumerate(recipe.pruning):
        yield f"pruning[{i}].params", PRUNERS.get(st.method).cls, st.params
    yield "decoding.params", DECODERS.get(recipe.decoding.method).cls, recipe.decoding.params
    if recipe.speculative is not None:
        yield "speculative.params", DRAFTERS.get(recipe.speculative.method).cls, recipe.speculative.params


def check_model(recipe: Recipe, model: VLMAdapter | ModelFacts) -> str | None:
    """A reason the recipe's methods cannot run on the model (a loaded adapter, or the facts of its
    config before loading), or None. Parameters and budgets that do not fit the model (a layer it does not have,
    more tokens than its images have) raise :class:`~mmfast.errors.ConfigError` at their recipe path."""
    facts = model if isinstance(model, ModelFacts) else ModelFacts.of_adapter(model)
    stages, decoder, drafter = _declared(recipe)
    kinds = [(st, PRUNERS) for st in stages] + [(decoder, DECODERS)] + ([(drafter, DRAFTERS)] if drafter else [])
    for item, registry in kinds:
        problem = refusal(item.where, item.caps, facts, registry)
        if problem:
            return problem
    if facts.image_tokens is not None:  # every image one count: a budget above it is refused now
        for i, stage in enumerate(recipe.pruning):
            if stage.budget is not None:
                stage.budget.check_fits(facts.image_tokens, f"pruning[{i}].budget")
    for path, cls, params in _methods(recipe):
        check = getattr(cls, "check_facts", None)
        if check is None or params is None:
            continue
        try:
            check(params, facts)
        except ConfigError as exc:
            raise ConfigError(f"{path}.{exc.path}" if exc.path else path, exc.detail, exc.source) from None
    return None


def media_refusal(recipe: Recipe, *, images: bool, videos: bool, model: ModelFacts | None = None) -> str | None:
    """Why a method of the recipe cannot take a run's inputs (``images``: some samples are images;
    ``videos``: some are videos), or None: a method that takes images only (``Capabilities.images_only``)
    on videos, one that needs a video (``videos_only``) on images, or, where ``model`` (its facts, or the
    loaded adapter) is known, one that takes videos only on that model (an unmet ``image_needs``)."""
    stages, decoder, drafter = _declared(recipe)
    for item in [*stages, decoder, *([drafter] if drafter is not None else [])]:
        if videos and item.caps.images_only:
            return f"{item.where} takes images only ({item.caps.images_only})"
        if images and item.caps.videos_only:
            return f"{item.where} needs a video ({item.caps.videos_only})"
        if images and model is not None:
            problem = image_refusal(item.where, item.caps, model)
            if problem:
                return problem
    return None


def video_families() -> list[str]:
    """The registered model families with video input (``ModelFeatures.video``)."""
    return list(dict.fromkeys(adapter.family for adapter in ADAPTERS.values() if adapter.features.video))


def model_facts(recipe: Recipe) -> ModelFacts | None:
    """The facts of the recipe's model from its config alone, or None when the config cannot be read
    without a download (a hub id not in the local cache)."""
    return _facts_of_model_name(recipe.model.name, recipe.model.revision)


def check_model_config(recipe: Recipe) -> None:
    """Check the recipe against its model's config before any weights load (``mmfast validate``,
    ``run``, ``eval``, ``bench``): the methods' needs, layer indices and grids. Silent when the config
    cannot be read without a download (a hub id not in the local cache)."""
    facts = _facts_of_model_name(recipe.model.name, recipe.model.revision)
    if facts is None:
        logging.getLogger(__name__).debug(
            "no local config for %s: methods are checked once it loads", recipe.model.name
        )
        return
    problem = check_model(recipe, facts)
    if problem:
        raise IncompatibleRecipeError(f"{problem} (model {recipe.model.name})")


def _facts_of_model_name(name: str, revision: str | None) -> ModelFacts | None:
    from transformers import AutoConfig

    path, local = _resolve(name)  # a local path that does not exist is an error now, not at load time
    try:
        config = AutoConfig.from_pretrained(path, revision=revision, local_files_only=True)
    except (OSError, ValueError, ModelLoadError):
        return None
    return ModelFacts.of_config(config)
