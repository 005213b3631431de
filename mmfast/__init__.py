"""mmfast: faster and more truthful LLaVA-style multimodal LLMs.

Public API::

    import mmfast
    mm = mmfast.load("mmfast/tiny-world")              # or a local dir / hub id
    recipe = mmfast.load_recipe("configs/examples/fastv_192.yaml")
    results = mm.generate(image, "Describe the image.", recipe=recipe)
    with mmfast.apply(mm, recipe) as session:          # hooks installed; restored on exit
        session.generate([...], [...])
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

logging.getLogger(__name__).addHandler(logging.NullHandler())

# Attributes are imported on first use (PEP 562), so `import mmfast` and `mmfast --help` do not pay
# for torch and transformers until something needs them.
_LAZY = {
    "Recipe": "config",
    "load_recipe": "config",
    "ConfigError": "errors",
    "IncompatibleRecipeError": "errors",
    "InputError": "errors",
    "MMFastError": "errors",
    "ModelLoadError": "errors",
    "UnknownMethodError": "errors",
    "MMModel": "model",
    "load": "model",
    "GenerationResult": "pipeline",
    "Session": "pipeline",
    "apply": "pipeline",
    "DECODERS": "registry",
    "DRAFTERS": "registry",
    "PRUNERS": "registry",
    "REGISTRIES": "registry",
    "TASKS": "registry",
}

if TYPE_CHECKING:
    from .config import Recipe, load_recipe
    from .errors import (
        ConfigError,
        IncompatibleRecipeError,
        InputError,
        MMFastError,
        ModelLoadError,
        UnknownMethodError,
    )
    from .model import MMModel, load
    from .pipeline import GenerationResult, Session, apply
    from .registry import DECODERS, DRAFTERS, PRUNERS, REGISTRIES, TASKS


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mmfast' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


def list_methods() -> dict[str, list[tuple[str, str]]]:
    """Every registered method by kind: {kind: [(name, description), ...]}."""
    from .registry import REGISTRIES

    return {kind: [(e.name, e.description) for e in reg.entries()] for kind, reg in REGISTRIES.items()}


__all__ = [
    "ConfigError",
    "DECODERS",
    "DRAFTERS",
    "GenerationResult",
    "IncompatibleRecipeError",
    "InputError",
    "MMFastError",
    "MMModel",
    "ModelLoadError",
    "PRUNERS",
    "REGISTRIES",
    "Recipe",
    "Session",
    "TASKS",
    "UnknownMethodError",
    "apply",
    "list_methods",
    "load",
    "load_recipe",
]
