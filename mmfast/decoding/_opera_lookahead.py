"""OPERA's attention rows (the decoder: :mod:`.opera`): the last decoder layer's rows, max over heads, of a beam
step and of the look-ahead over each beam's candidates, read through the attention probe and renormalised.

Look-ahead ``tree`` appends the N candidates of every beam as N sibling tokens of one forward (same position, each
sees the cache and itself only: ``runner.step(depth=0, block_mask=eye)``) and crops them back, so no cache is
copied; ``clone`` runs K x N rows on deep-cloned, repeated caches (``chunk`` candidate sets a forward), and is taken
whenever the recipe acts on every decode step (KV policies, decode hooks). On a static cache the probe's rows span
the layer's whole buffer (free slots masked: 0), whose first slots are the held ones in order; the probe is
shape-only (``all_rows``) and replayed inside captured steps (``watch(decode_replayable=True)``), the tree's step
and the beams' being graphs apart.
"""

from __future__ import annotations

import math

import torch

from .. import compat
from ..errors import IncompatibleRecipeError
from ..hooks.attention import all_rows
from ._opera_penalty import renormalised


class LastLayerRows:
    """Reads OPERA's last-layer attention rows of the forwards it runs (``key``: the probe's record name)."""

    def __init__(self, ctx, key: str, lookahead: str, chunk: int) -> None:
        self.ctx, self.key, self.lookahead, self.chunk = ctx, key, lookahead, chunk
        self._tree = False  # set during a tree look-ahead forward (a step with a block mask): record every row
        ctx.probe.watch(
            key,
            ctx.adapter.layers[-1].self_attn,
            rows=all_rows,  # a one-token step's only row, or every sibling of a tree look-ahead
            when=lambda q, k: q == 1 or self._tree,
            reduce="max",
            decode_replayable=True,
        )
        # the probe's filter reads the flag: a captured step records whether it ran in a look-ahead
        ctx.runner.graph_variants.append(lambda state: ("opera", self._tree))

    def step(self, state, tokens: torch.Tensor, keys: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``tokens`` ([R]) and return (logits [R, V], renormalised last-layer rows [R, keys])."""
        self.ctx.probe.records.pop(self.key, None)
        logits = self.ctx.runner.step(state, tokens[:, None], all_logits=False).logits[:, -1]
        row = self._rows(state, keys)[:, -1].float()  # [R, keys], max over heads
        return logits, renormalised(row)

    def candidates(self, state, cand: torch.Tensor, keys: int) -> tuple[torch.Tensor, int]:
        """Each candidate's ([K, N]) renormalised last-layer row ([K, N, keys]) and the forwards it took."""
        if self.lookahead == "tree" and not self.per_step_policies():
            return self._tree_rows(state, cand, keys), 1
        n = cand.shape[1]
        return self._clone_rows(state, cand, keys), math.ceil(n / (self.chunk or n))

    def per_step_policies(self) -> bool:
        """Whether the recipe acts on every decode step (KV policies after a step, decode-time layer hooks)."""
        runner = self.ctx.runner
        return bool(runner.step_hooks) or bool(getattr(runner, "_decode", None))

    def _rows(self, state, keys: int) -> torch.Tensor:
        """The rows ([R, Q', keys]) of the forward that just ran, whose last layer must hold ``keys`` keys."""
        rec = self.ctx.probe.get(self.key)
        held = rec.k_len if rec is not None and not compat.is_static(state.cache) else state.groups[-1].length
        if rec is None or held != keys:
            raise IncompatibleRecipeError(
                f"OPERA needs every generated token cached in the last decoder layer (expected {keys} keys, got "
                f"{None if rec is None else held}); a decode-time KV policy in this recipe changes it"
            )
        return rec.probs[..., :keys]

    def _tree_rows(self, state, cand: torch.Tensor, keys: int) -> torch.Tensor:
        """All N candidates of a beam as N sibling tokens of one forward, then cropped back -> [K, N, keys]."""
        n, dev = cand.shape[1], cand.device
        self.ctx.probe.records.pop(self.key, None)
        self._tree = True
        try:
            self.ctx.runner.step(
                state,
                cand,
                depth=torch.zeros(n, dtype=torch.long, device=dev),
                block_mask=torch.eye(n, dtype=torch.bool, device=dev),
                all_logits=False,
            )
            probs = self._rows(state, keys - 1 + n).float()  # [K, N, past + N]; a sibling's column is exactly 0
        finally:
            self._tree = False
            state.crop_last(n)
        past = keys - 1
        own = probs[..., past:].diagonal(dim1=-2, dim2=-1)  # [K, N] each candidate's attention to itself
        return renormalised(torch.cat([probs[..., :past], own[..., None]], -1))

    def _clone_rows(self, state, cand: torch.Tensor, keys: int) -> torch.Tensor:
        """One look-ahead forward per chunk of candidate sets on cloned, repeated caches -> [K, N, keys]."""
        k, n = cand.shape
        chunk = self.chunk or n
        rows = []
        for c0 in range(0, n, chunk):
            c1 = min(n, c0 + chunk)
            fan = state.clone()  # deep copy: the look-ahead never touches the beams' cache
            fan.repeat_interleave(c1 - c0)
            _, r = self.step(fan, cand[:, c0:c1].reshape(-1), keys)
            rows.append(r.view(k, c1 - c0, keys))
            del fan
        return torch.cat(rows, 1)
