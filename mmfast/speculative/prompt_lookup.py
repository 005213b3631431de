"""Prompt lookup decoding (PLD) with an ADED-style adaptive trigram table. Training-free.

PLD (Saxena 2023; transformers' ``prompt_lookup_num_tokens``): find the trailing n-gram (n =
``max_ngram`` .. 1) earlier in the prompt text or the answer so far (first match, left to right)
and propose the (at most ``num_tokens``) tokens that followed it, cut *before* the first EOS, as
transformers' ``PromptLookupCandidateGenerator`` does (so a draft never contains EOS; a match whose
continuation starts with EOS proposes nothing, and the search does not move on to a later match,
also as there). When nothing matches,
an ADED-style table (Liu et al., AAAI 2025) of trigram counts P(x_t | x_{t-2}, x_{t-1}), updated online
from *verified* output and shared across requests in the session, proposes a small tree: the
``branching`` most frequent continuations per node, ``trigram_depth`` deep (ADED grows its tree with
MCTS; a count-ranked beam is used here). At T > 0 each sample drafts from and teaches a table of its own
answer only: a draft decides which uniforms the acceptance rule reads, so a table taught by the samples
decoded before it would make a sample's draw depend on its batch (the engine's per-sample randomness).
All proposals are point masses, so the engine's acceptance rule keeps greedy and sampled outputs exact.
Image tokens are never part of an n-gram.

Under captured steps a greedy cycle sends the draft to the device in one copy (padded to the verify width) and
verifies it there (:meth:`PromptLookup.propose_on_device`; one host read of the verdict a cycle).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass

from ..capabilities import Capabilities
from ..config import opt
from ..registry import DRAFTERS
from .base import Drafter
from .tree import DeviceTree, DraftTree

#: the most drafts a trigram tree may hold (its bound: what a verify step reserves), as MSD / FLASH's total_tokens
MAX_TRIGRAM_NODES = 1023


def _trigram_nodes(branching: int, depth: int) -> int:
    """The trigram tree's bound: ``branching`` continuations per node, ``depth`` levels."""
    return sum(branching**d for d in range(1, depth + 1))


