"""The shared budget vocabulary of pruning stages (``budget: {tokens: N}`` / ``{ratio: r}`` / ``{flops: f}``).

A budget is a rule per visual input (an image, or a whole video), applied to that input's own vision-token
count N_i at the LLM input, on every model family: LLaVA-1.5 (576 for every image), LLaVA-NeXT and
LLaVA-OneVision (anyres: each image its own count), Qwen-VL (dynamic resolution). :class:`ImageBudget`
turns it into the target of one image (:meth:`ImageBudget.target`):

- ``tokens: N``: N (an image with fewer than N vision tokens is refused, naming both counts);
- ``ratio: r``: round(r * N_i), at least 1 (the fraction of the image's tokens kept);
- ``flops: f``: :func:`mmfast.flops.tokens_for_flops_ratio` at N_i on the loaded model's LLM shape
  (typical prompt of ``TYPICAL_TEXT_TOKENS`` text tokens).

Feature/tower-stage methods keep the target at the LLM input; in-LLM methods keep it as the
layer-averaged vision tokens of the image (:func:`in_llm_keep`). Each method maps a target onto its own
knobs in its ``budget_params(tokens, n, ...)`` classmethod (closed form, documented in its docstring),
with n the image's real count: where every image of the model has the same count (LLaVA-1.5:
:meth:`~mmfast.models.base.VLMAdapter.config_image_tokens`), once when the session installs the stage
(an infeasible budget is refused there, before any compute, and by ``mmfast validate`` from the config);
elsewhere per image count as the images arrive (``Pruner.config_for``), after the vision tower and before any pruning or
LLM compute (``Session.encode`` checks every image; a ``tokens`` budget above an item's count already before the tower
where the adapter reads the counts from the batch, ``VLMAdapter.counts_before_tower``).
Methods whose knobs are thresholds (MustDrop, ZipVL) are *calibrated* after installation: a bisection on
one scalar of their thresholds, measured on :func:`calibration_batch` (a fixed, offline set of rendered
world images with POPE-style questions), until the mean layer-averaged vision tokens are within
``CALIBRATION_TOLERANCE`` of the target (:func:`calibrate_scalar`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..decoding.base import state_accounting
from ..errors import ConfigError
from ..flops import LMShape, tokens_for_flops_ratio
from ..inputs import PreparedBatch, open_image
from ._common import map_layers

if TYPE_CHECKING:
    from ..config import Budget
    from ..context import MethodContext
    from ..models.base import VLMAdapter

logger = logging.getLogger(__name__)

CALIBRATION_IMAGES = 24
#: samples of an evaluation its budgets are calibrated on (``CalibrationSet.spread``): an adaptive method's
#: count varies mostly with the image, so 24 samples (24 of the pruning bench's 144 images) landed
#: MustDrop 6-8% above its budget on that bench's 1000 samples; 64 land within 1% of the whole
#: evaluation's mean when each takes a new image (every 15th sample, repeating images, missed by 4-9%)
EVAL_CALIBRATION_SAMPLES = 64
CALIBRATION_TOLERANCE = 0.02
CALIBRATION_STEPS = 24
_QUESTIONS = ("Is there a {} in the image?", "Is there a {} in this picture?")
_OBJECTS = ("person", "dog", "chair", "car", "cup", "bicycle", "cat", "bottle", "bench", "laptop", "bird", "umbrella")
_CAPTION = "Please describe this image in detail."  # every eighth prompt: thresholds react to the prompt
_SUFFIX = "\nAnswer the question using a single word or phrase."


def vision_tokens_per_image(adapter: VLMAdapter) -> int:
    """Tokens of the adapter's base patch grid (LLaVA-1.5: 576; OneVision: a base view's N0; Qwen-VL:
    the 24 x 24 grid the model facts report). The real count of every image only where
    ``adapter.n_image_tokens`` says so; used for no-op and test settings, never to scale a budget."""
    rows, cols = adapter.grid
    return rows * cols


@dataclass(frozen=True)
class ImageBudget:
    """A stage's recipe budget as a rule per image (module docstring)."""

    budget: Budget
    shape: LMShape  # the loaded LLM's shape (``flops`` budgets)
    path: str  # the recipe path of the budget, e.g. ``pruning[0].budget``
    #: whether the stage takes ``ratio`` / ``flops`` here (False: it maps one ``tokens`` budget for images of
    #: different counts, :meth:`same_for_every_image`)
    fractions: bool = True

    def target(self, n: int, item: str = "image") -> int:
        """The target of an image (or ``item``) of ``n`` vision tokens (tokens kept, or layer-averaged tokens)."""
        b = self.budget
        if b.tokens is not None:
            b.check_fits(n, self.path, item, self.fractions)
            return b.tokens
        if b.ratio is not None:
            return max(1, round(b.ratio * n))
        try:
            return tokens_for_flops_ratio(b.flops, self.shape, n)
        except ValueError as exc:
            raise ConfigError(f"{self.path}.flops", f"{exc} (an image of {n} vision tokens)") from None

    def knobs(self, cls: type, tokens: int, n: int | None, adapter: VLMAdapter, config) -> dict:
        """``cls.budget_params`` for the target ``tokens`` of an image of ``n`` vision tokens; a refusal of
        a ``ratio`` / ``flops`` budget names that key and the target it gave for the image."""
        try:
            return cls.budget_params(tokens, n, adapter, config, self.path)
        except ConfigError as exc:
            key = self.budget.key
            if key == "tokens" or exc.path != f"{self.path}.tokens":
                raise
            raise ConfigError(
                f"{self.path}.{key}",
                f"{key}: {getattr(self.budget, key)} is {tokens} tokens for an image of {n} vision tokens; {exc.detail}",
            ) from None

    def same_for_every_image(self, what: str, why: str) -> int:
        """``tokens`` where a stage maps its budget once for images of different counts (``why``); other
        keys are refused (their target depends on each image's count), naming ``what`` cannot follow them."""
        if self.budget.tokens is None:
            raise ConfigError(
                f"{self.path}.{self.budget.key}",
                f"{what} maps its budget once for all images, and {why}, so a fraction of each image cannot be "
                "followed; give budget: {tokens: N}",
            )
        return self.budget.tokens


