"""Speculative drafters (one per module) and the lossless draft-and-verify engine."""

import importlib
import pkgutil

from .base import Drafter

for _m in pkgutil.iter_modules(__path__):
    if not _m.name.startswith("_") and _m.name not in ("base", "engine", "tree"):
        importlib.import_module(f"{__name__}.{_m.name}")

__all__ = ["Drafter"]
