"""Hooks: the HookSession that owns every change to a model, and the attention probe."""

from .attention import (
    AttentionProbe,
    Carried,
    ModuleAttentionHooks,
    ProbeRecord,
    attach,
    cls_row,
    last_row,
    row_attention,
)
from .session import HookSession, count_hooks

__all__ = [
    "AttentionProbe",
    "HookSession",
    "ModuleAttentionHooks",
    "ProbeRecord",
    "Carried",
    "attach",
    "cls_row",
    "count_hooks",
    "last_row",
    "row_attention",
]
