"""All knowledge about transformers versions lives here.

mmfast pins ``transformers>=5.22,<5.24`` (tested: 5.22.2 and 5.23.0) and Python 3.11-3.12. Behaviour that hooks rely on and
that changed inside 5.x:

- ``DynamicCache.crop(n)``: 5.0 took a target length; 5.22+ take ``-tokens_to_remove`` only.
- ``forward(..., mm_encoder_outputs=...)`` and ``get_image_features(...).pooler_output`` as a list of
  per-image tensors (5.x; 4.x returned one tensor).
- Model forwards no longer take ``cache_position``; positions derive from the cache length.
- A 4-D ``attention_mask`` is passed through the mask factory unchanged (``masking_utils``), which is
  how mmfast feeds per-layer masks after pruning and tree masks for speculative verification.
- An attention implementation name missing from ``AttentionMaskInterface`` gets no mask at all, so the
  probe registers its mask function next to its attention function.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
import transformers
from packaging.version import Version
from transformers import AttentionInterface
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

logger = logging.getLogger(__name__)

TRANSFORMERS_MIN = "5.22"
TRANSFORMERS_MAX_EXCLUSIVE = "5.24"
TESTED_VERSIONS = ("5.22.2", "5.23.0")
#: Python range of ``pyproject.toml``'s ``requires-python``. The floor is transformers': every release
#: from 5.21 on declares ``Requires-Python >=3.11``, so no Python 3.10 can install the pinned range.
#: CI and ``make`` run 3.11 (its CPU torch wheel is what installs offline here); the others are checked
#: by installing the wheel into fresh venvs and running ``mmfast eval world_eval --limit 5``
#: (docs/install.md).
PYTHON_MIN = "3.11"
PYTHON_MAX_EXCLUSIVE = "3.13"
PYTHON_TESTED = ("3.11.7", "3.12.1")

_version = Version(transformers.__version__)
if not (Version(TRANSFORMERS_MIN) <= _version < Version(TRANSFORMERS_MAX_EXCLUSIVE)):
    logger.warning(
        "mmfast is tested with transformers %s..%s (exclusive); found %s. Hooks may break: "
        "pip install 'transformers>=%s,<%s'",
        TRANSFORMERS_MIN,
        TRANSFORMERS_MAX_EXCLUSIVE,
        transformers.__version__,
        TRANSFORMERS_MIN,
        TRANSFORMERS_MAX_EXCLUSIVE,
    )


def versions() -> dict[str, str]:
    """Versions of the packages that change numbers, for run protocols."""
    import accelerate
    import tokenizers

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "accelerate": accelerate.__version__,
    }


# --------------------------------------------------------------------------- modules


def vision_encoder(tower):
    """The encoder (with ``.layers``) of a CLIP/SigLIP vision tower.

    5.22+ flatten ``CLIPVisionModel`` (``tower.encoder``); earlier releases nest it under
    ``tower.vision_model``.
    """
    inner = getattr(tower, "vision_model", tower)
    return inner.encoder


# --------------------------------------------------------------------------- cache


def new_cache(config) -> DynamicCache:
    """An empty dynamic cache laid out for ``config``'s text model."""
    return DynamicCache(config=config)


def cache_layers(cache: DynamicCache) -> list:
    """The per-layer cache objects; each has ``.keys`` / ``.values`` shaped [B, Hkv, T, D]."""
    return cache.layers


def crop_last(cache: DynamicCache, n: int) -> None:
    """Remove the last ``n`` slots from every layer of ``cache`` (no-op for n == 0)."""
    if n > 0:
        cache.crop(-n)


def layer_length(cache: DynamicCache, layer_idx: int) -> int:
    layer = cache.layers[layer_idx]
    if not getattr(layer, "is_initialized", False) or layer.keys is None or layer.keys.numel() == 0:
        return 0
    return int(layer.keys.shape[-2])


def set_layer_kv(cache: DynamicCache, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Replace one layer's cached K/V ([B, Hkv, T, D]) in place."""
    layer = cache.layers[layer_idx]
    layer.keys = keys
    layer.values = values


def clone_cache(cache: DynamicCache) -> DynamicCache:
    """A deep copy whose tensors can be mutated independently (beam candidates, branches)."""
    import copy

    return copy.deepcopy(cache)


def cache_bytes(cache: DynamicCache) -> int:
    """Bytes held by the cache tensors, as stored (quantised layers report their packed size)."""
    total = 0
    for layer in cache.layers:
        nbytes = getattr(layer, "stored_nbytes", None)
        if callable(nbytes):
            total += int(nbytes())
            continue
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


# --------------------------------------------------------------------------- attention

#: Attention implementations that the probe wraps get this prefix ("mmfast_probe_sdpa").
PROBE_PREFIX = "mmfast_probe_"


def register_attention(name: str, fn: Callable, mask_like: str) -> None:
    """Register an attention function and the mask function of ``mask_like`` under ``name``."""
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[mask_like])


