"""mmfast: faster and more truthful LLaVA-style multimodal LLMs.

Public API::

    import mmfast
    mm = mmfast.load("mmfast/tiny-world")              # or a local dir / hub id
    recipe = mmfast.load_recipe("configs/examples/fastv_64.yaml")
    results = mm.generate(image, "Describe the image.", recipe=recipe)
    with mmfast.apply(mm, recipe) as session:          # hooks installed; restored on exit
        session.generate([...], [...])
"""

from __future__ import annotations

import logging

from .config import Recipe, load_recipe
from .errors import ConfigError, IncompatibleRecipeError, InputError, MMFastError, ModelLoadError, UnknownMethodError
from .model import MMModel, load
from .pipeline import GenerationResult, Session, apply
from .registry import DECODERS, DRAFTERS, PRUNERS, REGISTRIES

__version__ = "0.1.0"

logging.getLogger(__name__).addHandler(logging.NullHandler())


def list_methods() -> dict[str, list[tuple[str, str]]]:
    """Every registered method by kind: {kind: [(name, description), ...]}."""
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
    "Recipe",
    "Session",
    "UnknownMethodError",
    "apply",
    "list_methods",
    "load",
    "load_recipe",
]
