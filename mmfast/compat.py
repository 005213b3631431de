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

import copy
import functools
import importlib
import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch
import transformers
from packaging.version import Version
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .errors import InputError

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


def decoder_layer(layer, hidden: torch.Tensor, mask, position_embeddings, position_ids, cache) -> torch.Tensor:
    """One decoder layer of the language model, called as the text models of 5.17 to 5.24 call it (the runner
    runs a prefill's layers itself, between in-LLM pruning steps): ``hidden`` [B, T, d] -> [B, T, d]. ``mask``:
    the 4-D mask the model would pass; ``position_ids``: [B, T] 1-D positions, None under M-RoPE (as the
    Qwen-VL models pass no text positions)."""
    out = layer(
        hidden,
        attention_mask=mask,
        position_embeddings=position_embeddings,
        position_ids=position_ids,
        use_cache=True,
        **cache_kwargs(cache),
    )
    return out[0] if isinstance(out, tuple) else out


def output_cache(out) -> DynamicCache | None:
    """The KV cache a model forward returned (``out.cache`` from 5.24, ``out.past_key_values`` before)."""
    return getattr(out, CACHE_KWARG)


def new_cache(config) -> DynamicCache:
    """An empty dynamic cache laid out for ``config``'s text model."""
    return DynamicCache(config=config)


def crop_last(cache: DynamicCache, n: int) -> None:
    """Remove the last ``n`` slots from every layer of ``cache`` (no-op for n == 0); on a static cache every
    layer's write index moves back in one op (OPERA crops its look-ahead every step), the buffers untouched."""
    if n <= 0:
        return
    lays = cache.layers
    if lays and all(type(lay) is StaticSlotLayer and lay._pos is not None and lay._len >= n for lay in lays):
        torch._foreach_add_([lay._pos for lay in lays], -n)
        for lay in lays:
            lay._len -= n
        return
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


def slot_bytes(layer) -> int:
    """Bytes one held slot takes in a cache layer (K and V of every KV head), 0 for a layer holding nothing;
    read from the buffers' shapes (no view of the held slots)."""
    if isinstance(layer, StaticSlotLayer):
        k = layer._k if layer.length else None
    else:
        k = getattr(layer, "keys", None)
    if not isinstance(k, torch.Tensor) or k.numel() == 0:
        return 0
    return 2 * k.shape[1] * k.shape[-1] * k.element_size()


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


def mask_out(mask: torch.Tensor, drop: torch.Tensor, impl: str) -> torch.Tensor:
    """``mask`` (as :func:`format_mask` made it for ``impl``) with the keys ``drop`` marks ([B, 1, Q, K] bool,
    broadcast) masked out as well."""
    base = impl.removeprefix(PROBE_PREFIX)
    if base == "eager":
        return mask.masked_fill(drop, torch.finfo(mask.dtype).min)
    if base == "sdpa":
        return mask & ~drop
    return format_mask(drop, impl, mask.dtype)  # raises: the implementation is not supported


def is_inert_output_hook(hook: Callable) -> bool:
    """Whether a forward hook is transformers' own output-capturing hook (``output_hidden_states`` /
    ``output_attentions`` install it on the decoder layers and attention modules the first time they are
    asked for, and leave it there: 5.17 to 5.24, ``utils/output_capturing.py``). Outside a forward that
    asks for those outputs it returns at once without touching a tensor, so a captured decode step may
    run past it."""
    return getattr(hook, "__name__", "") == "output_capturing_hook" and "output_capturing" in getattr(
        hook, "__module__", ""
    )


# --------------------------------------------------------------------------- static KV cache
# (issue 27 item 1; kept apart from the version-range code above)
#
# transformers' own ``StaticLayer`` does not fit mmfast's runtime: its ``keys`` is the whole
# preallocated buffer (the runtime's slot edits read and assign ``keys`` as the cached tokens), it has
# no ``crop`` (speculative rollback) and one capacity for every layer (in-LLM pruning makes later
# layers hold fewer slots). :class:`StaticSlotLayer` keeps a fixed buffer per layer and a write index
# (the number of slots held); ``keys`` / ``values`` read and assign the held prefix, so every edit the
# runtime makes on a dynamic cache works unchanged, in place. During a static decode step
# (``cache.padded``) ``update`` returns the whole buffer, so the step's shapes do not depend on the
# sequence length; the runtime masks the free slots.