def in_llm_keep_at(tokens: int, n: int, adapter: VLMAdapter, k: float, layer_mapping: str, path: str) -> int:
    """The vision tokens kept after a method's pruning layer ``k`` (mapped onto this LLM's depth) by an
    image of ``n`` vision tokens, so the layer average is ``tokens`` (:func:`in_llm_keep`)."""
    n_layers = len(adapter.layers)
    ((layer, _),) = map_layers([k], n_layers, layer_mapping)
    return in_llm_keep(tokens, n, layer, n_layers, path)


def in_llm_keep(tokens: int, n_vision: int, layer: int, n_layers: int, path: str) -> int:
    """Kept vision tokens per image after ``layer`` so the layer average is ``tokens``.

    avg = (K * N + (L - K) * keep) / L  =>  keep = (L * avg - K * N) / (L - K), rounded to the
    nearest token (the average then lands within (L - K) / (2 L) of the budget). Budgets below
    K * N / L (keep = 0) or above N are refused, naming the feasible range.
    """
    k, n, L = layer, n_vision, n_layers
    lo = math.ceil(k * n / L)
    if tokens > n or tokens < lo:
        raise ConfigError(
            f"{path}.tokens",
            f"{tokens} layer-averaged tokens is infeasible when pruning at layer {k} of {L} with {n} vision tokens in "
            f"this image: the smallest feasible budget is {lo} (keep 0 after layer {k}), the largest {n}; "
            "use a larger budget or an earlier pruning layer",
        )
    return max(0, min(n, round((L * tokens - k * n) / (L - k))))


def calibration_prompt(i: int) -> str:
    """The ``i``-th calibration prompt: POPE-style questions, every eighth a detailed-caption request
    (roughly the mix of the shipped evaluation recipes, which ask far more questions than captions)."""
    if i % 8 == 7:
        return _CAPTION
    return _QUESTIONS[i % 2].format(_OBJECTS[i % len(_OBJECTS)]) + _SUFFIX


