"""All knowledge about transformers versions lives here.

mmfast pins ``transformers>=5.17,<5.25`` and Python 3.11-3.12. ``make setup`` installs the top,
5.24.0 (a new user gets the current release), and CI runs the whole suite on it; ``make
test-compat-floor`` runs a smoke subset on the floor, 5.17.0, in its own venv. 5.23.0 was the
previous default. The test files that exercise the hooks (generation, session, probe, each family,
speculative decoding) were run on all three. Behaviour that hooks rely on and that
changed inside 5.x:

- The KV cache keyword of model forwards (and attribute of their outputs): ``past_key_values`` up to
  5.23, ``cache`` from 5.24 (the old name still works there, with a ``FutureWarning`` on every call,
  until 5.40): :data:`CACHE_KWARG`, :func:`cache_kwargs`, :func:`output_cache`.
- ``DynamicCache.crop(n)``: a negative ``n`` removes ``-n`` slots on every release of the range (5.17
  also took a positive target length, with a deprecation warning; 5.22+ take ``-tokens_to_remove``
  only); mmfast only passes negative values.
- ``forward(..., mm_encoder_outputs=...)`` and ``get_image_features(...).pooler_output`` as a list of
  per-image tensors (5.17 has no ``mm_encoder_outputs``; mmfast runs the vision tower itself and uses
  neither).
- Model forwards no longer take ``cache_position``; positions derive from the cache length.
- A 4-D ``attention_mask`` is passed through the mask factory unchanged (``masking_utils``), which is
  how mmfast feeds per-layer masks after pruning and tree masks for speculative verification.
- ``AutoImageProcessor`` needs torchvision on 5.17 (a placeholder that raises ``ImportError``); 5.23+
  resolve a saved ``Qwen2VLImageProcessor`` to its PIL twin without it: :func:`load_image_processor`.
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

TRANSFORMERS_MIN = "5.17"
TRANSFORMERS_MAX_EXCLUSIVE = "5.25"
#: Versions the tests ran on, oldest first: the first is the floor (``make test-compat-floor``), the
#: last the default (``make setup``; tests/test_install_range.py ties the Makefile to both).
TESTED_VERSIONS = ("5.17.0", "5.23.0", "5.24.0")
#: Python range of ``pyproject.toml``'s ``requires-python``. The floor is transformers': every release
#: from 5.21 on declares ``Requires-Python >=3.11``, so no Python 3.10 can install the default (5.24);
#: it could only reach 5.17-5.20, which are tested on 3.11 alone.
#: CI and ``make`` run 3.11 (its CPU torch wheel is what installs offline here); the others are checked
#: by installing the wheel into fresh venvs and running ``mmfast eval world_eval --limit 5``
#: (docs/install.md).
PYTHON_MIN = "3.11"
PYTHON_MAX_EXCLUSIVE = "3.13"
PYTHON_TESTED = ("3.11.7", "3.12.1")

_version = Version(transformers.__version__)
#: (major, minor) of the installed transformers; a pre-release (5.24.0.dev0) counts as its release.
_MINOR = _version.release[:2]
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


def load_image_processor(path: str, **kwargs):
    """The image processor saved at ``path`` (``AutoImageProcessor.from_pretrained``).

    Where ``AutoImageProcessor`` itself is unavailable without torchvision (5.17), the class the saved
    config names is loaded on its PIL backend (``Qwen2VLImageProcessor`` -> ``Qwen2VLImageProcessorPil``),
    which is what later releases resolve to when torchvision is missing.
    """
    from transformers import AutoImageProcessor
    from transformers.image_processing_base import ImageProcessingMixin
    from transformers.utils.import_utils import DummyObject

    if not isinstance(AutoImageProcessor, DummyObject):
        return AutoImageProcessor.from_pretrained(path, **kwargs)
    config, _ = ImageProcessingMixin.get_image_processor_dict(path, **kwargs)
    saved = str(config.get("image_processor_type") or "")
    name = saved.removesuffix("Fast").removesuffix("Pil") + "Pil"
    cls = getattr(transformers, name, None)
    if not saved or cls is None or isinstance(cls, DummyObject):
        raise ImportError(
            f"{path}: image processor {saved or '(unnamed)'!r} needs torchvision with transformers "
            f"{transformers.__version__} (no PIL class {name!r}); install torchvision or transformers>=5.23"
        )
    return cls.from_pretrained(path, **kwargs)



def vision_encoder(tower):
    """The encoder (with ``.layers``) of a CLIP/SigLIP vision tower.

    5.22+ flatten ``CLIPVisionModel`` (``tower.encoder``); earlier releases nest it under
    ``tower.vision_model``.
    """
    inner = getattr(tower, "vision_model", tower)
    return inner.encoder


# --------------------------------------------------------------------------- cache

#: The keyword under which model forwards take the KV cache, and the attribute of their outputs that
#: holds it: 5.24 renamed ``past_key_values`` to ``cache`` (the old name still works there, with a
#: ``FutureWarning`` per call, until 5.40).
CACHE_KWARG = "cache" if _MINOR >= (5, 24) else "past_key_values"


def cache_kwargs(cache: DynamicCache | None) -> dict[str, DynamicCache | None]:
    """``{CACHE_KWARG: cache}``: pass the KV cache to a model forward (``model(..., **cache_kwargs(c))``)."""
    return {CACHE_KWARG: cache}


def output_cache(out) -> DynamicCache | None:
    """The KV cache a model forward returned (``out.cache`` from 5.24, ``out.past_key_values`` before)."""
    return getattr(out, CACHE_KWARG)



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
