"""FLASH / SpecFLASH: latent-aware semi-autoregressive speculative decoding (Wang et al., arXiv 2505.12728;
code ZihuaEvan/FlashSD: ``flash/model/llama_sar.py``, ``flash/train/train_sar.py``).

Algorithm:
1. The EAGLE trunk (``fc`` over [next-token embedding; target hidden state], one Llama decoder layer,
   the target's frozen embeddings and LM head) shared with MSD (:mod:`mmfast.speculative._eagle`).
2. Latent-aware compression: learnable queries C (C x d) pool each image's N visual features,
   F = softmax(C F_V^T) F_V (no temperature, as the code), so the draft's image span is C latent rows
   (576 -> 64 by default); text rows keep ``fc([e(x_{j+1}); h_j])``. The draft's positions are its own
   row indices (the compressed sequence), as in the code.
3. Semi-autoregressive head: the layer output o is mapped by an MLP d -> 4d -> K*d (``ar_proj``) to K
   features, slot s = o + MLP(o)[s] predicting the target feature s positions ahead (K = 5): one draft
   forward yields the distributions of the next K tokens.
4. Tree (the paper and code leave it open; decided here): a *block* of K levels comes from one set of
   K slot distributions. Level 1 = top-k tokens of slot 0 under each block root; level l = the top-k
   tokens of slot l-1 under each of the k best level-(l-1) nodes (cumulative log-prob, EAGLE-2's beam:
   k^2 candidates, k continue). The first block hangs under the root and uses the root row's slots,
   computed when the accepted tokens were ingested, so ``rounds = 1`` drafts a depth-K tree with **no**
   extra draft forward. Each further round feeds the k best depth-K paths of the last block (every node
   on them, with the block root's slot l-1 as its hidden input, tree mask over ancestors) through the
   draft in one forward, and the k frontier rows' slots give the next block. All candidates are then
   reranked and ``total_tokens`` (root included) verified.
5. Lossless verification and KV rollback by the engine; training as MSD's (SmoothL1 + 0.1 soft CE,
   noise, AdamW) with the loss replicated over the K offsets (``scripts/train_drafts.py --draft flash``).

Hook points: none on the target (``needs_hidden``: the engine passes the prompt's final hidden states).

Captured steps: where the target's verify step is captured (``model.compile: auto`` on CUDA), the proposal is
one graph (every block's candidates, the further rounds' draft forwards, the rerank, tree parents and the verify
layout; read back in one copy, or left on the device in a cycle there) and the accept step another
(:meth:`EagleDrafter._accept_graph`). A further round feeds the k best paths as k * K rows in fixed shapes
(:func:`_block_rows`: a node on several paths fed once, its repeats seen by no row), the same rows and tree as
the paths' distinct nodes fed eagerly; the captured proposal has no early stop (the same kept tree, every round's
forward run).

Limits: batch 1 per sequence; trained weights for the target (``<model dir>/flash/``). Siblings in a
block share their deeper slot distributions (the semi-AR head does not see the intermediate tokens).
With an in-LLM pruner the pruned image slots have no final hidden state: they enter the pooled features
F_V (``compress_source: hidden``) as zeros (the draft was trained on unpruned prompts: its proposals change,
never the output).

Deviations (reasons):
- The pooled features F_V are the target's final hidden states at the image tokens (the released
  ``llama_sar.py`` pools ``hidden_states`` at the image span); ``compress_source: embeds`` in training
  pools the projected features instead. The code leaves the text rows *before* the image without ``fc``;
  here every text row goes through ``fc`` (the paper's description).
- The semi-AR head's attention block is the trunk's decoder layer (so it has the trunk's KV cache and
  tree mask; the code's ``LlamaSemiARHead`` is a bare causal GQA attention without KV cache or MLP),
  followed by the code's ``ar_proj`` MLP; slot outputs add the layer output as a residual (the newer
  FlashSD code has a per-slot residual gate).
- Training data are self-distilled target answers on the world's train images (FLASH self-distils its
  video data; its image data are LLaVA-Instruct dataset answers, unavailable here). Learning rate and
  schedule are scaled for a small draft trained on CPU (see ``mmfast.train.drafts``).
- ``total_tokens`` default 26 is the size of FlashSD's inference tree (``mc_sim_7b_63``: 25 drafts + root).
  On a CPU the target's tree forward is compute-bound, so the embedded model wants ~12-16 (``rounds: 1``).
- A further round is skipped when no deeper candidate could enter the kept set (exact, as MSD's).

Qwen-VL families (qwen2_vl, qwen2_5_vl, qwen3_vl): refused: its draft head is trained for
the embedded LLaVA model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..capabilities import Capabilities, Need
from ..config import opt
from ..registry import DRAFTERS
from ._eagle import EagleDrafter, _packed_tree, _tree_of, select_tree
from .tree import DeviceTree, DraftTree


@DRAFTERS.register(
    "flash",
    description="FLASH: latent-compressed visual span + semi-autoregressive K-token draft head (needs trained weights)",
)
class Flash(EagleDrafter):
    """FLASH: semi-autoregressive drafts with latent visual compression."""

    kind = "flash"
    caps = Capabilities(
        needs=frozenset({Need.ROPE_1D}),
        why={
            Need.ROPE_1D: "its draft head is trained for the embedded LLaVA model (1-D RoPE positions, LLaVA hidden "
            "states); no multimodal-RoPE draft weights"
        },
    )

    @dataclass(frozen=True)
    class Config:
        weights: str | None = opt(
            None, doc="draft directory (model.safetensors + config.json); default <model dir>/flash"
        )
        top_k: int = opt(10, lo=1, hi=64, doc="tokens per slot expanded and paths continued per level")
        rounds: int = opt(1, lo=1, hi=4, doc="semi-AR blocks of K levels per tree (rounds - 1 extra draft forwards)")
        total_tokens: int = opt(26, lo=2, hi=1024, doc="tokens verified per cycle, root included; FlashSD's tree: 26")

    def propose(self, ctx, root: int) -> DraftTree:
        cfg = self.config
        factory = self._factory(ctx)
        tree = None
        if factory is not None and self._root is not None:  # fixed shapes: one captured step
            tree = _tree_of(self._propose_captured(ctx, factory), cfg.total_tokens)
            if tree is not None:
                self._count(ctx, forwards=cfg.rounds - 1)
        if tree is None:
            tree, forwards = self.sar_tree(cfg.rounds, cfg.top_k, cfg.total_tokens)
            self._count(ctx, forwards=forwards)
        self._count(ctx, tokens=tree.n)
        return tree

    def _propose_captured(self, ctx, factory) -> torch.Tensor:
        """The tree as one captured step over the fixed root buffer: every block's candidates (no early stop: the
        same kept tree), the further rounds' draft forwards on the draft's fixed buffers
        (:meth:`DraftCache.append_rows_static`, slots and positions from the device counters), the rerank, the tree
        parents and the verify layout, packed on the device (:func:`_packed_tree`)."""
        cfg, m, cache = self.config, self.model, self.cache
        k = max(1, min(cfg.top_k, m.arch.vocab_size))
        big_k, rounds, total = m.n_slots, cfg.rounds, cfg.total_tokens
        key: tuple = ("sar", rounds, k, total, self._root.data_ptr())
        if rounds > 1:  # its forwards read the draft's cache and rope table
            cache._ensure(cache.committed + (rounds - 1) * k * big_k)
            table = m.rope_table(self.pos + rounds * big_k)
            key += (cache.k.data_ptr(), cache.k.shape[1], table[0].data_ptr())
            for old in [c for c in self._graphs if c[0] == "sar" and c != key]:
                del self._graphs[old]  # captured on buffers the draft has outgrown

        def make():
            def run() -> torch.Tensor:
                committed, pos0 = self._meta[0:1], self._meta[1:2]  # the device counters

                def feed(x, rel, vis, query, last):
                    start = committed + vis.shape[1] - x.shape[0]  # after the proposal's earlier rows
                    return cache.append_rows_static(x, pos0 + rel, start, committed, vis).index_select(0, query)

                cands = self._sar_candidates(rounds, k, total, early_stop=False, feed=feed)
                return _packed_tree(*cands[:3], total, rounds * big_k)

            return {}, run

        return self._captured(ctx, factory, key, make, lambda x: None)

    def propose_on_device(self, ctx) -> DeviceTree | None:
        cfg = self.config
        factory = self._factory(ctx)
        if factory is None or self._root is None:
            return None
        packed = self._propose_captured(ctx, factory)
        tree = DeviceTree.unpack(packed, cfg.total_tokens, cfg.rounds * self.model.n_slots)
        self._count(ctx, forwards=cfg.rounds - 1, tokens=tree.tokens.numel())
        return tree

    @torch.inference_mode()
    def sar_tree(self, rounds: int, top_k: int, total: int, early_stop: bool = True) -> tuple[DraftTree, int]:
        """Blocks of K levels from semi-AR slot distributions (see the module docstring, step 4)."""
        toks, scores, parents, forwards = self._sar_candidates(rounds, top_k, total, early_stop)
        self.cache.rollback()
        tree = select_tree(torch.cat(toks), torch.cat(scores), torch.cat(parents), max(1, total - 1))
        return tree, forwards

    def _sar_candidates(
        self, rounds: int, top_k: int, total: int, early_stop: bool, feed: Any = None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], int]:
        """Every candidate's token, cumulative log-prob and parent (level order), and the draft forwards run.
        ``feed(x [R, d], rel [R], vis [R, A], query [k], last)`` runs a block's rows through the draft (positions
        the root's + ``rel``, at most + ``last``; ``vis``: which of the proposal's A appended rows, these included,
        each row sees) and returns the ``query`` rows' outputs; by default :meth:`DraftCache.append`. Without ``early_stop``: no host read and
        fixed shapes (what a captured proposal runs: the same kept tree)."""
        m, cache = self.model, self.cache
        dev = m.fc.weight.device
        big_k = m.n_slots
        k = max(1, min(top_k, m.arch.vocab_size))
        if feed is None:

            def feed(x, rel, vis, query, last):
                return cache.append(x, self.pos + rel, vis=vis, query=query, max_pos=self.pos + last)

        toks: list[torch.Tensor] = []
        scores: list[torch.Tensor] = []
        parents: list[torch.Tensor] = []
        n_cand = 0
        f_ids = torch.full((1,), -1, dtype=torch.long, device=dev)  # block roots (candidate ids; -1 = the tree root)
        f_score = torch.zeros(1, device=dev)
        f_feats = self.root_slots[None]  # [n_f, K, d]
        f_rows = None  # [n_f] the appended row of each block root (None: the committed root)
        row_vis = torch.zeros(0, 0, dtype=torch.bool, device=dev)  # visibility among appended rows
        forwards = 0
        for r in range(rounds):
            sv, tv = self._logp(f_feats).topk(k, dim=-1)  # [n_f, K, k]
            # block root index of each beam node; None while there is one block root (the first block),
            # whose slot rows then serve every beam node
            b_root = torch.arange(f_ids.numel(), device=dev) if f_ids.numel() > 1 else None
            b_score, b_ids = f_score, f_ids
            offsets = []  # the first candidate id of each level of this block
            for lvl in range(big_k):
                if b_root is None:
                    cu = (b_score[:, None] + sv[0, lvl]).reshape(-1)  # [n_b * k]
                    t = tv[0, lvl].repeat(b_score.numel())
                else:
                    cu = (b_score[:, None] + sv[b_root, lvl]).reshape(-1)
                    t = tv[b_root, lvl].reshape(-1)
                toks.append(t)
                scores.append(cu)
                parents.append(b_ids.repeat_interleave(k))
                b_score, sel = cu.topk(min(k, cu.numel()))
                b_ids = sel + n_cand  # candidate ids of this level: n_cand + 0..n_b*k-1
                if b_root is not None:
                    b_root = b_root.repeat_interleave(k)[sel]
                offsets.append(n_cand)
                n_cand += cu.numel()
            if r == rounds - 1:
                break
            n_keep = max(1, total - 1)
            if (
                early_stop
                and n_cand >= n_keep
                and float(b_score[0]) <= float(torch.cat(scores).topk(n_keep).values[-1])
            ):
                break  # no deeper candidate could enter the kept set (see MSD's eagle2_tree)
            # feed the k best paths of this block (levels 1..K) in one forward; the frontier's slots seed the next block
            roots = torch.zeros_like(b_ids) if b_root is None else b_root  # [k] each path's block root
            block = _block_rows(parents[-big_k:], offsets, b_ids, roots, f_rows, row_vis, n_cand)
            feats = f_feats[block.root, block.level]  # [R, d] the block root's slot l: the parent's predicted feature
            x = cache.f.fc(cache.f.embed(torch.cat(toks).index_select(0, block.ids)).to(feats.dtype), feats)
            out = feed(x, r * big_k + block.level, block.vis, block.query, r * big_k + big_k - 1)  # [k, d]
            forwards += 1
            row_vis, f_rows = block.row_vis, block.query + row_vis.shape[0]
            f_ids, f_score, f_feats = b_ids, b_score, m.slots(out)
        return toks, scores, parents, forwards


@dataclass
class _BlockRows:
    """The rows fed for a block's k best paths (:func:`_block_rows`), R = k * K of them."""

    ids: torch.Tensor  # [R] candidate ids, the paths' distinct nodes in id order, then the repeated ones
    level: torch.Tensor  # [R] level in the block (0 .. K - 1)
    root: torch.Tensor  # [R] the block root (frontier index) of the row's path
    vis: torch.Tensor  # [R, P + R] bool: which appended rows (the P earlier ones, then these) each row sees
    query: torch.Tensor  # [k] the rows of the paths' last nodes (the next frontier), among these
    row_vis: torch.Tensor  # [P + R, P + R] bool: the visibility among every appended row, these included


