"""Where a model name points: the embedded model shipped inside the package (``mmfast/tiny-world``),
a local ``save_pretrained`` directory, or a hub id.

A leaf (it imports only :mod:`mmfast.errors`): the capability checks read a model's config before
it loads, and the trainers find their model, without importing :mod:`mmfast.model`.
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import ModelLoadError

ASSETS = Path(__file__).resolve().parent / "assets"
EMBEDDED: dict[str, str] = {"mmfast/tiny-world": "tiny-world"}
DEFAULT_MODEL = "mmfast/tiny-world"


def _resolve(name_or_path: str | os.PathLike) -> tuple[str, bool]:
    name = str(name_or_path)
    if name in EMBEDDED:
        path = ASSETS / EMBEDDED[name]
        if not (path / "config.json").is_file():
            raise ModelLoadError(
                f"embedded model {name!r} is missing from the package ({path}); reinstall mmfast or run "
                "scripts/train_embedded.py to rebuild it"
            )
        return str(path), True
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} has no config.json; point at a directory written by save_pretrained")
        return str(path), True
    if path.exists() or name.startswith((".", "/", "~")):
        raise ModelLoadError(f"model path {name!r} does not exist or is not a directory")
    return name, False
