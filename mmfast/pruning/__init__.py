"""Vision-token pruning and merging stages. Importing this package registers the built-ins."""

from .base import Pruner

__all__ = ["Pruner"]
