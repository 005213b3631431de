"""Model-family adapters. :func:`adapter_for` picks one from ``config.model_type``."""

from __future__ import annotations

from torch import nn

from ..errors import ModelLoadError
from .base import LMInputs, VisionBatch, VLMAdapter, build_lm_inputs
from .llava import LlavaAdapter

ADAPTERS: dict[str, type[VLMAdapter]] = {"llava": LlavaAdapter}

_REJECTED = {
    "llava_next": "LLaVA-NeXT (anyres tiles with image_newline) is not supported yet; its per-tile token "
    "layout breaks the single-grid assumptions of the pruning methods. Use a LLaVA-1.5 checkpoint "
    "(e.g. llava-hf/llava-1.5-7b-hf).",
    "llava_onevision": "LLaVA-OneVision (SigLIP without CLS, anyres_max_9) is not supported.",
    "qwen2_vl": "Qwen2-VL (M-RoPE positions, PatchMerger) is not supported.",
}


def adapter_for(model: nn.Module) -> VLMAdapter:
    model_type = getattr(model.config, "model_type", None)
    if model_type in ADAPTERS:
        return ADAPTERS[model_type](model)
    if model_type in _REJECTED:
        raise ModelLoadError(_REJECTED[model_type])
    raise ModelLoadError(
        f"model_type {model_type!r} has no mmfast adapter (supported: {', '.join(sorted(ADAPTERS))})"
    )


__all__ = ["ADAPTERS", "LMInputs", "VisionBatch", "VLMAdapter", "adapter_for", "build_lm_inputs", "LlavaAdapter"]
