"""MSD: Multimodal Speculative Decoding with decoupled visual and text tokens (Lin et al., arXiv 2505.14260;
code Lyn-Lucy/MSD, an EAGLE-2 fork: ``EAGLE/eagle/model/cnets.py``, ``train/main_deepspeed.py``).

Algorithm:
1. An EAGLE draft (``fc`` over [next-token embedding; target hidden state] + one Llama decoder layer,
   the target's frozen embeddings and LM head) regresses the target's next final hidden state.
2. Modality decoupling: at rows whose next token is an image token the draft input is the projected
   visual embedding itself (no ``fc``; the target hidden state there is discarded); at text rows it is
   ``fc([e(x_{j+1}); h_j])``, the EAGLE shift (``cnets.py``: the ``decouple`` branch overwrites those rows).
3. Drafting: EAGLE-2's dynamic tree (``topK_genrate``): top-k children per level, the k best of the
   k^2 continue by cumulative log-prob, ``depth`` draft forwards (one per level, nodes of a level share
   a position), then all candidates reranked and ``total_tokens`` (root included) verified at once.
4. The target verifies the tree losslessly (greedy: longest argmax-matching path; sampling: EAGLE's
   point-mass sibling rule, :func:`mmfast.speculative.tree.verify`); the draft cache keeps only the
   accepted prefix and ingests the accepted tokens with the target's hidden states.
5. Training (``scripts/train_drafts.py --draft msd``): SmoothL1 feature regression + 0.1 soft CE through
   the frozen head, uniform input noise, AdamW, and MSD's two-stage curriculum (text-only, then visual
   with linearly rising probability, then all visual).

Hook points: none on the target. The engine's prefill returns all final hidden states
(``needs_hidden``); the drafter keeps its own one-layer KV cache. Positions: draft row j has position j
of the prompt (the target's positions; generated rows continue them).

Captured steps: where the target's verify step is captured (``model.compile: auto`` on CUDA), the EAGLE-2
tree is one graph (every level's draft forward on the fixed draft cache, without the early-stop read, which
keeps the same tree) and the accept step another (:class:`~mmfast.speculative._eagle.EagleDrafter`).

Limits: batch 1 per sequence (the engine serves samples one at a time); needs weights trained for the
target (``<model dir>/msd/``). With an in-LLM pruner, pruned prompt slots enter the draft with a zero
hidden state (only visual rows are normally pruned, and MSD discards their hidden states anyway).

Deviations (reasons):
- Training data are **self-distilled** target answers on the world's train images (MSD trains on
  dataset answers of ShareGPT / LLaVA-mix665k, which do not exist for the embedded model; FLASH's video
  data are self-distilled the same way). Text-only data for the curriculum's first stage are the target's
  answers to the same prompts without the image.
- ``total_tokens`` default 59 is MSD's ``EaModel.from_pretrained`` default; MSD's lmms-eval adapter
  auto-picks it from {40, 48, 50, 56, 60} by timing target forwards, which is not done here. Set it per
  model and device: on a CPU the target's tree forward is compute-bound (N tree tokens cost about
  1.2 + 0.045 N decode steps for the 256-wide embedded model), and each level is a draft forward, so the
  embedded model wants small, deep trees, e.g. ``{depth: 6, top_k: 4, total_tokens: 8}``.
- Expansion stops early when no deeper candidate could enter the kept set (exact: same tree as the
  full expansion, fewer draft forwards); inference runs the layer on fused weights (``_draft_cache.Fused``).
- ``depth`` is EAGLE-2's: the number of draft forwards after the root's, so trees have up to depth + 1
  levels (as in ``topK_genrate``).
- Learning rate and schedule are scaled for a 256-wide draft trained for ~1-2k steps on CPU (MSD: 5e-5
  with 2k warmup steps over 40 epochs of ~600k samples); see ``mmfast.train.drafts``.

Qwen-VL families (qwen2_vl, qwen2_5_vl, qwen3_vl): refused: its draft is trained for the
embedded LLaVA model.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..capabilities import Capabilities, Need
from ..config import opt
from ..registry import DRAFTERS
from ._eagle import EagleDrafter, _tree_of
from .tree import DeviceTree, DraftTree


@DRAFTERS.register(
    "msd", description="MSD: EAGLE-2 draft with decoupled visual positions (needs trained draft weights)"
)
class MSD(EagleDrafter):
    """MSD: EAGLE-2 dynamic-tree drafts with decoupled visual inputs."""

    kind = "msd"
    caps = Capabilities(
        needs=frozenset({Need.ROPE_1D}),
        why={
            Need.ROPE_1D: "its draft is trained for the embedded LLaVA model (1-D RoPE positions, LLaVA hidden "
            "states); no multimodal-RoPE draft weights"
        },
    )

    @dataclass(frozen=True)
    class Config:
        weights: str | None = opt(
            None, doc="draft directory (model.safetensors + config.json); default <model dir>/msd"
        )
        depth: int = opt(5, lo=0, hi=16, doc="EAGLE-2 depth: draft forwards per tree (tree levels = depth + 1); MSD: 5")
        top_k: int = opt(10, lo=1, hi=64, doc="children expanded per node and nodes continued per level; MSD: 10")
        total_tokens: int = opt(
            59, lo=2, hi=1024, doc="tokens verified per cycle, root included (EAGLE's total_token); MSD: 59"
        )

    def propose(self, ctx, root: int) -> DraftTree:
        cfg = self.config
        factory = self._factory(ctx)
        tree = None
        if factory is not None and self._root is not None:  # one captured step (see _propose_eagle2_captured)
            packed = self._propose_eagle2_captured(ctx, factory, cfg.depth, cfg.top_k, cfg.total_tokens)
            tree, forwards = _tree_of(packed, cfg.total_tokens), cfg.depth
        if tree is None:
            tree, forwards = self.eagle2_tree(cfg.depth, cfg.top_k, cfg.total_tokens)
        self._count(ctx, forwards=forwards, tokens=tree.n)
        return tree

    def propose_on_device(self, ctx) -> DeviceTree | None:
        cfg = self.config
        factory = self._factory(ctx)
        if factory is None or self._root is None:
            return None
        packed = self._propose_eagle2_captured(ctx, factory, cfg.depth, cfg.top_k, cfg.total_tokens)
        tree = DeviceTree.unpack(packed, cfg.total_tokens, cfg.depth + 1)
        self._count(ctx, forwards=cfg.depth, tokens=tree.tokens.numel())
        return tree
