"""Speculative drafters and the lossless draft-and-verify engine."""

from .base import Drafter

__all__ = ["Drafter"]