def _block_rows(
    level_parents: list[torch.Tensor],
    offsets: list[int],
    beam: torch.Tensor,
    roots: torch.Tensor,
    root_rows: torch.Tensor | None,
    row_vis: torch.Tensor,
    n_cand: int,
) -> _BlockRows:
    """A block's k best depth-K paths as draft rows, in fixed shapes (no host read): every path's K nodes, a node
    on several paths once (its first copy; the repeats are rows no row sees, placed last), the distinct nodes in
    candidate-id order (level order); a row sees its block root's row and what that sees (``root_rows``: each
    block root's appended row; None: the committed root), the rows of its path's nodes up to its own, and itself.

    Args:
        level_parents: K tensors, level i's candidates' parent ids; ``offsets``: level i's first candidate id.
        beam: [k] the paths' last nodes (ids at level K - 1); roots: [k] their block roots.
        row_vis: [P, P] the visibility among the P rows appended before; n_cand: the candidates so far.
    """
    k, big_k, dev = beam.numel(), len(offsets), beam.device
    path = [beam]
    for i in range(big_k - 1, 0, -1):  # up the paths: each node's parent
        path.append(level_parents[i].index_select(0, path[-1] - offsets[i]))
    ids = torch.stack(path[::-1], 1)  # [k, K] path j's node at level i
    lvl = torch.arange(big_k, device=dev)
    first = (ids[:, None, :] == ids[None, :, :]).long().argmax(1)  # [k, K] the first path holding that node
    canon = (first * big_k + lvl).reshape(-1)  # [R] the slot (j * K + i) of each node's first copy
    slot = torch.arange(k * big_k, device=dev)
    repeat = canon != slot  # [R]
    order = torch.sort(torch.where(repeat, n_cand + slot, ids.reshape(-1))).indices  # [R] row -> slot
    row_of = torch.empty_like(order).index_copy_(0, order, slot)  # [R] slot -> row
    path_of, lvl_of = slot // big_k, slot % big_k  # [R]
    # a slot sees its path's slots at its level and above, each as its node's first copy's row
    sees = (path_of[:, None] == path_of[None, :]) & (lvl_of[None, :] <= lvl_of[:, None])  # [R, R] slot x slot
    onehot = row_of.index_select(0, canon)[:, None] == slot[None, :]  # [R, R] slot -> its first copy's row
    new = (sees.float() @ onehot.float() > 0).index_select(0, order)  # [R, R] row x row
    n_prev = row_vis.shape[0]
    if root_rows is None:
        before = new.new_zeros(k * big_k, n_prev)
    else:  # the block root's row and what it sees
        before = row_vis.index_select(0, root_rows.index_select(0, roots)).repeat_interleave(big_k, 0)
        before = before.index_select(0, order)  # [R, P]
    vis = torch.cat([before, new], 1)  # [R, P + R]
    top = torch.cat([row_vis, row_vis.new_zeros(n_prev, k * big_k)], 1)
    return _BlockRows(
        ids.reshape(-1).index_select(0, order),
        lvl_of.index_select(0, order),
        roots.repeat_interleave(big_k).index_select(0, order),
        vis,
        row_of.index_select(0, slot.view(k, big_k)[:, -1]),
        torch.cat([top, vis]),
    )
