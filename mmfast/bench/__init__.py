"""``mmfast bench``: baselines and methods in one process, on the same inputs, reported as ratios."""

from __future__ import annotations

import logging
import shlex
import sys
from typing import Any

from ..capabilities import check_model_config
from ..config import Recipe
from ..errors import InputError, MMFastError
from ..eval.fingerprint import weights_fingerprint
from ..eval.runner import output_dir
from ..model import load_model
from ..pipeline import apply
from .common import check_same_samples, claim_bench_dir, variants

logger = logging.getLogger(__name__)


def _preflight(mm, vs) -> None:
    """Install and remove every variant's hooks once (trained weights found, layers compatible with
    this model) so that a bad variant fails before hours of work, not after."""

    for v in vs:
        try:
            with apply(mm, v.recipe):
                pass
        except MMFastError as exc:
            raise InputError(f"bench variant {v.name!r} cannot run on this model: {exc}") from exc


def run_bench(recipe: Recipe, *, output: str | None = None, limit: int | None = None) -> dict[str, Any]:
    """Run ``recipe.bench`` and write ``summary.json``, ``results.md`` and plots to the output dir."""

    kind = recipe.bench.kind
    if kind == "none":
        raise InputError(
            "the recipe has no benchmark (set bench.kind: pruning | decoding | speculative | gpu_speed | video_cost)"
        )
    out = output_dir(recipe, output)  # ~ is the home directory
    command = (
        "mmfast " + " ".join(shlex.quote(a) for a in sys.argv[1:])
        if sys.argv and "mmfast" in sys.argv[0]
        else f"mmfast bench {recipe.name}"
    )
    if kind == "gpu_speed":  # its own random-weight models per shape (and the embedded model for tau)
        from .gpu_speed import run_gpu_speed

        claim_bench_dir(out, kind, recipe.name)  # a new --output folder is created (a re-run resumes in it)
        result = run_gpu_speed(recipe, out, command)
        result["table"] = (out / "results.md").read_text()
        return result

    if kind == "video_cost":  # its own random-weight video shapes, one video-world clip
        from .video_cost import VideoCostParams, run_video_cost

        VideoCostParams.of(recipe)  # bad shapes / frames / depth refused before the output folder is made
        variants(recipe)
        claim_bench_dir(out, kind, recipe.name)
        result = run_video_cost(recipe, out, command)
        result["table"] = (out / "results.md").read_text()
        return result

    vs = variants(recipe)  # validate every compared variant before loading anything

    for v in vs:  # and against the model's config (layers, grids, families), still before any weights load
        try:
            check_model_config(v.recipe)
        except MMFastError as exc:
            raise InputError(f"bench variant {v.name!r} cannot run on this model: {exc}") from exc

    if kind in ("pruning", "decoding"):  # every variant's evaluation on the baseline's samples
        check_same_samples(vs, limit)
    if kind == "speculative":  # it decodes at bench.params.temperatures, never by a variant's decoding section
        from .speculative import check_decoding_unread, run_speculative_bench, write_speculative_report

        check_decoding_unread(vs)
    claim_bench_dir(out, kind, recipe.name)  # before the model loads; never over a user's own files
    mm = load_model(recipe.model)
    _preflight(mm, vs)

    model = {"name": recipe.model.name, "weights_fingerprint": weights_fingerprint(mm.model)}
    if kind == "pruning":
        from .pruning import run_pruning_bench, write_pruning_report

        result = run_pruning_bench(recipe, mm, out, limit)
        result["model"] = model
        write_pruning_report(result, out, command)
    elif kind == "decoding":
        from .decoding import run_decoding_bench, write_decoding_report

        result = run_decoding_bench(recipe, mm, out, limit)
        result["model"] = model
        write_decoding_report(result, out, command)
    elif kind == "speculative":
        result = run_speculative_bench(recipe, mm, out, limit)
        result["model"] = model
        write_speculative_report(result, out, command)
    else:
        raise InputError(f"bench.kind {kind!r} is not implemented")
    result["table"] = (out / "results.md").read_text()
    return result
