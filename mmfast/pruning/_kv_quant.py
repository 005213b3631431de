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

On a static cache (``model.compile``): :mod:`._kv_static`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.cache_utils import DynamicLayer

from ._kv_segment import FoldedSegment, QuantSpec, Segment
from ._quant import SUPPORTED_BITS, QuantTensor, pack, quant_param_count, quantize, unpack  # noqa: F401

# --------------------------------------------------------------------------- cache layers


def refuse_dense() -> None:
    raise NotImplementedError(
        "a ZipVL cache layer stores quantised keys/values; assigning dense tensors or keeping drafted slots (a "
        "slot edit by another KV-cache policy, a speculative rollback) is not supported"
    )


class SegmentedLayer:
    """What both quantised layers hold in front of their full-precision buffer: the segments, and their logical
    bytes per sample. A layer sets ``spec`` and calls :meth:`_no_segments` before using the rest."""

    spec: QuantSpec

    def _no_segments(self, batch: int = 0) -> None:
        self.segments: list[Segment | FoldedSegment] = []
        self._seg_bytes = torch.zeros(batch, dtype=torch.float64)  # [B] logical bytes of the segments
        self.n_compressions = 0

    def _append_segment(self, seg: Segment | FoldedSegment, nbytes: torch.Tensor | None = None) -> None:
        self.segments.append(seg)
        self._seg_bytes = self._seg_bytes + (seg.bytes_per_sample(self.spec) if nbytes is None else nbytes)

    def _pop_segment(self) -> Segment | FoldedSegment:
        seg = self.segments.pop()
        self._seg_bytes = self._seg_bytes - seg.bytes_per_sample(self.spec)
        return seg

    def _map_segments(self, fn: Callable[[torch.Tensor], torch.Tensor], device: torch.device) -> None:
        self.segments = [s.map_batch(fn) for s in self.segments]
        self._seg_bytes = fn(self._seg_bytes.to(device)).cpu()

    def _dequantized(self, like_k: torch.Tensor, like_v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, Hkv, S, D] keys and values of every segment (S: their slots), in order."""
        if not self.segments:
            return like_k[:, :, :0], like_v[:, :, :0]
        ks, vs = zip(*(seg.dequantize() for seg in self.segments))
        return torch.cat(ks, 2), torch.cat(vs, 2)

    @property
    def buffer_length(self) -> int:  # pragma: no cover - each layer defines it
        raise NotImplementedError

    def _slot_bytes(self) -> int:  # pragma: no cover - each layer defines it
        raise NotImplementedError

    @staticmethod
    def bytes_of_layers(layers: list[SegmentedLayer], valid: torch.Tensor | None = None) -> torch.Tensor:
        """[B] :meth:`bytes_per_sample` summed over ``layers`` (``valid``: [B, T] their layer group's held slots;
        None: every buffer slot is valid, as decode steps append them, counted from host counts with no device read)
        in a few host ops and at most one read per buffer length, instead of a few ops and a read a layer (exact:
        integer byte counts in float64)."""
        total = torch.stack([lay._seg_bytes for lay in layers]).sum(0)
        per_length: dict[int, int] = {}  # buffer length: the slot bytes of the layers holding it
        for lay in layers:
            if lay.buffer_length:
                per_length[lay.buffer_length] = per_length.get(lay.buffer_length, 0) + lay._slot_bytes()
        for n, slot in per_length.items():
            held = n if valid is None else valid[:, valid.shape[1] - n :].sum(1).double().cpu()
            total = total + held * slot
        return total

    def bytes_per_sample(self, valid: torch.Tensor) -> torch.Tensor:
        """[B] logical stored bytes: quantised segments + the valid slots of the full-precision buffer
        (``valid``: [B, T] the layer group's held slots, the buffer's the last ones)."""
        return SegmentedLayer.bytes_of_layers([self], valid)


class MixedPrecisionKVLayer(SegmentedLayer, DynamicLayer):
    """A DynamicLayer replacement holding quantised segments plus a full-precision buffer.

    Reading ``keys`` / ``values`` dequantises the whole layer; assigning them is refused (a slot
    edit by another KV policy would silently drop the quantisation).
    """

    def __init__(self, spec: QuantSpec) -> None:
        self.spec = spec
        self._no_segments()
        self.buf_k: torch.Tensor | None = None
        self.buf_v: torch.Tensor | None = None
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
        if value is not None:
            refuse_dense()
        self._no_segments()  # construction / reset
        self.buf_k = self.buf_v = None

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
        cls,
        keys: torch.Tensor,
        values: torch.Tensor,
        seg: Segment | FoldedSegment,
        spec: QuantSpec,
        nbytes: torch.Tensor | None = None,
    ) -> MixedPrecisionKVLayer:
        """A layer holding ``seg`` (quantised from ``keys`` / ``values``, [B, H, T, D]) and an empty buffer."""
        layer = cls(spec)
        layer.lazy_initialization(keys[:, :, :0], values[:, :, :0])
        layer._append_segment(seg, nbytes)
        return layer

    def _full(self) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self._dequantized(self.buf_k, self.buf_v)
        return torch.cat([k, self.buf_k], 2), torch.cat([v, self.buf_v], 2)

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

    def _slot_bytes(self) -> int:
        return 2 * self.buf_k.shape[1] * self.buf_k.shape[-1] * self.buf_k.element_size()

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
            k, v = self._pop_segment().dequantize()
            self.buf_k = torch.cat([k, self.buf_k], 2)
            self.buf_v = torch.cat([v, self.buf_v], 2)
        keep = max(self.buffer_length - n, 0)
        self.buf_k = self.buf_k[:, :, :keep]
        self.buf_v = self.buf_v[:, :, :keep]

    def _map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if not self.is_initialized:
            return
        self._map_segments(fn, self.buf_k.device)
        self.buf_k, self.buf_v = fn(self.buf_k), fn(self.buf_v)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices.to(t.device)])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def reset(self) -> None:
        self._assign(None)
        self.is_initialized = False

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
    "SegmentedLayer",
    "QuantSpec",
    "QuantTensor",
    "Segment",
    "pack",
    "quant_param_count",
    "quantize",
    "unpack",
]
