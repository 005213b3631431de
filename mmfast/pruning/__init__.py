"""Vision-token pruning and merging stages, one method per module; importing registers them all."""

import importlib
import pkgutil

from .base import Pruner

for _m in pkgutil.iter_modules(__path__):
    if not _m.name.startswith("_") and _m.name != "base":
        importlib.import_module(f"{__name__}.{_m.name}")

__all__ = ["Pruner"]
