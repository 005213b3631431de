"""Decoders, one method per module; importing registers them all."""

import importlib
import pkgutil

from .base import DecodeOutput, Decoder

for _m in pkgutil.iter_modules(__path__):
    if not _m.name.startswith("_") and _m.name not in ("base", "loop"):
        importlib.import_module(f"{__name__}.{_m.name}")

__all__ = ["Decoder", "DecodeOutput"]
