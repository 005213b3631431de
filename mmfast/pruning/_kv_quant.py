"""Real mixed-precision KV-cache quantisation (ZipVL / ZipCache) and the cache layer that stores it.

Quantiser. Asymmetric uniform min/max quantisation of ``x`` ([B, N, C], C = KV heads x head_dim) in
rectangular groups of ``tok_group`` tokens x ``ch_group`` channels: ``scale = (max - min) / (2^b - 1)``,
``zero = min``, ``code = round((x - zero) / scale)`` clamped to ``[0, 2^b - 1]``. Codes are packed
``8 / b`` to a byte (uint8) along the channel axis; scales and zero points are kept in the KV dtype.
Statistics are per sample and ignore invalid (padding) entries, so a sample's codes never depend on
the other rows of its batch.

Schemes (ZipCache, arXiv 2405.14256, code ``ThisisBillhe/ZipCache``, which ZipVL v1 builds on):

- keys, ``mixed_channelwiseQ``: channel-wise, one (scale, zero) per channel over the tokens of a
  group (``k_group_size`` tokens; 0 = all tokens of the class in the segment, ZipCache's choice);
- values, ``channel_separate_mixed_tokenwiseQ``: channel-separable token-wise; every channel is first
  divided by ``sqrt(max |v|)`` over the segment's valid tokens, then each token is quantised over
  groups of ``v_group_size`` channels (0 = all KV heads x head_dim, ZipCache's choice).

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

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from transformers.cache_utils import DynamicLayer

from ._quant import SUPPORTED_BITS, QuantTensor, pack, quant_param_count, quantize, unpack  # noqa: F401

# --------------------------------------------------------------------------- one segment


@dataclass
class QuantSpec:
    bits_high: int = 4
    bits_low: int = 2
    k_group_size: int = 0  # tokens per key group (channel-wise); 0 = all tokens of a class
    v_group_size: int = 0  # channels per value group (token-wise); 0 = all channels
    requant_interval: int = 100


def _flat(x: torch.Tensor) -> torch.Tensor:
    """[B, H, N, D] -> [B, N, H * D]."""
    b, h, n, d = x.shape
    return x.permute(0, 2, 1, 3).reshape(b, n, h * d)


def _unflat(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, N, H * D] -> [B, H, N, D]."""
    b, n, c = x.shape
    return x.view(b, n, heads, c // heads).permute(0, 2, 1, 3)


def _class_index(members: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """members [B, N] bool -> (index [B, M] into N, left-aligned, padded with 0; valid [B, M])."""
    bsz, n = members.shape
    counts = members.sum(1)
    m = int(counts.max()) if bsz else 0
    order = torch.argsort((~members).to(torch.int8), dim=1, stable=True)[:, :m]  # members first, in order
    valid = torch.arange(m, device=members.device)[None, :] < counts[:, None]
    return order.masked_fill(~valid, 0), valid


@dataclass
class _ClassData:
    index: torch.Tensor  # [B, M] slot index within the segment (0 where invalid)
    valid: torch.Tensor  # [B, M]
    k: QuantTensor
    v: QuantTensor


@dataclass
class Segment:
    """Quantised keys/values of ``length`` consecutive slots, split into important / unimportant tokens."""

    length: int
    heads: int
    head_dim: int
    dtype: torch.dtype
    stored: torch.Tensor  # [B, length] bool: slot is stored (valid); others read back as zeros
    important: torch.Tensor  # [B, length] bool (subset of stored)
    v_channel_scale: torch.Tensor  # [B, 1, C]
    classes: dict[str, _ClassData] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        keys: torch.Tensor,
        values: torch.Tensor,
        valid: torch.Tensor,
        important: torch.Tensor,
        spec: QuantSpec,
    ) -> Segment:
        """Quantise [B, H, N, D] keys/values: ``important & valid`` at bits_high, other valid slots at bits_low."""
        bsz, heads, n, d = keys.shape
        valid = valid.bool()
        important = important.bool() & valid
        kf, vf = _flat(keys), _flat(values)
        # ZipCache's channel-separable scale for values: sqrt(max |v|) per channel over the valid tokens
        absmax = vf.float().abs().masked_fill(~valid[:, :, None], 0).amax(1, keepdim=True)
        ch_scale = absmax.sqrt().clamp_min(1e-6).to(values.dtype)  # [B, 1, C]
        vn = vf / ch_scale
        seg = cls(n, heads, d, keys.dtype, valid, important, ch_scale)
        for name, members, bits in (("high", important, spec.bits_high), ("low", valid & ~important, spec.bits_low)):
            index, cvalid = _class_index(members)
            gidx = index[:, :, None].expand(-1, -1, kf.shape[-1])
            kq = quantize(kf.gather(1, gidx), cvalid, bits, spec.k_group_size, 1, keys.dtype)
            vq = quantize(vn.gather(1, gidx), cvalid, bits, 1, spec.v_group_size, values.dtype)
            seg.classes[name] = _ClassData(index, cvalid, kq, vq)
        return seg

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, H, length, D] keys and values (zeros in slots that are not stored)."""
        bsz = self.stored.shape[0]
        c = self.heads * self.head_dim
        dev = self.stored.device
        k = torch.zeros(bsz, self.length + 1, c, dtype=self.dtype, device=dev)
        v = torch.zeros(bsz, self.length + 1, c, dtype=self.dtype, device=dev)
        for data in self.classes.values():
            if data.index.shape[1] == 0:
                continue
            dest = data.index.masked_fill(~data.valid, self.length)[:, :, None].expand(
                -1, -1, c
            )  # invalid -> dump slot
            k.scatter_(1, dest, data.k.dequantize(self.dtype))
            v.scatter_(1, dest, data.v.dequantize(self.dtype) * self.v_channel_scale)
        return _unflat(k[:, : self.length], self.heads), _unflat(v[:, : self.length], self.heads)

    def bytes_per_sample(self, spec: QuantSpec) -> torch.Tensor:
        """[B] logical bytes: codes + quantisation parameters + value channel scales + 1-bit class map."""
        # one read of the counts: [3, B] stored, high, low
        counts = torch.stack([self.stored.sum(1), *(self.classes[k].valid.sum(1) for k in ("high", "low"))]).tolist()
        return segment_bytes(counts, self.heads * self.head_dim, self.dtype, spec)

    @classmethod
    def build_layers(
        cls,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        valid: torch.Tensor,
        important: list[torch.Tensor],
        spec: QuantSpec,
    ) -> list[tuple[Segment, torch.Tensor]]:
        """:meth:`build` for the layers of a prefill (each [B, H, N, D], one ``valid`` [B, N], an ``important``
        [B, N] per layer), with as many layers folded into the batch at once as keep a fp32 copy of their keys
        within :data:`FOLD_BYTES` (the quantiser's temporaries are a few such copies: batch 8 of LLaVA-1.5-7B's
        616 slots folds 3 layers at a time, batch 1 25). Every statistic is per row, so each layer's segment is
        the one :meth:`build` makes, its classes cut to that layer's widest row: tens of ops for a fold instead
        of hundreds a layer, and one read of the counts. Returns each layer's segment and its
        :meth:`bytes_per_sample`."""
        b, h, n, d = keys[0].shape
        per = max(1, FOLD_BYTES // max(1, b * h * n * d * 4))
        if len(keys) > per:
            return [
                built
                for i in range(0, len(keys), per)
                for built in cls.build_layers(
                    keys[i : i + per], values[i : i + per], valid, important[i : i + per], spec
                )
            ]
        n_layers, bsz = len(keys), valid.shape[0]
        big = cls.build(
            torch.cat(keys), torch.cat(values), valid.repeat(n_layers, 1), torch.cat(important), spec
        )  # [L * B, ...]
        stacked = torch.stack([big.stored.sum(1), *(big.classes[k].valid.sum(1) for k in ("high", "low"))])
        counts = stacked.view(3, n_layers, bsz).tolist()  # [3, L, B]: stored, high, low per row
        out = []
        for i in range(n_layers):
            rows = slice(i * bsz, (i + 1) * bsz)

            def own(q: QuantTensor, rows: slice = rows) -> QuantTensor:  # the codes in memory of their own
                q = q.map_batch(lambda t: t[rows])
                return replace(q, codes=q.codes.clone())

            classes = {}
            for j, name in enumerate(("high", "low"), start=1):
                m, d = max(counts[j][i], default=0), big.classes[name]
                # the codes cut to this layer's widest row are copied (the padding's memory goes); the rest are
                # views of the whole prefill's tensors, which the layers share without padding
                classes[name] = _ClassData(
                    d.index[rows, :m], d.valid[rows, :m], own(d.k.first_tokens(m)), own(d.v.first_tokens(m))
                )
            seg = replace(
                big,
                stored=big.stored[rows],
                important=big.important[rows],
                v_channel_scale=big.v_channel_scale[rows],
                classes=classes,
            )
            c = [counts[0][i], counts[1][i], counts[2][i]]
            out.append((seg, segment_bytes(c, big.heads * big.head_dim, big.dtype, spec)))
        return out

    def nbytes(self) -> int:
        total = sum(t.numel() * t.element_size() for t in (self.stored, self.important, self.v_channel_scale))
        for data in self.classes.values():
            total += data.index.numel() * data.index.element_size() + data.valid.numel()
            total += data.k.nbytes() + data.v.nbytes()
        return total

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Segment:
        classes = {
            name: _ClassData(fn(d.index), fn(d.valid), d.k.map_batch(fn), d.v.map_batch(fn))
            for name, d in self.classes.items()
        }
        return replace(
            self,
            stored=fn(self.stored),
            important=fn(self.important),
            v_channel_scale=fn(self.v_channel_scale),
            classes=classes,
        )


#: the largest fp32 copy of keys :meth:`Segment.build_layers` folds into one batch
FOLD_BYTES = 256 * 2**20


def segment_bytes(counts: list[list[int]], c: int, dtype: torch.dtype, spec: QuantSpec) -> torch.Tensor:
    """[B] logical bytes of a segment from its per-row counts ``[stored, high, low]`` (each [B]): K and V codes,
    quantisation parameters, value channel scales and a one-bit class map per stored token."""
    pbytes = torch.finfo(dtype).bits // 8
    out = []
    for n_stored, *classes in zip(*counts):
        total = 0
        for n, bits in zip(classes, (spec.bits_high, spec.bits_low)):
            total += 2 * n * c * bits // 8  # K and V codes
            total += quant_param_count(n, c, spec.k_group_size, 1) * pbytes
            total += quant_param_count(n, c, 1, spec.v_group_size) * pbytes
        if n_stored:
            total += c * pbytes + math.ceil(n_stored / 8)  # value channel scales, class bitmap
        out.append(total)
    return torch.tensor(out, dtype=torch.float64)


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
