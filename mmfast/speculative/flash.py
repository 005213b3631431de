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

Captured steps: where the target's verify step is captured (``model.compile: auto`` on CUDA), the one-block
proposal (``rounds: 1``) is one graph (candidates, rerank, tree parents and the verify layout; read back in one
copy, or left on the device in a greedy cycle) and the accept step another (:meth:`EagleDrafter._accept_graph`);
``rounds`` > 1 proposes eagerly.

Limits: batch 1 per sequence; trained weights for the target (``<model dir>/flash/``). Siblings in a
block share their deeper slot distributions (the semi-AR head does not see the intermediate tokens).

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
        if factory is not None and cfg.rounds == 1 and self._root is not None:  # one block: fixed shapes
            tree = _tree_of(self._propose_captured(ctx, factory, cfg.top_k, cfg.total_tokens), cfg.total_tokens)
        if tree is None:
            tree, forwards = self.sar_tree(cfg.rounds, cfg.top_k, cfg.total_tokens)
            self._count(ctx, forwards=forwards)
        self._count(ctx, tokens=tree.n)
        return tree

    def _propose_captured(self, ctx, factory, top_k: int, total: int) -> torch.Tensor:
        """The one-block tree (``rounds: 1``) as one captured step over the fixed root buffer: candidates,
        rerank, tree parents and the verify layout in the graph, packed on the device (:func:`_packed_tree`)."""
        k = max(1, min(top_k, self.model.arch.vocab_size))
        levels = self.model.n_slots  # one block: K levels

        def make():
            def run() -> torch.Tensor:
                return _packed_tree(*self._sar_candidates(1, k, total, early_stop=False)[:3], total, levels)

            return {}, run

        return self._captured(ctx, factory, ("sar", k, total, self._root.data_ptr()), make, lambda x: None)

    def propose_on_device(self, ctx) -> DeviceTree | None:
        cfg = self.config
        factory = self._factory(ctx)
        if factory is None or cfg.rounds != 1 or self._root is None:
            return None
        packed = self._propose_captured(ctx, factory, cfg.top_k, cfg.total_tokens)
        tree = DeviceTree.unpack(packed, cfg.total_tokens, self.model.n_slots)
        self._count(ctx, tokens=tree.tokens.numel())
        return tree

    @torch.inference_mode()
    def sar_tree(self, rounds: int, top_k: int, total: int, early_stop: bool = True) -> tuple[DraftTree, int]:
        """Blocks of K levels from semi-AR slot distributions (see the module docstring, step 4)."""
        toks, scores, parents, forwards = self._sar_candidates(rounds, top_k, total, early_stop)
        self.cache.rollback()
        tree = select_tree(torch.cat(toks), torch.cat(scores), torch.cat(parents), max(1, total - 1))
        return tree, forwards

    def _sar_candidates(
        self, rounds: int, top_k: int, total: int, early_stop: bool
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], int]:
        """Every candidate's token, cumulative log-prob and parent (level order), and the draft forwards run.
        With ``rounds: 1`` no host read and fixed shapes (what a captured proposal runs)."""
        m, cache = self.model, self.cache
        dev = m.fc.weight.device
        big_k = m.n_slots
        k = max(1, min(top_k, m.arch.vocab_size))
        toks: list[torch.Tensor] = []
        scores: list[torch.Tensor] = []
        parents: list[torch.Tensor] = []
        par_host: list[int] = []  # parents on the host, to trace paths when feeding a block
        tok_host: list[int] = []
        n_cand = 0
        f_ids = torch.full((1,), -1, dtype=torch.long, device=dev)  # block roots (candidate ids; -1 = the tree root)
        f_score = torch.zeros(1, device=dev)
        f_feats = self.root_slots[None]  # [n_f, K, d]
        f_rows: list[int] = [-1]  # appended draft row of each block root (-1: committed)
        row_vis = torch.zeros(0, 0, dtype=torch.bool, device=dev)  # visibility among appended rows
        forwards = 0
        for r in range(rounds):
            sv, tv = self._logp(f_feats).topk(k, dim=-1)  # [n_f, K, k]
            # block root index of each beam node; None while there is one block root (the first block),
            # whose slot rows then serve every beam node
            b_root = torch.arange(f_ids.numel(), device=dev) if f_ids.numel() > 1 else None
            b_score, b_ids = f_score, f_ids
            block_start = n_cand  # the first candidate id of this block (for tracing)
            for lvl in range(big_k):
                if b_root is None:
                    cu = (b_score[:, None] + sv[0, lvl]).reshape(-1)  # [n_b * k]
                    t = tv[0, lvl].repeat(b_score.numel())
                else:
                    cu = (b_score[:, None] + sv[b_root, lvl]).reshape(-1)
                    t = tv[b_root, lvl].reshape(-1)
                par = b_ids.repeat_interleave(k)
                toks.append(t)
                scores.append(cu)
                parents.append(par)
                if r < rounds - 1:
                    tok_host += t.tolist()
                    par_host += par.tolist()
                b_score, sel = cu.topk(min(k, cu.numel()))
                b_ids = sel + n_cand  # candidate ids of this level: n_cand + 0..n_b*k-1
                if b_root is not None:
                    b_root = b_root.repeat_interleave(k)[sel]
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
            beam = b_ids.tolist()
            nodes: dict[int, int] = {}  # candidate id -> block level (1..K)
            root_of: dict[int, int] = {}
            for c, fr in zip(beam, [0] * len(beam) if b_root is None else b_root.tolist()):
                chain = []
                while c >= block_start:
                    chain.append(c)
                    c = par_host[c]
                for lvl, node in enumerate(reversed(chain), start=1):
                    nodes[node] = lvl
                    root_of[node] = fr
            order = sorted(nodes)  # level order (ids grow with level)
            q = len(order)
            n_prev = row_vis.shape[0]
            vis = torch.zeros(n_prev + q, n_prev + q, dtype=torch.bool, device=dev)
            vis[:n_prev, :n_prev] = row_vis
            row_of = {}
            for i, c in enumerate(order):
                p = par_host[c]
                prow = row_of.get(p, f_rows[root_of[c]] if nodes[c] == 1 else None)
                if prow is not None and prow >= 0:
                    vis[n_prev + i] = vis[prow]
                vis[n_prev + i, n_prev + i] = True
                row_of[c] = n_prev + i
            lvl_t = torch.tensor([nodes[c] for c in order], device=dev)
            fr_t = torch.tensor([root_of[c] for c in order], device=dev)
            feats = f_feats[fr_t, lvl_t - 1]  # the block root's slot l-1: the parent's predicted feature
            tok_t = torch.tensor([tok_host[c] for c in order], device=dev)
            x = cache.f.fc(cache.f.embed(tok_t).to(feats.dtype), feats)
            pos = self.pos - 1 + r * big_k + lvl_t
            query = torch.tensor([row_of[c] - n_prev for c in beam], device=dev)
            out = cache.append(x, pos, vis=vis[n_prev:], query=query, max_pos=self.pos - 1 + (r + 1) * big_k)
            forwards += 1
            row_vis = vis
            f_rows = [row_of[c] for c in beam]
            f_ids, f_score, f_feats = b_ids, b_score, m.slots(out)
        return toks, scores, parents, forwards
