"""Quantised KV segments (ZipVL / ZipCache): the quantiser's schemes and one segment of a cache layer.

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

The cache layer that holds segments: :mod:`._kv_quant`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from ._quant import QuantTensor, quant_param_count, quantize

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
    ) -> list[tuple[Segment | FoldedSegment, torch.Tensor]]:
        """:meth:`build` for the layers of a prefill (each [B, H, N, D], one ``valid`` [B, N], an ``important``
        [B, N] per layer), with as many layers folded into the batch at once as keep a fp32 copy of their keys
        within :data:`FOLD_BYTES` (the quantiser's temporaries are a few such copies: batch 8 of LLaVA-1.5-7B's
        616 slots folds 3 layers at a time, batch 1 25). Every statistic is per row, so each layer's segment is
        the one :meth:`build` makes, its classes cut to that layer's widest row: tens of ops for a fold instead
        of hundreds a layer, and one read of the counts. Returns each layer's segment (cut from the fold when first
        read: :class:`FoldedSegment`) and its :meth:`bytes_per_sample` (from the counts)."""
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
        c = big.heads * big.head_dim
        return [
            (
                FoldedSegment(big, slice(i * bsz, (i + 1) * bsz), [counts[1][i], counts[2][i]]),
                segment_bytes([counts[0][i], counts[1][i], counts[2][i]], c, big.dtype, spec),
            )
            for i in range(n_layers)
        ]

    @staticmethod
    def layers_bytes(kept: torch.Tensor, held: torch.Tensor, keys: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
        """[B] logical bytes of a prefill's segments summed over its layers, from each row's per-layer counts
        ``kept`` (important: high precision) and ``held`` (stored), [B, L] each on the host, of layers like ``keys``
        ([B, Hkv, T, D]): what :meth:`build_layers` would hold, without building it."""
        c, dtype = keys.shape[1] * keys.shape[-1], keys.dtype
        rows = [
            sum(row_bytes(h, k, h - k, c, dtype, spec) for k, h in zip(*r)) for r in zip(kept.tolist(), held.tolist())
        ]
        return torch.tensor(rows, dtype=torch.float64)

    def rows_of_fold(self, rows: slice, widest: list[list[int]]) -> Segment:
        """The segment of ``rows`` of this fold of layers (:meth:`build_layers`), each class cut to its widest row
        there (``widest``: the rows' high and low counts): its codes copied into memory of their own (the padding's
        goes), the rest views of the fold's tensors, which the layers share without padding."""

        def own(q: QuantTensor) -> QuantTensor:
            q = q.map_batch(lambda t: t[rows])
            return replace(q, codes=q.codes.clone())

        classes = {}
        for name, counts in zip(("high", "low"), widest):
            m, d = max(counts, default=0), self.classes[name]
            classes[name] = _ClassData(
                d.index[rows, :m], d.valid[rows, :m], own(d.k.first_tokens(m)), own(d.v.first_tokens(m))
            )
        return replace(
            self,
            stored=self.stored[rows],
            important=self.important[rows],
            v_channel_scale=self.v_channel_scale[rows],
            classes=classes,
        )

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


class FoldedSegment:
    """One layer's :class:`Segment` of a fold (:meth:`Segment.build_layers`), cut from the fold's tensors when first
    read (:meth:`Segment.rows_of_fold`): a call that never reads its quantised cache (a one-token answer: the static
    cache's layers are not written back) takes no per-layer views or code copies (~35 ops a layer). Its length,
    heads, head size and dtype are known without the cut; everything else reads the cut segment."""

    def __init__(self, fold: Segment, rows: slice, widest: list[list[int]]) -> None:
        self.length, self.heads, self.head_dim, self.dtype = fold.length, fold.heads, fold.head_dim, fold.dtype
        self._fold: Segment | None = fold
        self._rows, self._widest = rows, widest  # this layer's rows of the fold; their high / low counts
        self._cut: Segment | None = None

    def segment(self) -> Segment:
        if self._cut is None:
            self._cut = self._fold.rows_of_fold(self._rows, self._widest)
            self._fold = None
        return self._cut

    @property
    def stored(self) -> torch.Tensor:
        return self.segment().stored

    @property
    def important(self) -> torch.Tensor:
        return self.segment().important

    @property
    def v_channel_scale(self) -> torch.Tensor:
        return self.segment().v_channel_scale

    @property
    def classes(self) -> dict[str, _ClassData]:
        return self.segment().classes

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.segment().dequantize()

    def bytes_per_sample(self, spec: QuantSpec) -> torch.Tensor:
        return self.segment().bytes_per_sample(spec)

    def nbytes(self) -> int:
        return self.segment().nbytes()

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Segment:
        return self.segment().map_batch(fn)


def segment_bytes(counts: list[list[int]], c: int, dtype: torch.dtype, spec: QuantSpec) -> torch.Tensor:
    """[B] logical bytes of a segment from its per-row counts ``[stored, high, low]`` (each [B]): K and V codes,
    quantisation parameters, value channel scales and a one-bit class map per stored token."""
    return torch.tensor([row_bytes(*row, c, dtype, spec) for row in zip(*counts)], dtype=torch.float64)


def row_bytes(n_stored: int, n_high: int, n_low: int, c: int, dtype: torch.dtype, spec: QuantSpec) -> int:
    """One row's logical bytes in a segment (:func:`segment_bytes`), from its counts on the host."""
    pbytes = torch.finfo(dtype).bits // 8
    total = 0
    for n, bits in zip((n_high, n_low), (spec.bits_high, spec.bits_low)):
        total += 2 * n * c * bits // 8  # K and V codes
        total += quant_param_count(n, c, spec.k_group_size, 1) * pbytes
        total += quant_param_count(n, c, 1, spec.v_group_size) * pbytes
    if n_stored:
        total += c * pbytes + math.ceil(n_stored / 8)  # value channel scales, class bitmap
    return total