@dataclass(frozen=True)
class CalibrationSet:
    """Samples a budget is calibrated on: an evaluation passes a spread of its own samples (so the
    calibrated mean is the evaluation's mean, whatever its mix of tasks); without one, the rendered
    world set of :func:`calibration_batch` is used."""

    images: tuple[str, ...]  # image paths
    prompts: tuple[str, ...]

    @property
    def identity(self) -> str:
        import hashlib

        return hashlib.sha256("\n".join([*self.images, *self.prompts]).encode()).hexdigest()[:16]

    @classmethod
    def spread(cls, samples: list, n: int = EVAL_CALIBRATION_SAMPLES) -> CalibrationSet:
        """``n`` samples (objects with ``image`` and ``prompt``) at evenly spaced positions, so tasks keep
        their shares; each position takes the first sample of its stretch whose image is not picked yet
        (a repeat only where the whole stretch repeats), so the set covers as many images as it can."""
        # n stretches spanning every sample (sizes differ by at most one): a whole step len // n left the tail
        # out, up to half the samples (127 of them, n = 64: the first 64), so a task listed last lost its share
        count = min(n, len(samples))
        bounds = [i * len(samples) // count for i in range(count + 1)] if count else []
        picked, seen = [], set()
        for start, end in zip(bounds, bounds[1:]):
            stretch = samples[start:end]
            fresh = next((s for s in stretch if str(s.image) not in seen), stretch[0])
            picked.append(fresh)
            seen.add(str(fresh.image))
        return cls(tuple(str(s.image) for s in picked), tuple(s.prompt for s in picked))


def calibration_batch(ctx: MethodContext, n: int = CALIBRATION_IMAGES) -> PreparedBatch:
    """A fixed, offline calibration batch: ``n`` rendered world images (seed 0, split val, every 20th
    id) with :func:`calibration_prompt` prompts under the model's chat template. Adaptive methods'
    counts vary a lot between images and prompts, so a few samples do not predict an evaluation's
    mean: two dozen of both kinds do (measured in benchmarks/pruning)."""
    from ..world import render_image

    given: CalibrationSet | None = ctx.calibration_set
    if given is not None:  # the evaluation's own samples
        images = [open_image(p) for p in given.images]
        prompts = list(given.prompts)
    else:
        images = [render_image(0, "val", 20 * i).image.convert("RGB") for i in range(n)]
        prompts = [calibration_prompt(i) for i in range(n)]
    n = len(images)  # a given set has its own size
    texts = [ctx.chat_text(p, 1) for p in prompts]
    ids = [ctx.tokenizer(t, add_special_tokens=True)["input_ids"] for t in texts]
    processed = ctx.image_processor(images=images, return_tensors="pt")
    pixels, sizes = ctx.adapter.pack_pixels(processed)
    return PreparedBatch(
        [[im] for im in images], prompts, texts, ids, pixels.to(ctx.device, ctx.dtype), list(range(n)), [], sizes
    )


@torch.inference_mode()
def measure_layer_avg(ctx: MethodContext, batch: PreparedBatch) -> float:
    """Mean layer-averaged vision tokens per image of one prefill of ``batch`` (samples run one by one,
    so no decision depends on the batch)."""
    values = []
    for b in range(batch.batch_size):
        one = _sample(batch, b)
        vision = ctx.encode(one)
        state, _ = ctx.runner.prefill(ctx.build_inputs(one, vision))
        values.append(state_accounting(state).vision_layer_avg[0] / len(one.image_owner))
    return sum(values) / len(values)


def _sample(batch: PreparedBatch, b: int) -> PreparedBatch:
    idx = [i for i, o in enumerate(batch.image_owner) if o == b]
    sizes = None if batch.image_sizes is None else batch.image_sizes[idx]
    return PreparedBatch(
        [batch.images[b]],
        [batch.prompts[b]],
        [batch.texts[b]],
        [batch.token_ids[b]],
        batch.pixel_values[idx],
        [0] * len(idx),
        [],
        sizes,
    )


#: calibrated settings already found in this process: (model identity, the recipe's stages, stage index)
#: -> the stage's setting. A session that opens the same stages on the same, unmodified model again (a
#: benchmark opens each variant several times) reuses it instead of bisecting again.
_CALIBRATED: dict[tuple, dict] = {}


def calibration_key(model, stages: list[dict], index: int, calibration: CalibrationSet | None = None) -> tuple:
    """Identity of a calibration: the model object and the in-place-modification counters of its
    parameters (so a model trained since is calibrated anew), the recipe's stages, the stage index."""
    import json

    # inference tensors (a model built under inference mode) cannot change in place: no counter to read
    versions = sum(0 if p.is_inference() else p._version for p in model.parameters())
    return (
        id(model),
        versions,
        json.dumps(stages, sort_keys=True),
        index,
        calibration.identity if calibration else None,
    )


def calibrate_once(pruner, tokens: int, key: tuple) -> None:
    """``pruner.calibrate(tokens)``, or the setting an identical earlier calibration found."""
    setting = _CALIBRATED.get(key)
    if setting is not None:
        pruner.apply_calibrated(setting)
        logger.info("%s: reusing this process's calibration for budget %d", pruner.name, tokens)
        return
    pruner.calibrate(tokens)
    _CALIBRATED[key] = pruner.calibrated_setting()


@dataclass(frozen=True)
class Calibration:
    """Where a calibration landed: the scalar, the tokens it keeps, and the target."""

    value: float
    tokens: float
    target: int
    steps: int

    def as_stats(self) -> dict:
        return {"value": self.value, "tokens": round(self.tokens, 3), "target": self.target, "steps": self.steps}


def calibrate_scalar(
    name: str,
    measure: Callable[[float], float],
    target: int,
    lo: float,
    hi: float,
    *,
    increasing: bool,
    log_scale: bool = False,
    tolerance: float = CALIBRATION_TOLERANCE,
    steps: int = CALIBRATION_STEPS,
) -> Calibration:
    """Bisection on a scalar in [lo, hi] until ``measure(x)`` (mean layer-averaged tokens) is within
    ``tolerance`` of ``target``; ``increasing``: tokens grow with x. Returns the closest setting found
    (logged with a warning when the tolerance was not reached: the tokens are too coarse)."""
    best: Calibration | None = None
    a, b = lo, hi
    for step in range(1, steps + 1):
        x = math.sqrt(a * b) if log_scale else (a + b) / 2
        got = measure(x)
        if best is None or abs(got - target) < abs(best.tokens - target):
            best = Calibration(x, got, target, step)
        if abs(got - target) <= tolerance * target:
            break
        if (got < target) == increasing:
            a = x
        else:
            b = x
    assert best is not None
    level = logging.INFO if abs(best.tokens - target) <= tolerance * target else logging.WARNING
    logger.log(
        level,
        "%s: calibrated to %.6g -> %.2f layer-averaged vision tokens (budget %d, %d steps)",
        name,
        best.value,
        best.tokens,
        target,
        best.steps,
    )
    return best


def check_reachable(
    path: str, measure: Callable[[float], float], target: int, lo: float, hi: float, *, increasing: bool
) -> None:
    """Refuse a budget outside what the scalar's range [lo, hi] can reach on the calibration set
    (with ``CALIBRATION_TOLERANCE`` slack), naming the reachable range."""
    a, b = measure(lo), measure(hi)
    least, most = (a, b) if increasing else (b, a)
    if target < least * (1 - CALIBRATION_TOLERANCE) or target > most * (1 + CALIBRATION_TOLERANCE):
        raise ConfigError(
            f"{path}.tokens",
            f"{target} layer-averaged vision tokens is out of reach of this method's thresholds on this model: "
            f"its calibration set keeps between {least:.1f} and {most:.1f}; pick a budget in that range",
        )
