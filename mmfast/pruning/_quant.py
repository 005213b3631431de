"""Bit packing and the group quantiser behind mmfast's quantised KV cache (see ``_kv_quant``).

Asymmetric uniform min/max quantisation of ``x`` ([B, N, C]) in rectangular groups of ``tok_group``
tokens x ``ch_group`` channels: ``scale = (max - min) / (2^b - 1)``, ``zero = min``,
``code = round((x - zero) / scale)`` clamped to ``[0, 2^b - 1]``; codes are packed ``8 / b`` to a byte
along the channel axis. Statistics are per sample and ignore invalid (padding) entries.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

SUPPORTED_BITS = (1, 2, 4, 8)


# --------------------------------------------------------------------------- packing


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes in [0, 2^bits) of shape [..., C] -> [..., C * bits / 8] with 8/bits codes per byte."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    if bits == 8:
        return codes.to(torch.uint8)
    per = 8 // bits
    c = codes.shape[-1]
    if c % per:
        raise ValueError(f"{c} channels cannot be packed {per} to a byte")
    grouped = codes.to(torch.uint8).reshape(*codes.shape[:-1], c // per, per)
    shifts = torch.arange(0, 8, bits, device=codes.device, dtype=torch.uint8)
    return (grouped << shifts).sum(-1, dtype=torch.uint8)


def unpack(packed: torch.Tensor, bits: int, channels: int) -> torch.Tensor:
    """Inverse of :func:`pack`: [..., C * bits / 8] uint8 -> [..., C] uint8 codes."""
    if bits == 8:
        return packed
    shifts = torch.arange(0, 8, bits, device=packed.device, dtype=torch.uint8)
    mask = (1 << bits) - 1
    codes = (packed[..., None] >> shifts) & mask
    return codes.reshape(*packed.shape[:-1], channels)


# --------------------------------------------------------------------------- quantiser


@dataclass
class QuantTensor:
    """[B, N, C] quantised in groups of ``tok_group`` tokens x ``ch_group`` channels."""

    codes: torch.Tensor  # uint8 [B, N_pad, C * bits / 8] (N_pad = N rounded up to tok_group)
    scale: torch.Tensor  # [B, N_pad / tok_group, C / ch_group]
    zero: torch.Tensor  # same shape as scale
    bits: int
    tok_group: int
    ch_group: int
    n: int
    c: int

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        bsz, n_pad, _ = self.codes.shape
        codes = unpack(self.codes, self.bits, self.c).float()
        codes = codes.view(bsz, n_pad // self.tok_group, self.tok_group, self.c // self.ch_group, self.ch_group)
        x = codes * self.scale.float()[:, :, None, :, None] + self.zero.float()[:, :, None, :, None]
        x = x.reshape(bsz, n_pad, self.c)[:, : self.n]
        return x.to(dtype or self.scale.dtype)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.zero))

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> QuantTensor:
        return replace(self, codes=fn(self.codes), scale=fn(self.scale), zero=fn(self.zero))

    def first_tokens(self, m: int) -> QuantTensor:
        """The first ``m`` tokens (those of every row are valid there), as :func:`quantize` would have made them
        from an axis of ``m`` tokens: one token group over the whole axis stays one, of ``max(m, 1)`` tokens;
        groups of ``tok_group`` tokens keep the ``ceil(m / tok_group)`` first (at least one)."""
        if self.scale.shape[1] == 1:  # one group over the axis (tok_group 0, or an axis within one group)
            tg = max(m, 1)
            return replace(self, codes=self.codes[:, :tg], tok_group=tg, n=m)
        groups = max(1, -(-m // self.tok_group))
        n_pad = groups * self.tok_group
        return replace(self, codes=self.codes[:, :n_pad], scale=self.scale[:, :groups], zero=self.zero[:, :groups], n=m)


def quantize(
    x: torch.Tensor,
    valid: torch.Tensor | None,
    bits: int,
    tok_group: int = 0,
    ch_group: int = 0,
    param_dtype: torch.dtype | None = None,
) -> QuantTensor:
    """Quantise ``x`` [B, N, C] to ``bits`` in groups (0 = the whole axis); ``valid`` [B, N] masks padding.

    Every valid entry is reconstructed within half a quantisation step of its group
    (``(max - min) / (2^bits - 1) / 2``), up to the rounding of the parameters to ``param_dtype``.
    """
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    bsz, n, c = x.shape
    tg = tok_group if tok_group > 0 else max(n, 1)
    cg = ch_group if ch_group > 0 else c
    if c % cg:
        raise ValueError(f"channel group {cg} does not divide {c} channels")
    param_dtype = param_dtype or x.dtype
    if valid is None:
        valid = torch.ones(bsz, n, dtype=torch.bool, device=x.device)
    n_pad = -(-n // tg) * tg if n > 0 else tg
    xf = x.float()
    if n_pad != n:
        xf = torch.cat([xf, xf.new_zeros(bsz, n_pad - n, c)], 1)
        valid = torch.cat([valid, valid.new_zeros(bsz, n_pad - n)], 1)
    xr = xf.view(bsz, n_pad // tg, tg, c // cg, cg)
    vm = valid.view(bsz, n_pad // tg, tg, 1, 1)
    mn = xr.masked_fill(~vm, float("inf")).amin(dim=(2, 4))
    mx = xr.masked_fill(~vm, float("-inf")).amax(dim=(2, 4))
    empty = ~torch.isfinite(mn)
    mn = mn.masked_fill(empty, 0.0)
    mx = mx.masked_fill(empty, 0.0)
    qmax = (1 << bits) - 1
    scale = ((mx - mn) / qmax).to(param_dtype)
    zero = mn.to(param_dtype)
    s = scale.float()[:, :, None, :, None]
    z = zero.float()[:, :, None, :, None]
    codes = torch.where(s > 0, ((xr - z) / s.clamp_min(torch.finfo(torch.float32).tiny)).round(), torch.zeros_like(xr))
    codes = codes.clamp(0, qmax).masked_fill(~vm, 0).to(torch.uint8).view(bsz, n_pad, c)
    return QuantTensor(pack(codes, bits), scale, zero, bits, tg, cg, n, c)


def quant_param_count(n: int, c: int, tok_group: int, ch_group: int) -> int:
    """Scale + zero-point values of an [n, c] tensor quantised in (tok_group x ch_group) groups."""
    if n == 0:
        return 0
    tg = tok_group if tok_group > 0 else n
    cg = ch_group if ch_group > 0 else c
    return 2 * math.ceil(n / tg) * (c // cg)
