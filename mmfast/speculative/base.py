"""Base class for speculative drafters (the proposer side of draft-and-verify).

A drafter proposes a :class:`~mmfast.speculative.tree.DraftTree` under the root (the last committed
token, not yet in the target cache) and learns what was accepted. The engine
(:mod:`mmfast.speculative.engine`) does the verification, the acceptance rule and the KV rollback,
so every drafter is lossless by construction as long as each node's proposal distribution is
reported (``q``; ``None`` for deterministic proposals).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

from ..capabilities import Capabilities
from ..registry import Method

if TYPE_CHECKING:
    from .engine import SpecContext
    from .tree import DeviceTree, DraftTree


class Drafter(Method):
    """Proposes draft tokens that the target verifies losslessly."""

    #: the engine passes the prompt's final hidden states (EAGLE-style drafts)
    needs_hidden: ClassVar[bool] = False
    caps: ClassVar[Capabilities] = Capabilities()

    def install(self) -> None:
        """Register hooks (called once when the session opens)."""

    def max_step_tokens(self) -> int | None:
        """The most tokens one cycle appends to the target's cache at once, root included (what a
        static KV cache reserves beyond ``max_new_tokens``); None: not bounded (a larger step grows the
        static buffers, logged, and a captured step is captured again)."""
        return None

    def begin(self, ctx: SpecContext) -> None:
        """A new sequence: the target has prefilled ``ctx.inputs`` and committed the first token."""

    def propose(self, ctx: SpecContext, root: int) -> DraftTree:
        raise NotImplementedError

    def propose_on_device(self, ctx: SpecContext) -> DeviceTree | None:
        """The proposal as one captured step whose tree stays on the device (nothing read back), with its
        verify layout: what the engine's cycle on the device takes (one host read per cycle; greedy, or sampling
        with every node a point mass: a deterministic proposal, ``q`` None in :meth:`propose`'s tree). None: this
        drafter proposes through :meth:`propose`. A drafter that returns a tree implements ``accept_on_device``
        (launched before the read) and ``accepted_on_device`` (after it, the cycle's tokens committed):
        :class:`~mmfast.speculative._eagle.EagleDrafter`, :class:`~mmfast.speculative.prompt_lookup.PromptLookup`."""
        return None

    def accept(self, ctx: SpecContext, tree: DraftTree, path: list[int], hidden: torch.Tensor, bonus: int) -> None:
        """``path`` (node ids) was accepted; ``hidden`` ([1 + len(path), d]) are the target's final
        hidden states at the root and the accepted nodes; ``bonus`` is the next root."""
