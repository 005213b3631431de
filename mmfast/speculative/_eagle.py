"""The EAGLE-style draft trunk shared by MSD and FLASH, its KV cache, EAGLE-2 dynamic trees, weights I/O.

Architecture (EAGLE, Li et al. 2024; the ``cnets.py`` of EAGLE / MSD / FlashSD): the draft reads, at
row ``j``, the pair (target final hidden state ``h_j``, embedding of the *next* token ``x_{j+1}``)
through ``fc = Linear(2d -> d, bias)`` and **one** Llama decoder layer (the target's width, heads and
FFN; no input RMSNorm, as EAGLE's layer 0), and regresses ``h_{j+1}``; the target's **frozen**
embeddings and LM head are reused (referenced, never copied into the draft's checkpoint). Row ``j``
has position ``j`` of the draft's own sequence, so the output of the row whose next token is the root
(the last committed token) is the draft's guess of the root's hidden state, whose LM-head
distribution proposes the root's children.

Multimodal variants change only how rows are built (:meth:`DraftModel.rows`): MSD feeds the projected
visual embedding itself at rows whose next token is an image token (no ``fc``, the target hidden state
discarded); FLASH replaces each image's rows by ``C`` latent rows pooled with learnable queries. FLASH
adds a semi-autoregressive head: the layer output is mapped to ``K`` future features per row.

Inference runs on a preallocated one-layer KV cache of the accepted prefix (:mod:`._draft_cache`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ._draft_cache import DraftCache
from ._eagle_model import load_draft, resolve_weights
from .base import Drafter
from .tree import DeviceTree, DraftTree, tree_layout

if TYPE_CHECKING:
    from .engine import SpecContext

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------ trees


def select_tree(tokens: torch.Tensor, scores: torch.Tensor, parents: torch.Tensor, total: int) -> DraftTree:
    """EAGLE-2's rerank: keep the ``total`` best candidates by cumulative log-prob.

    Candidates are in level order (parents before children, ``parents`` = candidate index or -1 for
    the root). A stable descending sort keeps ancestors first among ties, and a child's cumulative
    score never exceeds its parent's, so the kept set is closed under ancestors.
    """
    keep, tree_par, orphan = _rerank(scores, parents, total)
    if bool(orphan.any()):  # an ancestor fell out (ties at -inf): drop such nodes
        ok = ~orphan
        par = parents[keep]
        return select_tree(tokens[keep][ok], scores[keep][ok], _reindex(par, ok), int(ok.sum()))
    return DraftTree(tokens.index_select(0, keep), tree_par)


def _rerank(scores: torch.Tensor, parents: torch.Tensor, total: int) -> tuple[torch.Tensor, ...]:
    """:func:`select_tree`'s fixed-shape part (no host read): the kept candidates ([T], level order), their
    tree parents ([T], 0 = root) and which of them lost an ancestor ([T] bool; none unless scores tie at -inf)."""
    n = int(scores.numel())
    total = min(total, n)
    order = torch.sort(scores, descending=True, stable=True).indices[:total]
    keep = torch.sort(order).values  # back to level order: parents before children
    new_id = torch.zeros(n, dtype=torch.long, device=scores.device)
    new_id.index_copy_(0, keep, torch.arange(1, total + 1, device=scores.device))
    par = parents.index_select(0, keep)
    tree_par = torch.where(par < 0, torch.zeros_like(par), new_id.index_select(0, par.clamp(min=0)))
    return keep, tree_par, (par >= 0) & (tree_par == 0)


def _reindex(par: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    new = torch.cumsum(ok.long(), 0) - 1
    out = torch.where(par >= 0, new[par.clamp(min=0)], par)
    return out[ok]


class EagleDrafter(Drafter):
    """An EAGLE-style drafter over :class:`DraftModel`; subclasses build the tree in :meth:`propose`."""

    needs_hidden: ClassVar[bool] = True
    kind: ClassVar[str] = ""

    def max_step_tokens(self) -> int:
        return int(self.config.total_tokens)  # the verified tree, root included

    def install(self) -> None:
        path = resolve_weights(getattr(self.config, "weights", None), self.ctx, self.kind)
        self.model = load_draft(path, self.ctx, self.kind)
        self.cache = DraftCache(self.model)
        self.root_slots: torch.Tensor | None = None  # [K, d] the draft's features at the root row
        self.pos = 0  # draft position of the next committed row
        #: captured draft steps (model.compile: auto), by step and the buffers they read; see :meth:`_captured`
        self._graphs: dict[tuple, Any] = {}  # runtime._Captured
        self._root: torch.Tensor | None = None  # [K, d] the root slots' fixed buffer while captured steps run
        #: [2] long (committed rows, next position): the draft's counters on the device while captured steps run,
        #: advanced inside the accept step (the host mirrors them in ``cache.committed`` and ``pos``)
        self._meta: torch.Tensor | None = None
        self._capture_refused = False

    # -- sequence start -----------------------------------------------------------------------------
    def _prompt_hidden(self, ctx: SpecContext) -> torch.Tensor:
        """[L, d] target final hidden states of the prompt (pruned slots of an in-LLM pruner: zeros)."""
        hidden = ctx.prefill.hidden[0]
        length = ctx.inputs.length
        if hidden.shape[0] == length:
            return hidden
        full = hidden.new_zeros(length, hidden.shape[-1])
        src = ctx.state.groups[-1].source[0]
        if src.numel() == hidden.shape[0]:
            ok = src >= 0
            full[src[ok]] = hidden[ok]
        else:  # the layout changed after prefill (a KV policy): align on the last (text) positions
            n = min(length, hidden.shape[0])
            full[-n:] = hidden[-n:]
        return full

    @torch.inference_mode()
    def begin(self, ctx: SpecContext) -> None:
        if ctx.prefill is None or ctx.prefill.hidden.shape[1] < 2 and ctx.inputs.length > 1:
            raise RuntimeError(f"{self.kind}: the engine must pass the prompt's hidden states (needs_hidden)")
        m = self.model
        inp = ctx.inputs
        hid = self._prompt_hidden(ctx).to(m.fc.weight.dtype)  # [L, d]
        root = torch.tensor([ctx.committed[-1]], device=inp.input_ids.device)
        emb = inp.embeds[0].to(hid.dtype)
        next_emb = torch.cat([emb[1:], m.embed(root).to(hid.dtype)])  # [L, d] embedding of token j+1
        img = torch.where(inp.image_mask[0], inp.image_index[0], torch.full_like(inp.image_index[0], -1))
        row_image = torch.cat([img[1:], img.new_full((1,), -1)])
        vis_src = None
        if m.arch.n_latents and m.arch.compress_source == "hidden":
            vis_src = torch.cat([hid[1:], hid[-1:]])  # hidden state of token j+1 at visual rows
        x, _ = m.rows(next_emb, hid, row_image, vis_src)
        self.cache.reset()
        n = x.shape[0]
        pos = torch.arange(n, device=x.device)
        out = self.cache.append(x, pos, query=slice(n - 1, n), max_pos=n - 1)  # K/V for every row, output of the last
        self.cache.commit()
        self.pos = n
        self.root_slots = self._keep_root(ctx, m.slots(out[-1]))
        if self._root is not None:  # captured steps read the counters on the device (one copy a sequence)
            self._meta.copy_(torch.tensor([self.cache.committed, self.pos], device=self._meta.device))
        self._count(ctx, forwards=1)

    @torch.inference_mode()
    def accept(self, ctx: SpecContext, tree: DraftTree, path: list[int], hidden: torch.Tensor, bonus: int) -> None:
        m = self.model
        self.cache.rollback()
        toks = [tree.token_list[i - 1] for i in path] + [int(bonus)]
        factory = self._factory(ctx)
        if factory is not None and self._root is not None and len(toks) <= self.max_step_tokens():
            self._accept_captured(ctx, factory, toks, hidden)
            return
        ids = torch.tensor(toks, device=hidden.device)
        h = hidden.to(m.fc.weight.dtype)
        f = self.cache.f
        x = f.fc(f.embed(ids).to(h.dtype), h)  # generated tokens are text rows
        n = x.shape[0]
        pos = torch.arange(self.pos, self.pos + n, device=x.device)
        out = self.cache.append(x, pos, query=slice(n - 1, n), max_pos=self.pos + n - 1)
        self.cache.commit()
        self.pos += n
        self.root_slots = self._keep_root(ctx, m.slots(out[-1]))
        self._count(ctx, forwards=1)

    # -- captured draft steps (model.compile: auto) ------------------------------------------------------
    def _factory(self, ctx: SpecContext) -> Any:
        """The graph factory when the target's verify steps are captured (and no capture here failed)."""
        runner = ctx.method.runner
        return runner.capture if runner.captures and not self._capture_refused else None

    def _keep_root(self, ctx: SpecContext, slots: torch.Tensor) -> torch.Tensor:
        """The root slots [K, d]; under captured steps in one fixed buffer (what a captured proposal reads)."""
        if self._factory(ctx) is None:
            return slots
        if self._root is None or self._root.shape != slots.shape or self._root.device != slots.device:
            self._root = torch.empty_like(slots)
            self._meta = torch.zeros(2, dtype=torch.long, device=slots.device)
            self._graphs.clear()  # they read the old buffers
        return self._root.copy_(slots)

    def _captured(self, ctx: SpecContext, factory: Any, key: tuple, make: Any, load: Any) -> torch.Tensor:
        """The draft step ``key`` replayed, or run and captured (:meth:`LMRunner.replay_or_capture`, in this
        drafter's own store: its graphs read the draft's buffers, not the target cache's). A capture that
        raises leaves this drafter's steps eager from then on (one log line); without a ``factory`` (after such a
        failure, within a cycle on the device) the step's function runs eagerly."""
        if factory is None:
            return make()[1]()

        def failed(exc: Exception) -> None:
            self._capture_refused = True
            logger.info("%s: draft steps run without a captured graph (%s: %s)", self.kind, type(exc).__name__, exc)

        return ctx.method.runner.replay_or_capture(self._graphs, key, factory, make, load, failed)

    def _accept_captured(self, ctx: SpecContext, factory: Any, toks: list[int], hidden: torch.Tensor) -> None:
        """:meth:`accept` as the captured accept step (:meth:`_accept_graph`), its tokens and count in one copy."""
        rows, n = self.max_step_tokens(), len(toks)
        packed = torch.tensor(toks + [0] * (rows - n) + [n], device=hidden.device)  # [P + 1]

        def load(inputs: dict[str, torch.Tensor]) -> None:
            inputs["packed"].copy_(packed)
            inputs["hid"][:n] = hidden

        self._accept_graph(ctx, factory, load)
        self.accepted_on_device(ctx, n)

    def _accept_graph(self, ctx: SpecContext, factory: Any, load: Any) -> None:
        """The accept step as one captured graph: the accepted rows padded to ``max_step_tokens()`` (P); its
        inputs ``packed`` ([P + 1] long: the rows' next tokens, then the real count n) and ``hid`` ([P, d]: the
        target's hidden states), filled by ``load(inputs)``; the write slot and first position are the device
        counters ``_meta``, advanced by n inside the step; the root slots land in the fixed root buffer. The
        host's counters follow in :meth:`accepted_on_device`."""
        m, cache = self.model, self.cache
        rows = self.max_step_tokens()
        cache._ensure(cache.committed + rows)
        table = m.rope_table(self.pos + rows)
        key = ("accept", rows, cache.k.data_ptr(), cache.k.shape[1], table[0].data_ptr(), self._root.data_ptr())
        for old in [k for k in self._graphs if k[0] == "accept" and k != key]:
            del self._graphs[old]  # captured on buffers the draft has outgrown

        def make() -> tuple[dict[str, torch.Tensor], Any]:
            dev, dtype = self._root.device, m.fc.weight.dtype
            inputs = {
                "packed": torch.zeros(rows + 1, dtype=torch.long, device=dev),
                "hid": torch.zeros(rows, self._root.shape[-1], dtype=dtype, device=dev),
            }
            load(inputs)

            def run() -> torch.Tensor:
                ids, n = inputs["packed"][:rows], inputs["packed"][rows:]  # [P], [1]
                h = inputs["hid"]  # [P, d]
                x = cache.f.fc(cache.f.embed(ids).to(h.dtype), h)  # generated tokens are text rows
                pos = self._meta[1:2] + torch.arange(rows, device=h.device)  # [P]
                out = cache.append_last_static(x, pos, self._meta[0:1], n)  # [1, d]
                self._meta.add_(n)  # committed rows and the next position
                return self._root.copy_(m.slots(out[-1]))  # [K, d]

            return inputs, run

        self._captured(ctx, factory, key, make, load)

    # -- a cycle on the device (greedy, captured steps: speculative.engine) -------------------------------
    def accept_on_device(self, ctx: SpecContext, packed: torch.Tensor, hidden: torch.Tensor) -> None:
        """Launch the captured accept step from device tensors: ``packed`` [P + 1] (the accepted rows' next
        tokens, zero-padded, then their count) and ``hidden`` [P, d] (the target's hidden states of those rows,
        then any rows); the host's counters follow in :meth:`accepted_on_device` once the count is read."""
        self.cache.rollback()

        def load(inputs: dict[str, torch.Tensor]) -> None:
            inputs["packed"].copy_(packed)
            inputs["hid"].copy_(hidden)

        self._accept_graph(ctx, self._factory(ctx), load)

    def accepted_on_device(self, ctx: SpecContext, n: int) -> None:
        """The host's mirror of a captured accept step of ``n`` rows."""
        self.cache.committed += n
        self.pos += n
        self.root_slots = self._root
        self._count(ctx, forwards=1)

    # -- helpers --------------------------------------------------------------------------------------
    @staticmethod
    def _count(ctx: SpecContext, forwards: int = 0, tokens: int = 0) -> None:
        if forwards:
            ctx.extras["draft_forwards"] = ctx.extras.get("draft_forwards", 0) + forwards
        if tokens:
            ctx.extras["draft_tokens"] = ctx.extras.get("draft_tokens", 0) + tokens

    def _logp(self, feats: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.cache.f.logits(feats), dim=-1)

    @torch.inference_mode()
    def eagle2_tree(self, depth: int, top_k: int, total: int, early_stop: bool = True) -> tuple[DraftTree, int]:
        """EAGLE-2 dynamic tree (``cnets1.topK_genrate``) from the root row's feature.

        Level 1: the top-k tokens of the root's draft distribution. Then ``depth`` times: the k
        frontier nodes go through the draft in **one** forward (same position for the whole level, tree
        mask over their ancestors), each proposes its top-k children, cumulative log-probs score the
        k^2 candidates and the k best become the next frontier. Finally all candidates (k + depth k^2)
        are reranked and the ``total`` best kept. Returns the tree and the number of draft forwards.

        Expansion stops early once the best frontier score is no better than the ``total - 1``-th best
        candidate so far: cumulative log-probs never increase along a path, so no deeper candidate could
        enter the kept set and the tree is exactly the one the full expansion would keep.
        """
        cache = self.cache

        def forward(x: torch.Tensor, i: int, vis: torch.Tensor) -> torch.Tensor:
            pos = torch.full((x.shape[0],), self.pos + i, device=x.device, dtype=torch.long)
            return cache.append(x, pos, vis=vis, max_pos=self.pos + i)

        toks, scores, parents, forwards = self._eagle2_candidates(depth, top_k, total, early_stop, forward)
        cache.rollback()
        tree = select_tree(torch.cat(toks), torch.cat(scores), torch.cat(parents), max(1, total - 1))
        return tree, forwards

    def _eagle2_candidates(
        self, depth: int, top_k: int, total: int, early_stop: bool, forward: Any
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], int]:
        """:meth:`eagle2_tree`'s candidates (tokens, cumulative log-probs, parents; level order) and draft
        forwards; ``forward(x [k, d], level, vis [k, appended rows])`` runs a level through the draft. Without
        ``early_stop`` no host read and fixed shapes (what a captured proposal runs: the same kept tree)."""
        m = self.model
        f = self.cache.f
        dev = m.fc.weight.device
        k = max(1, min(top_k, m.arch.vocab_size))
        logp = self._logp(self.root_slots[0])
        score, tok = logp.topk(k)
        toks, scores, parents = [tok], [score], [torch.full((k,), -1, dtype=torch.long, device=dev)]
        front_ids = torch.arange(k, device=dev)  # candidate index of each frontier node
        front_feat = self.root_slots[0].expand(k, -1)
        n_cand = k
        vis = torch.zeros(depth * k, depth * k, dtype=torch.bool, device=dev)
        parent_rows = None
        eye = torch.eye(k, dtype=torch.bool, device=dev)
        n_keep = max(1, total - 1)
        forwards = 0
        for i in range(depth):
            if early_stop and n_cand >= n_keep and float(score[0]) <= float(torch.cat(scores).topk(n_keep).values[-1]):
                break  # score is sorted (topk): score[0] is the best frontier node
            r0 = i * k
            if parent_rows is not None:
                vis[r0 : r0 + k, :r0] = vis[:, :r0].index_select(0, parent_rows)
            vis[r0 : r0 + k, r0 : r0 + k] = eye
            x = f.fc(f.embed(tok).to(front_feat.dtype), front_feat)
            out = forward(x, i, vis[r0 : r0 + k, : r0 + k])  # [k, d]
            logp = self._logp(out)  # [k, V]
            s2, t2 = logp.topk(k, dim=-1)  # [k, k]
            cu = (s2 + score[:, None]).reshape(-1)
            toks.append(t2.reshape(-1))
            scores.append(cu)
            parents.append(front_ids.repeat_interleave(k))
            score, sel = cu.topk(k)
            tok = t2.reshape(-1).index_select(0, sel)
            front_ids = n_cand + sel
            front_feat = out.index_select(0, sel // k)
            parent_rows = r0 + sel // k
            n_cand += k * k
            forwards += 1
        return toks, scores, parents, forwards

    def _propose_eagle2_captured(self, ctx: SpecContext, factory: Any, depth: int, top_k: int, total: int):
        """:meth:`eagle2_tree` as one captured step: every level (no early stop: the same kept tree), its
        draft forwards over fixed buffers (:meth:`DraftCache.append_rows_static`), the rerank, the tree
        parents and the verify layout; the packed tree on the device (:func:`_packed_tree`)."""
        m, cache = self.model, self.cache
        k = max(1, min(top_k, m.arch.vocab_size))
        cache._ensure(cache.committed + depth * k)
        table = m.rope_table(self.pos + depth)
        key = ("eagle2", depth, k, total, cache.k.data_ptr(), cache.k.shape[1], table[0].data_ptr())
        key += (self._root.data_ptr(),)
        for old in [c for c in self._graphs if c[0] == "eagle2" and c != key]:
            del self._graphs[old]

        def make() -> tuple[dict[str, torch.Tensor], Any]:
            def run() -> torch.Tensor:
                # where the tree's rows go and the first level's position: the device counters
                committed, pos0 = self._meta[0:1], self._meta[1:2]

                def forward(x: torch.Tensor, i: int, vis: torch.Tensor) -> torch.Tensor:
                    pos = (pos0 + i).expand(x.shape[0])  # [k]
                    return cache.append_rows_static(x, pos, committed + i * x.shape[0], committed, vis)

                return _packed_tree(*self._eagle2_candidates(depth, k, total, False, forward)[:3], total, depth + 1)

            return {}, run

        return self._captured(ctx, factory, key, make, lambda inputs: None)


def _packed_tree(
    toks: list[torch.Tensor], scores: list[torch.Tensor], parents: list[torch.Tensor], total: int, levels: int
) -> torch.Tensor:
    """A captured proposal's output: :func:`select_tree`'s kept tokens (T), tree parents (T) and whether a node lost
    its ancestor (1), then the verify step's depths (W = ``total``) and tree mask (W x W, as 0 / 1) of the tree
    padded to W slots (:func:`tree_layout`, ``levels`` >= its depth), packed in one long tensor for one read of
    its first 2T + 1 entries (:func:`_tree_of`) or none (:meth:`DeviceTree.unpack`)."""
    keep, tree_par, orphan = _rerank(torch.cat(scores), torch.cat(parents), max(1, total - 1))
    depth, mask = tree_layout(tree_par, total, levels)  # [W], [W, W]
    nodes = torch.cat(toks).index_select(0, keep)  # [T]
    return torch.cat([nodes, tree_par, orphan.any().long()[None], depth, mask.long().reshape(-1)])


def _tree_of(packed: torch.Tensor, width: int) -> DraftTree | None:
    """A captured proposal's packed tree (:func:`_packed_tree`, ``width`` = its W) as a tree, read in one copy;
    None when a node lost its ancestor (the tree is then built eagerly)."""
    n = DeviceTree.packed_nodes(packed, width)
    host = packed[: 2 * n + 1].tolist()
    if host[-1]:
        return None
    tree = DraftTree(packed[:n].clone(), packed[n : 2 * n].clone())
    tree.__dict__["token_list"], tree.__dict__["parent_list"] = host[:n], host[n : 2 * n]
    return tree
