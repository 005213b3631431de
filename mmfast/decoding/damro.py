"""DAMRO (Gong et al., EMNLP 2024, arXiv 2410.04514): dive into the attention of the vision tower.

Algorithm: in the vision layer that produces the selected features (LLaVA's ``vision_feature_layer`` =
-2 selects the output of ``layers[22]`` of CLIP-L's 24; the release's patched ``modeling_llava.py``,
which every evaluation script loads, hooks ``q_proj`` / ``k_proj`` of
``encoder.layers[vision_feature_layer]``, that same layer), compute the CLS row of
``softmax(Q K^T / sqrt(C))`` with Q, K taken
as *one* head over the full hidden size C (the released code's approximation of the 16-head
attention); its top-k patches (k = 10) are the "outlier" tokens. An auxiliary branch feeds the LLM
only those k projected features, in descending order of that attention (the release gathers them in
``torch.topk``'s sorted order, not in raster order), the image placeholder run rebuilt to k tokens and
the prompt unchanged, and the logits are contrasted,
``(1 + alpha) l - alpha l_outlier`` (alpha = 2), with the plausibility cutoff (beta = 0.1) on the
clean branch, then sampled straight from the softmax at T = 1 (no warpers), as the released code does.
Hook points: a recorder on the feature layer's vision attention (q/k of the forward that runs anyway);
an auxiliary branch via the branch manager. Limits: the outlier branch uses the unpruned features,
so it composes with feature-stage pruning but not with merging inside the vision tower. The attention
layer is ``vision_feature_layer_index()`` (the release's HEAD, coder-gx/DAMRO @03008ac; its first
commits' LLaVA-1.5 code, since deleted, hard-coded ``layers[23]``, the layer after it).

Qwen-VL families (qwen2_vl, qwen2_5_vl, qwen3_vl): refused: contrasts against the tower's
CLS-attention outliers; Qwen-VL towers have no CLS.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..capabilities import Capabilities, Need
from ..config import opt
from ..errors import IncompatibleRecipeError
from ..hooks import attach
from ..registry import DECODERS
from .branches import Branch, BranchConfig, MultiBranchDecoder, contrastive

SCORES = "damro.cls_scores"  # VisionBatch extras: per image [N] CLS -> patch attention of the feature layer


@DECODERS.register("damro", description="DAMRO: contrast against the vision tower's CLS-attention outlier tokens")
class Damro(MultiBranchDecoder):
    """DAMRO."""

    # the outlier branch indexes one patch grid per image and reads the tower's unmerged tokens
    caps = Capabilities(
        needs=frozenset({Need.CLS, Need.UNTILED, Need.SQUARE_GRID}),
        why={
            Need.CLS: "it contrasts against the tower's CLS-attention outliers",
            Need.UNTILED: "its outlier branch indexes one square patch grid per image",
            Need.SQUARE_GRID: "its outlier branch indexes one square patch grid per image",
        },
        search="branches",
        needs_unmerged_tower=True,
    )

    @dataclass(frozen=True)
    class Config(BranchConfig):
        alpha: float = opt(2.0, lo=0.0, hi=20.0, doc="contrast weight (LLaVA: 2)")
        k: int = opt(10, lo=1, doc="outlier tokens fed to the auxiliary branch")

    def install(self) -> None:
        adapter = self.ctx.adapter
        # the layer that produces the selected features (release: encoder.layers[vision_feature_layer])
        layer = adapter.vision_feature_layer_index()
        self._pending: torch.Tensor | None = None  # set by the tower hook, moved into the VisionBatch
        attach(self.ctx.hooks, adapter.vision_layers[layer].self_attn).recorders.append(self._record)

    def _record(self, module, query, key, attention_mask, scaling) -> None:
        bsz, heads, n, d = query.shape
        q = query[:, :, 0].reshape(bsz, heads * d).float()  # [B, C] CLS query as one head
        k = key.transpose(1, 2).reshape(bsz, n, heads * d).float()  # [B, N, C]
        scores = torch.softmax(torch.einsum("bc,bnc->bn", q, k) / (heads * d) ** 0.5, dim=-1)
        self._pending = scores[:, 1:]  # [B, N-1] CLS -> patches

    def observe_tower(self, vision) -> None:
        """The tower's CLS attention travels with this encoding (per image), not on the decoder."""
        if self._pending is not None:
            vision.extras[SCORES] = list(self._pending.unbind(0))
            self._pending = None

    def branches(self, req):
        raw = req.raw_vision
        scores = raw.extras.get(SCORES) if raw is not None else None
        if scores is None or len(scores) != raw.n_images:
            raise IncompatibleRecipeError("DAMRO found no vision-tower attention for this batch")
        k = min(self.config.k, scores[0].shape[-1])
        top = torch.stack(scores).topk(k, dim=-1, sorted=True).indices  # [n_images, k] descending attention
        # the feature rows holding those patches ([n_images, k]): a "full" feature strategy leads with the CLS row
        # (patch id -1), so a patch's row is found by its id, not taken as its index
        rows = [(p[None, :] == idx[:, None]).int().argmax(-1) for p, idx in zip(raw.patch_ids, top)]
        outliers = dataclasses.replace(
            raw,
            features=[f[r] for f, r in zip(raw.features, rows)],
            patch_ids=[p[r] for p, r in zip(raw.patch_ids, rows)],
            projected=[None] * raw.n_images,
        )
        owner = req.batch.image_owner
        per_sample = [[top[i].tolist() for i, o in enumerate(owner) if o == b] for b in range(req.batch.batch_size)]
        return [Branch("outliers", self.ctx.build_inputs(req.batch, outliers), {"per_sample_outliers": per_sample})]

    def fuse(self, logits, step):
        return contrastive(logits["clean"], logits["outliers"], self.config.alpha)
