"""Real mixed-precision KV-cache quantisation (ZipVL / ZipCache): the cache layer that stores it.

The quantiser and its segments: :mod:`._kv_segment`.

Cache layer. :class:`MixedPrecisionKVLayer` replaces a ``DynamicLayer`` after prefill. It holds a
list of quantised *segments* (the prompt, then one per ``requant_interval`` generated tokens), each
with an important (``bits_high``) and an unimportant (``bits_low``) class of tokens, plus a
full-precision buffer of the newest tokens. ``update`` appends to the buffer and returns the
dequantised keys/values of every slot (padding slots read as zeros); :meth:`compress_buffer` turns the
buffer into a new segment. ``bytes_per_sample`` reports the logical stored bytes of each sample:
packed codes + scales/zero points + value channel scales + a one-bit important/unimportant map per
stored token + the full-precision buffer; ``stored_nbytes`` the bytes of the tensors actually held
(batch padding and index tensors included).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.cache_utils import DynamicLayer

from ._kv_segment import QuantSpec, Segment
from ._quant import SUPPORTED_BITS, QuantTensor, pack, quant_param_count, quantize, unpack  # noqa: F401

# --------------------------------------------------------------------------- cache layer


class MixedPrecisionKVLayer(DynamicLayer):
    """A DynamicLayer replacement holding quantised segments plus a full-precision buffer.

    Reading ``keys`` / ``values`` dequantises the whole layer; assigning them is refused (a slot
    edit by another KV policy would silently drop the quantisation).
    """

    def __init__(self, spec: QuantSpec) -> None:
        self.spec = spec
        self.segments: list[Segment] = []
        self.buf_k: torch.Tensor | None = None
        self.buf_v: torch.Tensor | None = None
        self._seg_bytes: torch.Tensor | None = None  # [B] float64, logical bytes of the segments
        self.n_compressions = 0
        super().__init__()

    # keys / values: read-only views of the dequantised cache
    @property
    def keys(self) -> torch.Tensor | None:  # type: ignore[override]
        if not self.segments and self.buf_k is None:
            return None
        return self._full()[0]

    @keys.setter
    def keys(self, value) -> None:
        self._assign(value)

    @property
    def values(self) -> torch.Tensor | None:  # type: ignore[override]
        if not self.segments and self.buf_v is None:
            return None
        return self._full()[1]

    @values.setter
    def values(self, value) -> None:
        self._assign(value)

    def _assign(self, value) -> None:
        if value is None:  # construction / reset
            self.segments, self.buf_k, self.buf_v, self._seg_bytes = [], None, None, None
            return
        raise NotImplementedError(
            "MixedPrecisionKVLayer (ZipVL) stores quantised keys/values; assigning dense tensors (a slot edit by "
            "another KV-cache policy) is not supported"
        )

    @classmethod
    def from_dense(
        cls,
        keys: torch.Tensor,
        values: torch.Tensor,
        valid: torch.Tensor,
        important: torch.Tensor,
        spec: QuantSpec,
    ) -> MixedPrecisionKVLayer:
        """Quantise a prefilled layer ([B, H, T, D]); ``valid`` / ``important`` are [B, T] bool."""
        return cls.of_segment(keys, values, Segment.build(keys, values, valid, important, spec), spec)

    @classmethod
    def of_segment(
        cls, keys: torch.Tensor, values: torch.Tensor, seg: Segment, spec: QuantSpec, nbytes: torch.Tensor | None = None
    ) -> MixedPrecisionKVLayer:
        """A layer holding ``seg`` (quantised from ``keys`` / ``values``, [B, H, T, D]) and an empty buffer."""
        layer = cls(spec)
        layer.dtype, layer.device = keys.dtype, keys.device
        layer.is_initialized = True
        bsz, heads, _, d = keys.shape
        layer.buf_k = keys.new_zeros(bsz, heads, 0, d)
        layer.buf_v = values.new_zeros(bsz, heads, 0, d)
        layer._seg_bytes = torch.zeros(bsz, dtype=torch.float64)
        layer._append_segment(seg, nbytes)
        return layer

    def _append_segment(self, seg: Segment, nbytes: torch.Tensor | None = None) -> None:
        self.segments.append(seg)
        self._seg_bytes = self._seg_bytes + (seg.bytes_per_sample(self.spec) if nbytes is None else nbytes)

    def _full(self) -> tuple[torch.Tensor, torch.Tensor]:
        ks, vs = [], []
        for seg in self.segments:
            k, v = seg.dequantize()
            ks.append(k)
            vs.append(v)
        ks.append(self.buf_k)
        vs.append(self.buf_v)
        return torch.cat(ks, 2), torch.cat(vs, 2)

    # -- transformers' layer API -------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        bsz, heads, _, d = key_states.shape
        self.buf_k = key_states.new_zeros(bsz, heads, 0, d)
        self.buf_v = value_states.new_zeros(bsz, heads, 0, d)
        self._seg_bytes = torch.zeros(bsz, dtype=torch.float64)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.buf_k = torch.cat([self.buf_k, key_states], dim=-2)
        self.buf_v = torch.cat([self.buf_v, value_states], dim=-2)
        return self._full()

    def get_seq_length(self) -> int:
        if not self.is_initialized:
            return 0
        return sum(s.length for s in self.segments) + int(self.buf_k.shape[-2])

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    @property
    def buffer_length(self) -> int:
        return 0 if self.buf_k is None else int(self.buf_k.shape[-2])

    def compress_buffer(self, important: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Quantise the full-precision buffer into a new segment (``important`` / ``valid``: [B, n_buffer])."""
        n = self.buffer_length
        if n == 0:
            return
        if valid is None:
            valid = torch.ones(important.shape, dtype=torch.bool, device=important.device)
        self._append_segment(Segment.build(self.buf_k, self.buf_v, valid, important, self.spec))
        self.buf_k = self.buf_k[:, :, :0]
        self.buf_v = self.buf_v[:, :, :0]
        self.n_compressions += 1

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` slots; a cut into a segment dequantises it into the buffer."""
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of slots to remove")
        n = -tokens_to_remove
        if n == 0 or not self.is_initialized:
            return
        while n > self.buffer_length and self.segments:
            seg = self.segments.pop()
            self._seg_bytes = self._seg_bytes - seg.bytes_per_sample(self.spec)
            k, v = seg.dequantize()
            self.buf_k = torch.cat([k, self.buf_k], 2)
            self.buf_v = torch.cat([v, self.buf_v], 2)
        keep = max(self.buffer_length - n, 0)
        self.buf_k = self.buf_k[:, :, :keep]
        self.buf_v = self.buf_v[:, :, :keep]

    def _map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if not self.is_initialized:
            return
        self.segments = [s.map_batch(fn) for s in self.segments]
        self.buf_k, self.buf_v = fn(self.buf_k), fn(self.buf_v)
        self._seg_bytes = fn(self._seg_bytes.to(self.buf_k.device)).cpu()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices.to(t.device)])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def reset(self) -> None:
        self._assign(None)
        self.is_initialized = False

    # -- mmfast accounting ---------------------------------------------------------------------------
    def bytes_per_sample(self, valid: torch.Tensor) -> torch.Tensor:
        """[B] logical stored bytes: quantised segments + the valid slots of the full-precision buffer."""
        n = self.buffer_length
        slot = 2 * self.buf_k.shape[1] * self.buf_k.shape[-1] * self.buf_k.element_size()
        buf = (
            valid[:, valid.shape[1] - n :].sum(1).double().cpu() * slot
            if n
            else torch.zeros(valid.shape[0], dtype=torch.float64)
        )
        return self._seg_bytes + buf

    def stored_nbytes(self) -> int:
        """Bytes of every tensor this layer holds (codes, parameters, masks, indices, buffer)."""
        total = sum(s.nbytes() for s in self.segments)
        if self.buf_k is not None:
            total += (self.buf_k.numel() + self.buf_v.numel()) * self.buf_k.element_size()
        return total

    def __repr__(self) -> str:
        return (
            f"MixedPrecisionKVLayer(segments={len(self.segments)}, buffer={self.buffer_length}, "
            f"bits={self.spec.bits_high}/{self.spec.bits_low})"
        )


__all__ = [
    "MixedPrecisionKVLayer",
    "QuantSpec",
    "QuantTensor",
    "Segment",
    "pack",
    "quant_param_count",
    "quantize",
    "unpack",
]
