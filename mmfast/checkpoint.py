"""Where a model name points: the embedded model shipped inside the package (``mmfast/tiny-world``),
a local ``save_pretrained`` directory, or a hub id.

A leaf (it imports only :mod:`mmfast.errors` and :mod:`mmfast.weights_pack`): the capability checks
read a model's config before it loads, and the trainers find their model, without importing
:mod:`mmfast.model`. The embedded model's weights ship packed; its name resolves to their unpacked
copy in the cache (:func:`mmfast.weights_pack.materialise`, made on first use).
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import ModelLoadError
from .weights_pack import materialise

ASSETS = Path(__file__).resolve().parent / "assets"
EMBEDDED: dict[str, str] = {"mmfast/tiny-world": "tiny-world"}
DEFAULT_MODEL = "mmfast/tiny-world"


def embedded_dir(name: str = DEFAULT_MODEL) -> Path:
    """The directory an embedded model loads from (its weights unpacked into the cache on first use)."""
    return Path(_resolve(name)[0])


def source_dir(name_or_path: str | os.PathLike) -> Path | None:
    """Where a trainer writes a model's parts by default: an embedded model's directory in the package
    (whose weights are then packed again: ``scripts/pack_weights.py``) or a local directory; None for a hub id."""
    name = str(name_or_path)
    if name in EMBEDDED:
        return ASSETS / EMBEDDED[name]
    path = Path(name).expanduser()
    return path if path.is_dir() else None


def _resolve(name_or_path: str | os.PathLike) -> tuple[str, bool]:
    name = str(name_or_path)
    if name in EMBEDDED:
        path = ASSETS / EMBEDDED[name]
        if not (path / "config.json").is_file():
            raise ModelLoadError(
                f"embedded model {name!r} is missing from the package ({path}); reinstall mmfast or run "
                "scripts/train_embedded.py to rebuild it"
            )
        return str(materialise(path)), True
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} has no config.json; point at a directory written by save_pretrained")
        return str(materialise(path)), True  # a packed copy of a model directory (packed.json) too
    if path.exists() or name.startswith((".", "/", "~")):
        raise ModelLoadError(f"model path {name!r} does not exist or is not a directory")
    return name, False
