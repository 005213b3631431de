"""ZipVL's quantised cache layer on a static cache (``model.compile``): :class:`StaticMixedPrecisionLayer` holds
the segments of :mod:`._kv_quant` over the static buffers, each written back into its slots dequantised, the later
slots its full-precision buffer, so a decode step reads the buffers as the plain static step does (one captured
graph). :func:`held_bytes`: the logical KV bytes of either kind of ZipVL cache from host counts.
"""

from __future__ import annotations

import torch

from .. import compat
from ..compat import StaticSlotLayer
from ._kv_quant import QuantSpec, Segment, SegmentedLayer, refuse_dense
from ._kv_segment import FoldedSegment


class StaticMixedPrecisionLayer(SegmentedLayer, StaticSlotLayer):
    """ZipVL's quantised layer on a static cache (``model.compile``), over the prefill's static buffers.

    Slots ``0 .. base-1`` are quantised segments (the prompt's, then one per re-quantised block of generated
    tokens); slots ``base ..`` are the full-precision buffer, written at the device write index as
    :class:`~mmfast.compat.StaticSlotLayer` writes them. Each segment's dequantised keys / values are written once
    into its own slots of the buffers when appended (eagerly, before the next step), so a decode step reads
    what the dynamic layer's dequantisation gives, from the buffers, as the plain static step does: no
    dequantisation per step, and the step graph is the unpruned model's (replayed by every call on these buffers).
    The buffers stay allocated (the pool's), so on this path the quantisation shows in the logical bytes
    (:meth:`bytes_per_sample`), neither in the memory held nor in the bytes a step reads (``model.compile: off``
    decodes on :class:`~._kv_quant.MixedPrecisionKVLayer`, which holds the codes only and dequantises every step). A call
    without decode steps (a one-token answer) builds none (``zipvl``: nothing reads its cache after the prefill).
    """

    def __init__(
        self, over: StaticSlotLayer, seg: Segment | FoldedSegment, spec: QuantSpec, nbytes: torch.Tensor | None = None
    ) -> None:
        super().__init__(over.reserve)
        self._k, self._v, self._pos, self._len = over._k, over._v, over._pos, over._len
        self.dtype, self.device, self.is_initialized = over.dtype, over.device, True
        self.spec = spec
        self._no_segments(int(over._k.shape[0]))
        self.base = 0  # slots held by the segments
        self._append_segment(seg, nbytes)

    def _append_segment(self, seg: Segment | FoldedSegment, nbytes: torch.Tensor | None = None) -> None:
        """Append ``seg`` (the next ``seg.length`` slots) and write its dequantised keys / values into those slots of
        the buffers."""
        super()._append_segment(seg, nbytes)
        k, v = seg.dequantize()  # [B, Hkv, length, D]
        self._k[:, :, self.base : self.base + seg.length].copy_(k)
        self._v[:, :, self.base : self.base + seg.length].copy_(v)
        self.base += seg.length

    @property
    def keys(self) -> torch.Tensor | None:  # type: ignore[override]
        return super().keys

    @keys.setter
    def keys(self, value) -> None:
        self._assign(value, values=False)

    @property
    def values(self) -> torch.Tensor | None:  # type: ignore[override]
        return super().values

    @values.setter
    def values(self, value) -> None:
        self._assign(value, values=True)

    def _assign(self, value: torch.Tensor | None, *, values: bool) -> None:
        if value is not None:
            refuse_dense()
        super()._assign(None, values=values)  # construction / reset

    @property
    def buffer_length(self) -> int:
        return self._len - self.base

    def _slot_bytes(self) -> int:
        return 2 * self._k.shape[1] * self._k.shape[-1] * self._k.element_size()

    def compress_buffer(self, important: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Quantise the buffer's held slots into a new segment (``important`` / ``valid``: [B, n_buffer]), written
        back into those slots dequantised."""
        if self.buffer_length == 0:
            return
        if valid is None:
            valid = torch.ones(important.shape, dtype=torch.bool, device=important.device)
        held = slice(self.base, self._len)
        self._append_segment(Segment.build(self._k[:, :, held], self._v[:, :, held], valid, important, self.spec))
        self.n_compressions += 1

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` held slots; a segment cut into joins the buffer (its slots hold its
        dequantised values, as the dynamic layer's crop puts them into its buffer)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes -tokens_to_remove (got {tokens_to_remove})")
        while self._len + tokens_to_remove < self.base and self.segments:
            self.base -= self._pop_segment().length
        super().crop(tokens_to_remove)

    def keep_new(self, n_new: int, keep: torch.Tensor) -> None:
        refuse_dense()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._map_segments(lambda t: t.index_select(0, beam_idx.to(t.device)), self._k.device)

    def keep_first_rows(self, n: int) -> None:
        super().keep_first_rows(n)
        self._map_segments(lambda t: t[:n], self._k.device)

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._map_segments(lambda t: t.repeat_interleave(repeats, dim=0), self._k.device)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._map_segments(lambda t: t[indices.to(t.device)], self._k.device)

    def stored_nbytes(self) -> int:
        """The static buffers (every slot) and the segments' tensors."""
        return super().stored_nbytes() + sum(s.nbytes() for s in self.segments)

    def __repr__(self) -> str:
        return (
            f"StaticMixedPrecisionLayer(segments={len(self.segments)}, base={self.base}, held={self._len}, "
            f"capacity={self.capacity}, bits={self.spec.bits_high}/{self.spec.bits_low})"
        )


def held_bytes(layers: list, prefill: list[int], since: int) -> list[int]:
    """Logical KV bytes per sample of a ZipVL cache's ``layers`` from host counts, with no device read (what
    ``LMState.kv_bytes_per_sample`` gives there): a decode step appends one valid slot a row to every layer and
    nothing else edits the cache (ZipVL refuses other KV policies), so a quantised layer holds its segments and
    ``buffer_length`` valid slots a row, and a plain cache (``quantize_kv: false``) its ``prefill`` bytes and a slot a
    row in every layer for each of the ``since`` tokens appended after the prefill."""
    if all(isinstance(lay, SegmentedLayer) for lay in layers):
        total = SegmentedLayer.bytes_of_layers(layers)
    else:
        total = torch.tensor(prefill, dtype=torch.float64) + since * sum(compat.slot_bytes(lay) for lay in layers)
    return [int(x) for x in total.tolist()]
