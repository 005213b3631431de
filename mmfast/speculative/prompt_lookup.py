"""Prompt lookup decoding (PLD) with an ADED-style adaptive trigram table. Training-free.

PLD (Saxena 2023; transformers' ``prompt_lookup_num_tokens``): find the trailing n-gram (n =
``max_ngram`` .. 1) earlier in the prompt text or the answer so far (first match, left to right)
and propose the (at most ``num_tokens``) tokens that followed it, cut *before* the first EOS, as
transformers' ``PromptLookupCandidateGenerator`` does (so a draft never contains EOS; a match whose
continuation starts with EOS proposes nothing, and the search does not move on to a later match,
also as there). When nothing matches,
an ADED-style table (Liu et al., AAAI 2025) of trigram counts P(x_t | x_{t-2}, x_{t-1}), updated online
from *verified* output and shared across requests in the session, proposes a small tree: the
``branching`` most frequent continuations per node, ``num_tokens`` deep (ADED grows its tree with
MCTS; a count-ranked beam is used here). All proposals are point masses, so the engine's acceptance
rule keeps greedy and sampled outputs exact. Image tokens are never part of an n-gram.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass

import torch

from ..capabilities import Capabilities
from ..config import opt
from ..registry import DRAFTERS
from .base import Drafter
from .tree import DraftTree


@DRAFTERS.register("prompt_lookup", description="prompt lookup (n-gram) drafts + adaptive trigram table; no training")
class PromptLookup(Drafter):
    caps = Capabilities()
    """Prompt lookup + adaptive trigram drafts."""

    @dataclass(frozen=True)
    class Config:
        num_tokens: int = opt(10, lo=1, hi=64, doc="max draft tokens per cycle (transformers' default 10)")
        max_ngram: int = opt(2, lo=1, hi=8, doc="longest trailing n-gram to match (transformers' default 2)")
        trigram: bool = opt(True, doc="fall back to the adaptive trigram table when nothing matches")
        branching: int = opt(2, lo=1, hi=8, doc="trigram tree: continuations per node")
        trigram_depth: int = opt(4, lo=1, hi=16, doc="trigram tree depth")

    def install(self) -> None:
        self.table: dict[tuple[int, int], Counter] = defaultdict(Counter)

    def max_step_tokens(self) -> int:
        cfg = self.config
        trigram = sum(cfg.branching**d for d in range(1, cfg.trigram_depth + 1)) if cfg.trigram else 0
        return 1 + max(cfg.num_tokens, trigram)  # the root and the n-gram chain or the trigram tree

    def begin(self, ctx) -> None:
        ids = ctx.inputs.input_ids[0]
        text = ids.masked_fill(ctx.inputs.image_mask[0], -1)
        self.prompt = [int(t) for t in text.tolist() if t >= 0]

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
        seq = self.prompt + ctx.committed
        dev = ctx.inputs.input_ids.device
        drafted = self._lookup(seq)
        if drafted is not None:  # a match (possibly cut to nothing at EOS: no draft, as transformers)
            tree = DraftTree.chain(drafted, device=dev)
        elif self.config.trigram and len(seq) >= 2:
            tree = self._trigram_tree(seq[-2], seq[-1], dev)
        else:
            tree = DraftTree.empty(dev)
        ctx.extras["draft_tokens"] = ctx.extras.get("draft_tokens", 0) + tree.n
        return tree

    def _trigram_tree(self, a: int, b: int, dev) -> DraftTree:
        cfg = self.config
        tokens, parents = [], []
        frontier = [(0, a, b)]
        for _ in range(cfg.trigram_depth):
            nxt = []
            stop = set(self.ctx.special.eos)
            for node, x, y in frontier:
                ranked = [tok for tok, _ in self.table.get((x, y), Counter()).most_common() if tok not in stop]
                for tok in ranked[: cfg.branching]:  # drafts never hold EOS (as the n-gram drafts)
                    tokens.append(tok)
                    parents.append(node)
                    nxt.append((len(tokens), y, tok))
            frontier = nxt
            if not frontier:
                break
        return DraftTree(
            torch.tensor(tokens, dtype=torch.long, device=dev), torch.tensor(parents, dtype=torch.long, device=dev)
        )

    def accept(self, ctx, tree, path, hidden, bonus) -> None:
        seq = (self.prompt + ctx.committed)[-(len(path) + 3) :]
        for x, y, z in zip(seq, seq[1:], seq[2:]):
            self.table[(x, y)][z] += 1
