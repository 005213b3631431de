"""Model-family adapters. :func:`adapter_for` picks one from ``config.model_type``."""

from __future__ import annotations

from torch import nn

from ..errors import ModelLoadError
from .base import LMInputs, VisionBatch, VLMAdapter, build_lm_inputs
from .llava import LlavaAdapter
from .llava_next import LlavaNextAdapter
from .llava_onevision import LlavaOnevisionAdapter
from .qwen2_vl import Qwen2_5_VLAdapter, Qwen2VLAdapter, Qwen3VLAdapter

ADAPTERS: dict[str, type[VLMAdapter]] = {
    "llava": LlavaAdapter,
    "llava_next": LlavaNextAdapter,
    "llava_onevision": LlavaOnevisionAdapter,
    "qwen2_vl": Qwen2VLAdapter,
    "qwen2_5_vl": Qwen2_5_VLAdapter,
    "qwen3_vl": Qwen3VLAdapter,
}


def _llava():
    from transformers import LlavaForConditionalGeneration

    return LlavaForConditionalGeneration


def _llava_next():
    from transformers import LlavaNextForConditionalGeneration

    return LlavaNextForConditionalGeneration


def _llava_onevision():
    from transformers import LlavaOnevisionForConditionalGeneration

    return LlavaOnevisionForConditionalGeneration


def _class(name: str):
    def get():
        import transformers

        return getattr(transformers, name)

    return get


#: model_type -> (lazy) processor class, for families whose HF processor mmfast cannot build as it is
PROCESSOR_CLASSES = {
    "llava_onevision": lambda: __import__(
        "mmfast.models.llava_onevision", fromlist=["image_processor_class"]
    ).image_processor_class()
}

#: model_type -> (lazy) model class
MODEL_CLASSES = {
    "llava": _llava,
    "llava_next": _llava_next,
    "llava_onevision": _llava_onevision,
    "qwen2_vl": _class("Qwen2VLForConditionalGeneration"),
    "qwen2_5_vl": _class("Qwen2_5_VLForConditionalGeneration"),
    "qwen3_vl": _class("Qwen3VLForConditionalGeneration"),
}

#: model types recognised but refused, with the reason
_REJECTED: dict[str, str] = {}


def adapter_for(model: nn.Module) -> VLMAdapter:
    model_type = getattr(model.config, "model_type", None)
    if model_type in ADAPTERS:
        return ADAPTERS[model_type](model)
    if model_type in _REJECTED:
        raise ModelLoadError(_REJECTED[model_type])
    raise ModelLoadError(f"model_type {model_type!r} has no mmfast adapter (supported: {', '.join(sorted(ADAPTERS))})")


__all__ = [
    "ADAPTERS",
    "MODEL_CLASSES",
    "PROCESSOR_CLASSES",
    "LMInputs",
    "LlavaAdapter",
    "LlavaNextAdapter",
    "LlavaOnevisionAdapter",
    "Qwen2VLAdapter",
    "Qwen2_5_VLAdapter",
    "Qwen3VLAdapter",
    "VLMAdapter",
    "VisionBatch",
    "adapter_for",
    "build_lm_inputs",
]