@DRAFTERS.register("prompt_lookup", description="prompt lookup (n-gram) drafts + adaptive trigram table; no training")
class PromptLookup(Drafter):
    """Prompt lookup + adaptive trigram drafts."""

    caps = Capabilities()

    @dataclass(frozen=True)
    class Config:
        num_tokens: int = opt(10, lo=1, hi=64, doc="max draft tokens per cycle (transformers' default 10)")
        max_ngram: int = opt(2, lo=1, hi=8, doc="longest trailing n-gram to match (transformers' default 2)")
        trigram: bool = opt(True, doc="fall back to the adaptive trigram table when nothing matches")
        branching: int = opt(2, lo=1, hi=8, doc="trigram tree: continuations per node")
        trigram_depth: int = opt(4, lo=1, hi=16, doc="trigram tree depth")

        def __post_init__(self) -> None:
            # the verify step reserves the tree's bound (max_step_tokens), as the EAGLE drafters' total_tokens
            nodes = _trigram_nodes(self.branching, self.trigram_depth) if self.trigram else 0
            if nodes > MAX_TRIGRAM_NODES:
                raise ValueError(
                    f"a trigram tree of branching {self.branching} and trigram_depth {self.trigram_depth} holds up to "
                    f"{nodes} drafts, each verified in one target forward (and reserved in a static KV cache); lower "
                    f"branching or trigram_depth to a tree of at most {MAX_TRIGRAM_NODES} drafts (branching 2: depth 9)"
                )

    def install(self) -> None:
        self.table: dict[tuple[int, int], Counter] = defaultdict(Counter)  # the session's (greedy decoding)
        self._table = self.table  # the one the sequence being decoded drafts from and teaches

    def max_step_tokens(self) -> int:
        cfg = self.config
        trigram = _trigram_nodes(cfg.branching, cfg.trigram_depth) if cfg.trigram else 0
        return 1 + max(cfg.num_tokens, trigram)  # the root and the n-gram chain or the trigram tree

    def begin(self, ctx) -> None:
        ids = ctx.inputs.input_ids[0]
        text = ids.masked_fill(ctx.inputs.image_mask[0], -1)
        self.prompt = [int(t) for t in text.tolist() if t >= 0]
        # sampling: the sample's own table (the session's would carry what earlier samples drew into this draw)
        self._table = self.table if ctx.greedy else defaultdict(Counter)

    def _lookup(self, seq: list[int]) -> list[int] | None:
        """The n-gram draft: the tokens after the first earlier match of the trailing n-gram (n from
        ``max_ngram`` down), cut before the first EOS; ``None`` when nothing matches."""
        cfg = self.config
        stop = set(self.ctx.special.eos)
        for n in range(min(cfg.max_ngram, len(seq) - 1), 0, -1):
            tail = seq[-n:]
            for start in range(len(seq) - n):
                if seq[start : start + n] == tail:
                    out = seq[start + n : start + n + cfg.num_tokens]
                    cut = next((i for i, t in enumerate(out) if t in stop), len(out))
                    return out[:cut]
        return None

    def propose(self, ctx, root: int) -> DraftTree:
        return DraftTree.of_lists(*self._draft(ctx), device=ctx.inputs.input_ids.device)

    def propose_on_device(self, ctx) -> DeviceTree:
        """The draft built on the host (as :meth:`propose`) and sent in one copy, padded to the verify width with
        never-accepted pad nodes (one verdict graph for every draft); the verdict stays on the device."""
        cfg = self.config
        levels = max(cfg.num_tokens, cfg.trigram_depth if cfg.trigram else 0)
        tokens, parents = self._draft(ctx)
        dev = ctx.inputs.input_ids.device
        return DeviceTree.from_lists(tokens, parents, self.max_step_tokens(), ctx.committed[-1], levels, dev)

    def _draft(self, ctx) -> tuple[list[int], list[int]]:
        """The draft's tokens and parents (0 = root): the n-gram chain, else the trigram tree, else nothing."""
        seq = self.prompt + ctx.committed
        drafted = self._lookup(seq)
        if drafted is not None:  # a match (possibly cut to nothing at EOS: no draft, as transformers)
            tokens, parents = drafted, list(range(len(drafted)))
        elif self.config.trigram and len(seq) >= 2:
            tokens, parents = self._trigram_tree(seq[-2], seq[-1])
        else:
            tokens, parents = [], []
        ctx.extras["draft_tokens"] = ctx.extras.get("draft_tokens", 0) + len(tokens)
        return tokens, parents

    def _trigram_tree(self, a: int, b: int) -> tuple[list[int], list[int]]:
        cfg = self.config
        tokens, parents = [], []
        frontier = [(0, a, b)]
        for _ in range(cfg.trigram_depth):
            nxt = []
            stop = set(self.ctx.special.eos)
            for node, x, y in frontier:
                ranked = [tok for tok, _ in self._table.get((x, y), Counter()).most_common() if tok not in stop]
                for tok in ranked[: cfg.branching]:  # drafts never hold EOS (as the n-gram drafts)
                    tokens.append(tok)
                    parents.append(node)
                    nxt.append((len(tokens), y, tok))
            frontier = nxt
            if not frontier:
                break
        return tokens, parents

    def accept_on_device(self, ctx, packed, hidden) -> None:
        """Nothing on the device: the trigram table learns from the committed tokens (:meth:`accepted_on_device`)."""

    def accepted_on_device(self, ctx, n: int) -> None:
        self._learn(ctx, n - 1)

    def accept(self, ctx, tree, path, hidden, bonus) -> None:
        self._learn(ctx, len(path))

    def _learn(self, ctx, path_len: int) -> None:
        """The trigram table counts the trigrams ending in the cycle's committed tokens."""
        seq = (self.prompt + ctx.committed)[-(path_len + 3) :]
        for x, y, z in zip(seq, seq[1:], seq[2:]):
            self._table[(x, y)][z] += 1