def _allocation_failed(exc: RuntimeError) -> bool:
    """Whether ``exc`` is an allocator's refusal (the CPU allocator raises a plain RuntimeError, not
    ``torch.OutOfMemoryError``; a size past the address space overflows before it)."""
    msg = str(exc).lower()
    return any(
        s in msg for s in ("allocate memory", "out of memory", "not enough memory", "size calculation overflowed")
    )


class StaticCacheCapacityError(InputError):
    """A static KV cache buffer could not be allocated (out of memory): the message names the tokens it
    tried to hold and the keys to lower (an input error: the CLI exits 2 with it)."""


class StaticSlotLayer(CacheLayerMixin):
    """One decoder layer's K/V in a preallocated ``[B, Hkv, C, D]`` buffer; ``length`` slots are held.

    The capacity ``C`` is fixed at the first write: the prefill's length at this layer (after in-LLM
    pruning) plus ``reserve``. A write past ``C`` grows the buffer (logged: a captured step must then be
    captured again); allocation failures raise :class:`StaticCacheCapacityError` with the token count.
    """

    is_compileable = True
    is_sliding = False
    is_croppable = True

    def __init__(self, reserve: int, pool: StaticBufferPool | None = None, index: int = 0) -> None:
        self.reserve = int(reserve)
        # where the first buffers come from (consulted once; a deep copy must not carry the pool)
        self._pool, self._index = pool, int(index)
        self._k: torch.Tensor | None = None  # [B, Hkv, C, D]
        self._v: torch.Tensor | None = None
        self._pos: torch.Tensor | None = None  # [] long on the buffers' device: the write index
        self._len = 0  # the same on the host
        self._whole: tuple[torch.Tensor, torch.Tensor] | None = None  # the buffers of a row cut (keep_first_rows)
        self.padded = False  # set by the cache for a static decode step
        #: [Q] long on the device: the slots a static decode step writes, shared by the layer's group (the step
        #: computes them once for the group and moves every write index after the forward: set_write_slots)
        self._write: torch.Tensor | None = None
        super().__init__()

    # -- the held slots, as a dynamic layer exposes them ----------------------------------------
    @property
    def length(self) -> int:
        """Slots held (the write index); setting it moves the device copy too (no host sync)."""
        return self._len

    @length.setter
    def length(self, n: int) -> None:
        self._len = int(n)
        if self._pos is not None:
            self._pos.fill_(self._len)

    @property
    def keys(self) -> torch.Tensor | None:
        return None if self._k is None else self._k[:, :, : self.length]

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        self._assign(value, values=False)

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._v is None else self._v[:, :, : self.length]

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        self._assign(value, values=True)

    @property
    def capacity(self) -> int:
        return 0 if self._k is None else int(self._k.shape[2])

    def _alloc(self, like: torch.Tensor, batch: int, capacity: int, rows: str = "the batch size") -> torch.Tensor:
        """A zeroed ``[batch, Hkv, capacity, D]`` buffer like ``like``; ``rows``: the keys that set ``batch``."""
        shape = (batch, like.shape[1], capacity, like.shape[-1])
        try:
            return torch.zeros(shape, dtype=like.dtype, device=like.device)
        except RuntimeError as exc:  # CUDA's OutOfMemoryError; the CPU allocator's RuntimeError (or a size overflow)
            if not isinstance(exc, torch.OutOfMemoryError) and not _allocation_failed(exc):
                raise
            raise StaticCacheCapacityError(
                f"the static KV cache could not allocate {batch} x {capacity} tokens for one layer on {like.device} "
                f"({batch * capacity * like.shape[1] * like.shape[-1] * like.element_size() * 2 / 2**20:.0f} MiB of K and V); "
                f"lower decoding.max_new_tokens or {rows}, or set model.compile: off"
            ) from None

    def _assign(self, value: torch.Tensor | None, *, values: bool) -> None:
        """``layer.keys = t`` / ``layer.values = t``: hold ``t`` ([B, Hkv, T, D]) as the first T slots.

        Keys and values are assigned one after the other (``set_layer_kv``, ``keep_new``), so the held
        length follows the last assignment; both always agree once the pair is assigned.
        """
        if value is None:  # CacheLayerMixin.__init__ / reset
            if self._k is None:
                return
            self._k = self._v = self._pos = None
            self._len = 0
            return
        n = int(value.shape[2])
        if self._k is None:
            self._first_buffers(value, value, n)
        buf = self._v if values else self._k
        if buf.shape[0] != value.shape[0] or n > buf.shape[2]:  # a new batch, or more slots than it holds
            other = self._k if values else self._v
            cap = max(n + self.reserve, self.capacity)
            new = self._alloc(value, int(value.shape[0]), cap)
            if values:
                self._v = new
                if other.shape[0] != value.shape[0] or other.shape[2] != cap:
                    self._k = self._alloc(value, int(value.shape[0]), cap)
            else:
                self._k = new
                if other.shape[0] != value.shape[0] or other.shape[2] != cap:
                    self._v = self._alloc(value, int(value.shape[0]), cap)
            buf = new
        if value.data_ptr() != buf.data_ptr() or value.stride() != buf.stride():
            buf[:, :, :n].copy_(value)
        self.length = n

    # -- CacheLayerMixin ----------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._first_buffers(key_states, value_states, int(key_states.shape[2]))
        self.length = 0

    def _first_buffers(self, keys: torch.Tensor, values: torch.Tensor, n: int, zero: bool = True) -> bool:
        """This layer's first buffers, for ``n`` slots plus the reserve: the pool's (the previous call's)
        when they fit, zeroed unless not ``zero`` (the caller zeroes them; returns True), else new zeroed ones
        (with a pool: the capacity rounded up to its granularity)."""
        pool, self._pool = self._pool, None
        batch, need = int(keys.shape[0]), n + self.reserve
        kept = None if pool is None else pool.take(self._index, keys, values, need, zero=zero)
        if kept is not None:
            self._k, self._v, self._pos = kept
        else:
            cap = need if pool is None else pool.capacity(need)
            self._k, self._v = self._alloc(keys, batch, cap), self._alloc(values, batch, cap)
            self._pos = torch.zeros((), dtype=torch.long, device=keys.device)
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        return kept is not None

    def _grow(self, cap: int) -> None:
        """Reallocate to ``cap`` slots, keeping the held ones."""
        old = self.capacity
        logger.info("static KV cache: a layer grows from %d to %d slots (a captured step is captured again)", old, cap)
        k, v = self._alloc(self._k, self._k.shape[0], cap), self._alloc(self._v, self._v.shape[0], cap)
        k[:, :, :old].copy_(self._k)
        v[:, :, :old].copy_(self._v)
        self._k, self._v = k, v

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the new ``[B, Hkv, Q, D]`` at the write index; return the held slots (prefill) or the
        whole buffer (a static decode step, whose mask covers all ``C`` slots).

        A static step writes the slots it was given (:func:`set_write_slots`: from the device write index, which
        the step moves after its forward), so a captured graph replays it; the runner advances the host count
        after the step (:func:`advance_static`)."""
        if self._k is None:
            self.lazy_initialization(key_states, value_states)
        q = int(key_states.shape[2])
        if self._len + q > self.capacity:
            self._grow(max(self._len + q, self.capacity + self.reserve))
        if self.padded:  # the step's slots (set_write_slots); the step moves the write index after its forward
            self._k.index_copy_(2, self._write, key_states)
            self._v.index_copy_(2, self._write, value_states)
            return self._k, self._v
        idx = torch.arange(self._len, self._len + q, device=self._k.device)  # [Q]
        self._k.index_copy_(2, idx, key_states)
        self._v.index_copy_(2, idx, value_states)
        self.length = self._len + q
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.padded:
            return self.capacity, 0
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.capacity

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` held slots (the write index moves back; no copy)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes -tokens_to_remove (got {tokens_to_remove})")
        self.length = max(0, self.length + tokens_to_remove)

    def keep_new(self, n_new: int, keep: torch.Tensor) -> None:
        """Of the last ``n_new`` held slots keep those at ``keep`` ([k] ascending), in order (speculative
        rollback: ``LMState.keep_new``): copied to the front of the block in the buffer, the rest let go."""
        start = self._len - n_new
        src = start + keep.to(self._k.device)  # [k]
        k = int(keep.numel())
        self._k[:, :, start : start + k] = self._k[:, :, src]
        self._v[:, :, start : start + k] = self._v[:, :, src]
        self.length = start + k

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam reorder / row selection in place (a new buffer only when the batch size changes)."""
        if self._k is None:
            return
        idx = beam_idx.to(self._k.device)
        if idx.numel() == self._k.shape[0]:
            self._k.copy_(self._k.index_select(0, idx))
            self._v.copy_(self._v.index_select(0, idx))
        else:
            self._k, self._v = self._k.index_select(0, idx), self._v.index_select(0, idx)

    def keep_first_rows(self, n: int) -> None:
        """Keep batch rows ``0 .. n-1`` in place: views of the buffers (the pool keeps the whole ones, so a next
        call of the full batch takes them, and the graphs captured on these views serve it again)."""
        if self._k is not None:
            if self._whole is None or self._whole[0].data_ptr() != self._k.data_ptr():
                self._whole = (self._k, self._v)
            self._k, self._v = self._k[:n], self._v[:n]

    def whole_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V with every row: the buffers :meth:`keep_first_rows` cut views of, while the layer still holds
        those views (views made under inference mode do not know their base), else the layer's own."""
        whole = self._whole
        if (
            whole is not None
            and whole[0].data_ptr() == self._k.data_ptr()
            and whole[1].data_ptr() == self._v.data_ptr()
        ):
            return whole
        return self._k, self._v

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Every row ``repeats`` times (beam search after one prefill), in new buffers of ``B * repeats`` rows: the
        largest static allocation of a beam search, so its failure names the tokens as :meth:`_alloc` does."""
        if self._k is not None:
            b, h, c, d = self._k.shape
            for name in ("_k", "_v"):
                old = getattr(self, name)
                new = self._alloc(old, b * repeats, c, "the batch size or the beams (decoding.params.num_beams)")
                new.view(b, repeats, h, c, d).copy_(old[:, None].expand(b, repeats, h, c, d))  # row b -> b*R .. b*R+R-1
                setattr(self, name, new)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self._k is not None:
            self._k, self._v = self._k[indices], self._v[indices]

    def reset(self) -> None:
        self.length = 0

    def stored_nbytes(self) -> int:
        """Bytes of the preallocated buffers (free slots included): what the cache holds in memory."""
        if self._k is None:
            return 0
        return self._k.numel() * self._k.element_size() + self._v.numel() * self._v.element_size()


def new_static_cache(config, reserve: int, pool: StaticBufferPool | None = None) -> Cache:
    """A cache of :class:`StaticSlotLayer` for ``config``'s text model, ``reserve`` free slots per layer
    after the prefill (``max_new_tokens`` plus what a verify step appends); with ``pool``, its layers
    take the buffers the pool kept from the previous call where they fit."""
    n = int(config.num_hidden_layers)
    return Cache(layers=[StaticSlotLayer(reserve, pool, i) for i in range(n)])


def static_cache_of(layers: list[StaticSlotLayer]) -> Cache:
    """A static cache of ``layers`` (a KV policy's own layers over another static cache's buffers: ZipVL's)."""
    return Cache(layers=list(layers))


class StaticBufferPool:
    """Static KV buffers kept from one decode call to the next, with the step graphs captured on them.

    A captured graph reads its cache buffers by address, so a call whose cache takes the previous call's
    buffers replays the previous call's graphs instead of capturing them again (``model.compile: auto``:
    capture costs tens of ms per graph on a GPU, against a few ms per decoded token). The last call's sets are kept
    (:meth:`keep`), one per static cache the call prefilled, in order (at most :attr:`max_sets`: a branch decoder's
    prompts of other lengths, PAI's image-free one or M3ID's, each hold their own), and the call's n-th prefill
    takes the n-th set (:meth:`set`). A layer of the next cache takes its predecessor's buffers when batch, heads,
    head size, dtype and device agree and their capacity ``C`` fits: ``need <= C``, and ``C`` at most 1.5 x
    ``need`` or ``need`` rounded up (a step attends over all ``C`` slots, so a much larger buffer would cost
    every step), unless the call has no decode step (:attr:`loose`: a one-token call, e.g. a TTFT). Taken buffers are zeroed,
    as new ones are, so results do not depend on the previous call. A buffer that does not fit is let go
    before its replacement is allocated, and with it every kept graph that reads it.
    New capacities are rounded up to ``granularity`` slots, so prompts of similar length share buffers.
    """

    granularity = 64
    max_sets = 4

    def __init__(self) -> None:
        # per set, per layer: (K, V, write index)
        self._kept: list[dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = []
        #: a call without decode steps (one new token): any capacity >= its need serves (no step attends over it)
        self.loose = False
        self._held: tuple[int, ...] = ()  # the kept sets' addresses (logged when they change)
        #: captured steps on the kept (or the running call's) buffers; key[0] is their
        #: :func:`static_buffers` addresses, the value the runner's
        self.graphs: dict[tuple, Any] = {}

    def set(self, index: int) -> _PoolSet:
        """What the ``index``-th static cache of a call takes its buffers from (:class:`StaticSlotLayer`)."""
        return _PoolSet(self, index)

    def capacity(self, need: int) -> int:
        g = self.granularity
        return -(-need // g) * g

    def take(
        self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, need: int, zero: bool = True, index: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Layer ``layer_idx``'s buffers of set ``index``, zeroed (unless not ``zero``: the caller zeroes them), if
        they fit ``keys`` / ``values`` ([B, Hkv, T, D]) and ``need`` slots; None otherwise (what was kept for the layer
        is let go)."""
        kept = self._kept[index].pop(layer_idx, None) if index < len(self._kept) else None
        if kept is None:
            return None
        k, v, pos = kept

        def fits(buf: torch.Tensor, like: torch.Tensor) -> bool:
            same = (buf.shape[0], buf.shape[1], buf.shape[3]) == (like.shape[0], like.shape[1], like.shape[-1])
            return same and buf.dtype == like.dtype and buf.device == like.device

        cap = int(k.shape[2])
        if (
            fits(k, keys)
            and fits(v, values)
            and need <= cap
            and (self.loose or cap <= max(self.capacity(need), need + need // 2))
        ):
            if zero:
                k.zero_()
                v.zero_()
                pos.zero_()
            return kept
        # the graphs on these buffers go with them; those this call captured on new buffers (its earlier
        # prefill segments) stay
        gone = {k.data_ptr(), v.data_ptr(), pos.data_ptr()}
        self.graphs = {key: g for key, g in self.graphs.items() if gone.isdisjoint(key[0])}
        return None

    def keep(self, caches) -> None:
        """At the end of a call: hold the buffers of ``caches`` (a static cache, or the call's, in prefill order) for
        the next call (the previous sets go); the graphs captured on other buffers go too."""
        caches = caches if isinstance(caches, list | tuple) else [caches]
        sets, held = [], []
        for cache in caches[: self.max_sets]:
            if not is_static(cache) or any(lay._k is None for lay in cache.layers):
                break  # a set that cannot be kept ends the kept ones (a later prefill takes the set of its order)
            sets.append({i: (*lay.whole_buffers(), lay._pos) for i, lay in enumerate(cache.layers)})
            held.append(static_buffers(cache))
        self._kept = sets
        on = {p for h in held for p in h}  # a graph of some layers (a prefill segment) stays while its buffers do
        self.graphs = {key: g for key, g in self.graphs.items() if on.issuperset(key[0])}
        addresses = tuple(p for h in held for p in h)
        if addresses != self._held and sets:  # new sets: said once, not every call
            first = caches[0].layers[0]
            logger.info(
                "model.compile: keeping %.0f MiB of static KV buffers (%d set(s); batch %d, %d slots in layer 0 of the "
                "first) and %d captured graphs for the session's next call",
                self.kept_bytes / 2**20,
                len(sets),
                first._k.shape[0],
                first.capacity,
                len(self.graphs),
            )
        self._held = addresses

    def clear(self) -> None:
        """Let every kept buffer and graph go (the session closes)."""
        self._kept = []
        self._held = ()
        self.graphs.clear()

    @property
    def kept_bytes(self) -> int:
        return sum(
            k.numel() * k.element_size() + v.numel() * v.element_size()
            for kept in self._kept
            for k, v, _ in kept.values()
        )


class _PoolSet:
    """One kept set of a :class:`StaticBufferPool`: what a static cache's layers take their first buffers from."""

    def __init__(self, pool: StaticBufferPool, index: int) -> None:
        self.pool, self.index = pool, index

    def take(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, need: int, zero: bool = True):
        return self.pool.take(layer_idx, keys, values, need, zero, self.index)

    def capacity(self, need: int) -> int:
        return self.pool.capacity(need)


def keep_first_rows(cache, n: int) -> None:
    """Keep batch rows ``0 .. n-1`` of ``cache``: in place on a static cache, selected on another."""
    if is_static(cache):
        for lay in cache.layers:
            lay.keep_first_rows(n)
    else:
        cache.reorder_cache(torch.arange(n, device=cache.layers[0].keys.device))


def static_rows(cache, index: torch.Tensor, pool: _PoolSet | None = None) -> Cache:
    """A new static cache holding rows ``index`` ([R] long) of static ``cache`` in buffers of its own (the same
    capacities, held counts and write indices): the rows a per-sample search decodes on (OPERA's beams). With
    ``pool``, each layer takes the set's kept buffers where they fit (the previous call's: the graphs on them serve
    this one)."""
    layers = []
    for i, lay in enumerate(cache.layers):
        if type(lay) is not StaticSlotLayer:
            raise TypeError(f"static_rows takes StaticSlotLayer caches, not {type(lay).__name__}")
        new = copy.copy(lay)
        idx = index.to(lay._k.device)
        like = lay._k[:1].expand(idx.numel(), -1, -1, -1)  # [R, Hkv, C, D] (a view): what the kept buffers must fit
        kept = None if pool is None else pool.take(i, like, like, lay.capacity, zero=False)
        if kept is None:  # [R, Hkv, C, D] each, allocated as the layer allocates (a failure names the tokens)
            new._k, new._v = (
                new._alloc(lay._k, idx.numel(), lay.capacity),
                new._alloc(lay._v, idx.numel(), lay.capacity),
            )
            torch.index_select(lay._k, 0, idx, out=new._k)
            torch.index_select(lay._v, 0, idx, out=new._v)
            new._pos = lay._pos.clone()
        else:
            new._k, new._v, new._pos = kept
            torch.index_select(lay._k, 0, idx, out=new._k)
            torch.index_select(lay._v, 0, idx, out=new._v)
            new._pos.copy_(lay._pos)
        new._pool, new._whole, new._write = None, None, None
        layers.append(new)
    return Cache(layers=layers)


def copy_static_rows(dst, src, index: torch.Tensor) -> bool:
    """Rows ``index`` ([R] long, R = ``dst``'s batch) of static ``src`` copied into ``dst``'s own buffers (their
    addresses, and the graphs captured on them, stay), held counts and write indices too. False, with nothing
    changed, where a layer's buffers differ in shape (a layer of ``dst`` grew): the caller makes new ones."""
    pairs = list(zip(dst.layers, src.layers))
    if len(pairs) != len(src.layers) or any(
        type(d) is not StaticSlotLayer
        or type(s) is not StaticSlotLayer
        or d._k is None
        or s._k is None
        or d._k.shape[0] != index.numel()
        or d._k.shape[1:] != s._k.shape[1:]
        for d, s in pairs
    ):
        return False
    for d, s in pairs:
        idx = index.to(s._k.device)
        torch.index_select(s._k, 0, idx, out=d._k)
        torch.index_select(s._v, 0, idx, out=d._v)
        d._pos.copy_(s._pos)
        d._len = s._len
    return True


def is_static(cache) -> bool:
    return bool(cache is not None and cache.layers and all(isinstance(lay, StaticSlotLayer) for lay in cache.layers))


def static_capacity(cache, layer_idx: int) -> int:
    """Slots layer ``layer_idx``'s buffer holds (the key length of a static decode step)."""
    return cache.layers[layer_idx].capacity


def set_padded(cache, padded: bool) -> None:
    """A static decode step: ``update`` writes the step's slots (:func:`set_write_slots`) and returns whole buffers
    (fixed shapes) instead of the held slots; unset after the step (the slots let go)."""
    for lay in cache.layers:
        lay.padded = padded
        lay._write = None


def set_write_slots(cache, layers: range, slots: torch.Tensor) -> None:
    """The slots ([Q] long on the device) a static decode step writes in ``layers`` (one layer group, one write
    index); the step moves the write indices after its forward (:func:`move_write_indices`)."""
    for i in layers:
        cache.layers[i]._write = slots


def move_write_indices(cache, q: int) -> None:
    """Every layer's device write index moved past the ``q`` slots a static decode step wrote (one op)."""
    torch._foreach_add_([lay._pos for lay in cache.layers], q)


def advance_static(cache, q: int) -> None:
    """After a static step wrote ``q`` slots per layer (the device write indices moved): the host counts."""
    for lay in cache.layers:
        lay._len += q


def bind_static(cache, config, like: torch.Tensor, n: int, layers: range | None = None) -> None:
    """Give every layer of a static ``cache`` (or of ``layers``) its buffers for ``n`` slots plus its reserve
    before a captured prefill writes them (the pool's when they fit): ``like`` ([B, T, d]) gives batch, dtype
    and device, ``config`` the K/V heads and head size."""
    heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    kv = like.new_empty(like.shape[0], heads, 0, head_dim)  # [B, Hkv, 0, D]
    stale: list[torch.Tensor] = []  # the pool's buffers (the last call's): zeroed in one launch, not 3 per layer
    for lay in _layers(cache, layers):
        if lay._k is None and lay._first_buffers(kv, kv, n, zero=False):  # nothing held yet: write index 0
            stale += [lay._k, lay._v, lay._pos]
    if stale:
        torch._foreach_zero_(stale)


def set_static_lengths(cache, n: int, *, device: bool = False, layers: range | None = None) -> None:
    """Every layer's (or ``layers``') count of held slots: on the host (after a graph moved the device write
    indices), and with ``device`` the device write index too."""
    for lay in _layers(cache, layers):
        if device:
            lay.length = n
        else:
            lay._len = int(n)


def _layers(cache, layers: range | None) -> list:
    return cache.layers if layers is None else [cache.layers[i] for i in layers]


def write_indices(cache) -> list[torch.Tensor]:
    """Copies of every layer's device write index (to undo a step that ran only to be captured)."""
    return [lay._pos.clone() for lay in cache.layers]


def write_index(cache, layer_idx: int) -> torch.Tensor:
    """[] long on the device: layer ``layer_idx``'s write index (slots held before the running step's
    write; a captured step reads it at replay)."""
    return cache.layers[layer_idx]._pos


def restore_write_indices(cache, saved: list[torch.Tensor]) -> None:
    for lay, pos in zip(cache.layers, saved):
        lay._pos.copy_(pos)


def static_buffers(cache, layers: range | None = None) -> tuple[int, ...]:
    """Addresses of every buffer (or of ``layers``'): a captured step is valid while they stay (no growth,
    no new batch)."""
    return tuple(
        p for lay in _layers(cache, layers) for p in (lay._k.data_ptr(), lay._v.data_ptr(), lay._pos.data_ptr())
    )


def align_static(cache, layers: range, q: int) -> int:
    """Before a static step appends ``q`` slots to ``layers`` (one layer group): grow any buffer that
    cannot take them, so that the group's layers share one capacity; returns it (the step's key length)."""
    lays = [cache.layers[i] for i in layers]
    need, cap = max(lay.length + q for lay in lays), max(lay.capacity for lay in lays)
    if need > cap:
        cap = max(need, cap + lays[0].reserve)
    for lay in lays:
        if lay.capacity < cap:
            lay._grow(cap)
    return lays[0].capacity


# --------------------------------------------------------------------------- Qwen-VL vision attention
# (section owned by mmfast/models/qwen_tower.py: the fused tower attention)

#: transformers 5.17 to 5.24 (tests/test_qwen_tower.py ran on 5.17.0 and 5.24.0): the vision attention class of each Qwen-VL tower (modeling module, class).
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

    where = _QWEN_VISION_ATTENTION.get(family)
    if where is None:
        return None
    module = importlib.import_module(where[0])
    cls = getattr(module, where[1], None)
    rotary = getattr(module, "apply_rotary_pos_emb_vision", None)
    if cls is None or rotary is None:
        return None
    return cls, rotary


def attends_per_chunk(module) -> bool:
    """Whether ``module`` is a Qwen-VL vision attention, which calls the attention function once per image (or
    window) of the tower's packed sequence, B = 1 each, outside flash attention (``cu_seqlens``)."""
    for family in _QWEN_VISION_ATTENTION:
        found = qwen_vision_attention(family)
        if found is not None and isinstance(module, found[0]):
            return True
    return False


def qwen_vision_attention_matches(module) -> bool:
    """Whether a vision attention instance has the parts the fused forward reads."""
    return all(hasattr(module, a) for a in ("qkv", "proj", "num_heads", "scaling", "config"))


def vision_attn_implementation(module) -> str:
    """The attention implementation a vision attention module runs now (read at every call: the
    probe switches it inside a session)."""
    return module.config._attn_implementation


# --------------------------------------------------------------------------- Qwen-VL video
# (section owned by mmfast/models/qwen2_vl.py and mmfast/models/_video.py: video M-RoPE positions and
# frame sizes; transformers 5.17 to 5.24, tests/test_video.py ran on 5.17.0 and 5.24.0)


@functools.cache
def _qwen25_truncates_seconds() -> bool:
    """Whether this transformers' ``Qwen2_5_VLModel.get_rope_index`` truncates ``second_per_grid_t``
    to an int before scaling (5.17: ``tokens_per_second * int(second_per_grid_t)``; 5.24 scales by the
    float and truncates the product). Read from the installed source, so any release in the range
    gets its own rule."""
    module = importlib.import_module("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl")
    try:
        source = inspect.getsource(module.Qwen2_5_VLModel.get_rope_index)
    except (OSError, TypeError):  # no source shipped: the rule of the newest tested release (5.24)
        logger.warning("Qwen2.5-VL video positions: transformers' source is not readable; using the 5.24 rule")
        return False
    return "int(next(second_per_grid_ts))" in source


def qwen25_time_interval(tokens_per_second: float, second_per_grid_t: float) -> float:
    """The temporal M-RoPE spacing of a Qwen2.5-VL video's frame groups: frame group ``i`` sits at
    ``int(i * interval)`` after the video's start, as this transformers' ``get_rope_index`` numbers it
    (5.17..5.24; see :func:`_qwen25_truncates_seconds`)."""
    if _qwen25_truncates_seconds():
        return float(tokens_per_second * int(second_per_grid_t))
    return float(tokens_per_second * second_per_grid_t)


def qwen3_video_smart_resize(
    n_frames: int, height: int, width: int, temporal_factor: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """transformers' Qwen3-VL video ``smart_resize``: bounds the whole video's pixels (frames x height x
    width), not one frame's (5.17..5.24)."""
    module = importlib.import_module("transformers.models.qwen3_vl.video_processing_qwen3_vl")
    return module.smart_resize(
        n_frames,
        height,
        width,
        temporal_factor=temporal_factor,
        factor=factor,
        min_pixels=min_pixels,
        max_pixels=max_pixels,
    )


def qwen_smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' Qwen-VL ``smart_resize`` (the PIL image processor's module, the same rule as the
    video processor's; 5.17..5.24)."""
    module = importlib.import_module("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    return module.smart_resize(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
