"""The shared budget vocabulary of pruning stages (``budget: {tokens: B}`` / ``budget: {flops: r}``).

A stage's :class:`~mmfast.config.Budget` is resolved when the session installs it:

1. ``flops`` becomes ``tokens`` with :func:`mmfast.flops.tokens_for_flops_ratio` on the loaded model's
   LLM shape and its vision tokens per image (typical prompt of ``TYPICAL_TEXT_TOKENS`` text tokens);
2. methods with count knobs map ``tokens`` to them in their ``budget_params`` classmethod (closed form,
   documented in each method's docstring): feature/tower-stage methods count tokens per image at the
   LLM input, in-LLM methods count the layer-averaged tokens per image (:func:`in_llm_keep`);
   Under dynamic resolution (Qwen-VL: ``adapter.dynamic_resolution``) an image's token count is its
   own, so a budget is a *fraction*: B tokens means B / N_ref of each image's tokens, N_ref =
   ``vision_tokens_per_image(adapter)`` = 576 (the LLaVA-1.5 count the papers' 192/128/64 refer to;
   the adapter's budget reference grid). Methods map it onto a per-image ratio (:func:`budget_fraction`).
3. methods whose knobs are thresholds (MustDrop, ZipVL) are *calibrated* after installation: a bisection on
   one scalar of their thresholds, measured on :func:`calibration_batch` (a fixed, offline set of
   rendered world images with POPE-style questions), until the mean layer-averaged vision tokens are
   within ``CALIBRATION_TOLERANCE`` of the budget (:func:`calibrate_scalar`).
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
    rows, cols = adapter.grid
    return rows * cols


def budget_fraction(adapter: VLMAdapter) -> bool:
    """True when budgets are fractions of each image's own token count: dynamic resolution (Qwen-VL,
    ``adapter.dynamic_resolution``) or anyres-max packing (LLaVA-OneVision, ``budget_scales_with_tokens``);
    the reference count is ``vision_tokens_per_image(adapter)`` (576, or OneVision's base view N0)."""
    return bool(getattr(adapter, "dynamic_resolution", False) or getattr(adapter, "budget_scales_with_tokens", False))


def budget_tokens(budget: Budget, adapter: VLMAdapter, path: str) -> int:
    """The budget in vision tokens per image for this model (``flops`` converted, see module doc)."""
    if budget.tokens is not None:
        return budget.tokens
    try:
        return tokens_for_flops_ratio(budget.flops, LMShape.of(adapter.text_config), vision_tokens_per_image(adapter))
    except ValueError as exc:
        raise ConfigError(f"{path}.flops", str(exc)) from None


def in_llm_keep_at(tokens: int, adapter: VLMAdapter, k: float, layer_mapping: str, path: str) -> tuple[int, int]:
    """(keep, N_ref) for a method pruning at its layer ``k`` (mapped onto this LLM's depth): the vision
    tokens kept per reference-sized image after that layer so the layer average is ``tokens``."""
    n_layers = len(adapter.layers)
    ((layer, _),) = map_layers([k], n_layers, layer_mapping)
    n_ref = vision_tokens_per_image(adapter)
    return in_llm_keep(tokens, n_ref, layer, n_layers, path), n_ref


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
            f"{tokens} layer-averaged tokens is infeasible when pruning at layer {k} of {L} with {n} vision tokens per "
            f"image: the smallest feasible budget is {lo} (keep 0 after layer {k}), the largest {n}; "
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
        step = max(1, len(samples) // n)
        picked, seen = [], set()
        for start in range(0, len(samples), step):
            stretch = samples[start : start + step]
            fresh = next((s for s in stretch if str(s.image) not in seen), stretch[0])
            picked.append(fresh)
            seen.add(str(fresh.image))
            if len(picked) == n:
                break
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
