"""Decoders. Importing this package registers the built-ins (one method per file)."""

from . import beam, greedy, sample  # noqa: F401
from .base import Decoder, DecodeOutput

__all__ = ["Decoder", "DecodeOutput"]