def eager_attention(module, query, key, value, attention_mask, scaling, dropout: float = 0.0, **kwargs):
    """Eager attention for any module (decoder with GQA, or vision encoder): what the modeling files'
    own ``eager_attention_forward`` computes, without assuming ``module.num_key_value_groups``."""
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            weights = weights.masked_fill(~attention_mask[:, :, :, : key.shape[-2]], torch.finfo(weights.dtype).min)
        else:
            weights = weights + attention_mask[:, :, :, : key.shape[-2]]
    weights = torch.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = torch.nn.functional.dropout(weights, p=dropout, training=module.training)
    out = torch.matmul(weights, value).transpose(1, 2).contiguous()
    return out, weights


def attention_function(name: str) -> Callable:
    """The attention callable registered under ``name`` (``eager``: :func:`eager_attention`)."""
    if name == "eager":
        return eager_attention
    return ALL_ATTENTION_FUNCTIONS[name]


def get_attn_implementation(model) -> dict[str, str]:
    """The attention implementation of the top config and of each sub-config, by sub-config key."""
    impl = {"": model.config._attn_implementation}
    for key in model.config.sub_configs:
        sub = getattr(model.config, key, None)
        if sub is not None:
            impl[key] = sub._attn_implementation
    return impl


def set_attn_implementation(model, impl: dict[str, str]) -> None:
    """Set per-sub-config attention implementations (the inverse of :func:`get_attn_implementation`)."""
    model.set_attn_implementation(dict(impl))


def bool_to_additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, 1, Q, K] bool (True = attend) -> additive float mask for eager attention."""
    out = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return out.masked_fill(~mask, torch.finfo(dtype).min)


def format_mask(mask: torch.Tensor, impl: str, dtype: torch.dtype) -> torch.Tensor:
    """Turn a [B, 1, Q, K] bool mask into what attention implementation ``impl`` expects."""
    base = impl.removeprefix(PROBE_PREFIX)
    if base == "eager":
        return bool_to_additive(mask, dtype)
    if base == "sdpa":
        return mask
    raise NotImplementedError(
        f"attention implementation {impl!r} is not supported by mmfast's per-layer masks; "
        "load the model with attn_implementation='sdpa' or 'eager'"
    )


# --------------------------------------------------------------------------- Qwen-VL vision attention
# (section owned by mmfast/models/qwen_tower.py: the fused tower attention)

#: transformers 5.22 / 5.23: the vision attention class of each Qwen-VL tower (modeling module, class).
#: Each computes ``qkv`` -> [S, 3, heads, head_dim], rotates q / k with its module's
#: ``apply_rotary_pos_emb_vision(q, k, cos, sin)``, attends within the chunks of ``cu_seqlens``
#: (a Python loop of one call per chunk unless the implementation is flash) and applies ``proj``;
#: ``forward(hidden_states, cu_seqlens, position_embeddings, max_seqlen, **kwargs)`` returns [S, D].
_QWEN_VISION_ATTENTION = {
    "qwen2_vl": ("transformers.models.qwen2_vl.modeling_qwen2_vl", "VisionAttention"),
    "qwen2_5_vl": ("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", "Qwen2_5_VLVisionAttention"),
    "qwen3_vl": ("transformers.models.qwen3_vl.modeling_qwen3_vl", "Qwen3VLVisionAttention"),
}


def qwen_vision_attention(family: str) -> tuple[type, Callable] | None:
    """(vision attention class, its rotary function ``apply_rotary_pos_emb_vision``) of a Qwen-VL
    family, or None when this transformers lays the tower out differently (then the tower runs as
    transformers ships it)."""
    import importlib

    where = _QWEN_VISION_ATTENTION.get(family)
    if where is None:
        return None
    module = importlib.import_module(where[0])
    cls = getattr(module, where[1], None)
    rotary = getattr(module, "apply_rotary_pos_emb_vision", None)
    if cls is None or rotary is None:
        return None
    return cls, rotary


def qwen_vision_attention_matches(module) -> bool:
    """Whether a vision attention instance has the parts the fused forward reads."""
    return all(hasattr(module, a) for a in ("qkv", "proj", "num_heads", "scaling", "config"))


def vision_attn_implementation(module) -> str:
    """The attention implementation a vision attention module runs now (read at every call: the
    probe switches it inside a session)."""
    return module.config._attn_implementation
