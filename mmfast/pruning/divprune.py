"""DivPrune (Alvar et al., "DivPrune: Diversity-based Visual Token Pruning for Large Multimodal Models",
CVPR 2025, arXiv 2503.02175; code vbdi/divprune, ``LLaVA/llava/model/llava_arch.py``).

Algorithm (per image, on the *projected* visual tokens, i.e. the LLM-input embeddings the release
reads from ``new_input_embeds`` after the projector, before the first LLM layer):

1. D = 1 - cos(x_i, x_j) over the image's N tokens ([N, N], pairwise cosine distance).
2. First token: the one farthest from its nearest neighbour: argmax_j of the second-smallest
   entry of column j (the smallest is the token's distance to itself).
3. Then, K - 1 times: add argmax_j min_{s in S} D[s, j] (greedy max-min / farthest-point selection;
   a selected token has distance 0 to itself, so it is never picked again).
4. Keep the K selected tokens in their original order; drop the rest before the LLM.

K = round(ratio * N) (the release's ``SUBSET_RATIO``, 0.098 in its scripts), or ``keep`` tokens.

LLaVA-NeXT: the release takes the packed image sequence of LLaVA-1.6 (base view, unpadded tiles and
the ``image_newline`` row separators, ``image_features[0]``) as the candidate set, so row-separator
tokens are selected or dropped like any other token; mmfast does the same on ``VisionBatch.projected``.

Hook points: ``vision_features`` only (the LLaVA projector is run here, per image, exactly as the
splicing step would run it; the projected rows then travel in ``VisionBatch.projected``). The
distance matrix and the 64-pick loop run as one captured graph where the session captures
(``MethodContext.captured``; ~190 kernels launched one by one otherwise).
Positions: the kept tokens are spliced contiguously (the release drops them from ``inputs_embeds``
with ``position_ids`` None, so positions are renumbered too).

Deviations from the release: (a) the distance matrix and the selection run in fp32 (the release runs
them in the model dtype, fp16); (b) every image of every sample is pruned on its own (the release
prunes sample 0's single image, at a hard-coded offset of 35 system-prompt tokens); (c) ties in the
argmax go to the lowest index (torch's documented rule; the release uses the same call), and scores within
``TIE_DISTANCE`` (1e-5) of the largest are ties: exact duplicates (a flat region, LLaVA-NeXT's tile that
equals its base view, its newline rows) have equal scores in exact arithmetic, and the release picks among
them by the last bits of its rounding, which differ between a batch and one image (NeXT's tower: 5e-7) and
on a GPU; (d) a token is never picked twice: when every token left duplicates a picked one (all scores 0)
the release picks index 0 again and repeats a token in the LLM input, mmfast takes the lowest unpicked.
No-op: ``ratio`` 1 (or ``keep`` >= the tokens of an image) leaves the vision batch untouched.

Budget (``budget: {tokens: B}`` or ``{ratio: r}``, vision tokens per image at the LLM input):
``keep`` = the image's target (B, or round(r N_i)), exact, on every family.
Families: all six. LLaVA-OneVision: the candidates are an image's packed anyres-max tokens (base view,
downscaled mosaic, newlines), as on LLaVA-NeXT. Qwen-VL families: the candidates are an image's merged
tokens (the PatchMerger's output, the adapter's ``project``); kept tokens keep their grid cells' 3-D
ids (pre-LLM rule of docs/methods.md), Qwen3-VL's deepstack rows follow them. The release has no code
for either (LLaVA).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from ..capabilities import Capabilities
from ..config import opt
from ..registry import PRUNERS
from ._grid import per_sample
from .base import Pruner


def cosine_distance(x: torch.Tensor) -> torch.Tensor:
    """[N, N] fp32 ``1 - cos`` between the rows of ``x`` [N, D] (the release's pairwise matrix)."""
    x = x.float()
    x = x / x.norm(dim=1, keepdim=True)
    return 1.0 - x @ x.T


#: scores within this of the largest are ties, which go to the lowest index (deviation (c))
TIE_DISTANCE = 1e-5


def _first_max(scores: torch.Tensor) -> torch.Tensor:
    """[1] the lowest index whose score in ``scores`` [1, N] is within ``TIE_DISTANCE`` of the largest."""
    top = scores.amax(dim=1, keepdim=True)  # [1, 1]
    return (scores >= top - TIE_DISTANCE).to(torch.uint8).argmax(dim=1)  # argmax: the first of equal maxima


def max_min_select(dist: torch.Tensor, k: int) -> torch.Tensor:
    """DivPrune's greedy max-min selection on a distance matrix [N, N]: [k] distinct indices in pick order."""
    n = dist.shape[0]
    k = min(k, n)
    if k == 0:
        return torch.empty(0, dtype=torch.long, device=dist.device)
    if n == 1:
        return torch.zeros(1, dtype=torch.long, device=dist.device)
    # first: the token whose nearest other token is farthest (2nd smallest of its column)
    nearest = dist.topk(2, dim=0, largest=False).values[1:2]  # [1, N]
    # every pick stays on the device: indexing with a picked 0-d tensor would read it to the host (one
    # sync per pick, serialising the loop on a GPU; DivPrune-64 on the H200 had a TTFT of 47.6 ms against 40.6
    # unpruned while its LLM prefill took 11.8 against 22.3 ms)
    picks = [_first_max(nearest)]  # [1] each
    closest = dist.index_select(0, picks[0])  # [1, N] min distance of every token to the selected set
    for _ in range(1, k):
        closest.index_fill_(1, picks[-1], -1.0)  # a picked token is never picked again (distances are >= 0)
        j = _first_max(closest)  # [1]
        picks.append(j)
        torch.minimum(closest, dist.index_select(0, j), out=closest)
    return torch.cat(picks)


def diverse_rows(tokens: torch.Tensor, k: int) -> torch.Tensor:
    """[k] rows of ``tokens`` [N, d] that DivPrune keeps, in their original order (one captured graph where the
    session captures: ``MethodContext.captured``)."""
    return max_min_select(cosine_distance(tokens), k).sort().values


def select_image_rows(vision, i: int, rows: torch.Tensor) -> None:
    """Keep rows ``rows`` of image ``i``'s LLM-input tokens (projected rows, patch ids, tags; the
    pre-projection features too when they are row-aligned: not LLaVA-NeXT's per-tile features, which
    the adapter marks with ``extras["n_tiles"]``, nor tokens an earlier stage built itself)."""
    aligned = "n_tiles" not in vision.extras and vision.features[i].shape[0] == vision.projected[i].shape[0]
    vision.projected[i] = vision.projected[i][rows]
    if aligned:
        vision.features[i] = vision.features[i][rows.to(vision.features[i].device)]
    vision.patch_ids[i] = vision.patch_ids[i][rows.to(vision.patch_ids[i].device)]
    for tags in vision.tags.values():
        tags[i] = tags[i][rows.to(tags[i].device)]


@PRUNERS.register(
    "divprune", description="DivPrune: max-min diversity (farthest-point) selection of projected image tokens"
)
class DivPrune(Pruner):
    """DivPrune."""

    hook_points = frozenset({"vision_features"})
    # the candidate set is the image's LLM-input tokens, whatever their layout (NeXT: tiles + newlines)
    caps = Capabilities(edits_features=True)

    @dataclass(frozen=True)
    class Config:
        ratio: float = opt(0.098, lo=0.0, hi=1.0, doc="fraction of each image's tokens kept (release SUBSET_RATIO)")
        keep: int | None = opt(None, lo=0, doc="tokens kept per image (overrides ratio)")

    budget_knobs = ("keep", "ratio")

    @classmethod
    def noop_params(cls, adapter):
        return {"ratio": 1.0}

    @classmethod
    def budget_params(cls, tokens, n, adapter, config, path):
        """keep = the image's target (module docstring)."""
        return {"keep": tokens}

    @classmethod
    def test_params(cls, adapter):
        return {"keep": 5}

    def n_keep(self, n: int) -> int:
        cfg = self.config_for(n)
        return min(n, cfg.keep) if cfg.keep is not None else min(n, int(round(cfg.ratio * n)))

    def prune_vision(self, vision, batch):
        counts = vision.counts()
        if all(self.n_keep(n) >= n for n in counts):
            vision.stats[self.name] = {"per_sample_kept": per_sample(counts, batch.image_owner, batch.batch_size)}
            return vision
        projected = self.adapter.project(vision)  # [N_i, d] each, as splicing would compute them
        for i, n in enumerate(counts):
            k = self.n_keep(n)
            if k >= n:
                continue
            vision.projected[i] = projected[i]
            rows = self.ctx.captured(("divprune", k), partial(diverse_rows, k=k), projected[i])
            select_image_rows(vision, i, rows)
        vision.stats[self.name] = {"per_sample_kept": per_sample(vision.counts(), batch.image_owner, batch.batch_size)}
        return vision
