"""CDPruner (Zhang et al., "Beyond Attention or Similarity: Maximizing Conditional Diversity for Token
Pruning in MLLMs", arXiv 2506.10967; code Theia-4869/CDPruner, ``llava/model/llava_arch.py`` and
``llava/model/multimodal_encoder/clip_encoder.py``).

Algorithm (per image, before the LLM; T = tokens kept):

1. Similarity: S = cosine similarity of the image's *projected* tokens ([N, N], fp32).
2. Relevance: r_i = mean_m cos(v_i, t_m) of each token with the instruction embedding(s) t_m,
   min-max normalised: r = (r - min r + 1e-6) / (max r - min r). Optional theta weighting (the
   paper's, commented out in the release): r = exp(alpha r), alpha = theta / (2 (1 - theta)).
3. Kernel of the conditional DPP: L = diag(r) S diag(r).
4. Fast greedy MAP inference (Chen et al. 2018), T steps: pick j = argmax d_j^2 (d^2 starts at
   diag L); e = (L[j, :] - sum_{t < i} c_t[j] c_t) / sqrt(d_j^2); c_i = e; d^2 -= e^2; d_j^2 = -inf.
5. Keep the T picked tokens in their original order; drop the rest before the LLM.

Relevance, and the deviation it forces: the release embeds the instruction with CLIP's text tower
(``CLIPTextModelWithProjection``; the tokenised text zero-padded to a multiple of 77 tokens, one pooled
embedding per 77-token segment) and the image tokens with the vision tower's ``post_layernorm`` +
``visual_projection`` on the selected-layer features, then *negates* the cosine (relevance = -cos; the
authors observed this inversion only for LLaVA's CLIP, issues #9/#14). LLaVA checkpoints ship neither
the text tower nor ``visual_projection``, and nothing may be downloaded at run time, so:

- ``clip_model: <local path>`` (the tower's paired CLIP checkpoint, e.g. a local copy of
  openai/clip-vit-large-patch14-336, loaded with ``local_files_only``): the release's relevance exactly
  (its text tower, text and visual projections and tokenizer; the LLaVA tower's own ``post_layernorm``),
  negated as the release. The directory's tokenizer must cover the text tower's vocabulary (else
  refused: transformers silently builds a 2-token CLIP tokenizer for a directory without tokenizer
  files, which gives every prompt the same embedding). A directory without tokenizer files is taken
  as the embedded model's ``clip/`` (``mmfast/tiny-world``), trained on the LLaVA tokenizer: used with
  that tokenizer when the vocabularies match (pooled at the appended ``</s>``, one segment of its
  64 positions, as it was trained), refused otherwise;
- without it (default): relevance in the LLM's input embedding space: v_i = the projected image token
  (what the LLM reads), t = the mean of the instruction's LLM token embeddings (one pooled vector, the
  analogue of CLIP's pooled text embedding); the CLIP-specific sign inversion is not applied.

``negate`` overrides the sign in either case. The instruction is the user prompt without the chat
template and without the answer-format suffix, as the release: its ``model_vqa_loader.py`` (POPE,
GQA, TextVQA, ...) removes "\\nAnswer the question using a single word or phrase." and its
``model_vqa_science.py`` "\\nAnswer with the option's letter from the given choices directly."
(``RELEASE_SUFFIXES``; mmfast removes both from every prompt, while the release's MMBench script keeps
the second). The DPP kernel, the min-max normalisation and the greedy MAP are the release's.

Other deviations: (a) the min-max normalisation is per image (the release normalises over the whole
batch of images/tiles; equal at batch 1); (b) every image of every sample is pruned on its own.

LLaVA-NeXT: every tile (the base view and each crop) gets its own DPP picking T tokens, with the
relevance min-max normalised over all tiles of the image (the release normalises over the whole batch
of tiles; the same at batch 1, as its evaluation runs). What reaches the LLM differs from the release:
mmfast keeps the model's own layout (transformers' ``pack_image_features``: the crops unpadded to the
image's aspect ratio, an ``image_newline`` after every row), packs the keep mask exactly as the
features are (a tile-token index map through ``pack_image_features``) and keeps every row separator,
so a crop's picks that fall in the padding are dropped and the separators come on top. The release
(``llava_arch.py``) replaces ``_unpad`` in ``mm_patch_merge_type`` before testing for it, so it never
unpads and adds no separators: it feeds exactly T tokens per tile, the base view first, then the crops
in the spatial raster of the full (padded) grid.

Hook points: ``vision_features`` (the projector is run here, per image, as splicing would run it);
the first stage that edits vision tokens (``needs_full_grid``: NeXT's tiles must be whole).
Positions: kept tokens spliced contiguously (as the release). No-op: ``keep`` >= the tokens of an
image leaves the vision batch untouched (the release's default of 576 selects every token).

Budget (``budget: {tokens: B}``, vision tokens per image at the LLM input): ``keep`` = B (exact; the
release's ``visual_token_num``). LLaVA-NeXT: ``keep`` counts per tile (the release's README: "32 * 5 =
160"), so a budget sets keep = round(B / the most tiles an image can have, 5 for LLaVA-1.6's pinpoints);
an image with fewer tiles keeps fewer, picks in the unpadded-away margin are dropped and the kept
row separators come on top (approximate).
Qwen-VL families (qwen2_vl, qwen2_5_vl, qwen3_vl): the release reports Qwen2.5-VL results but ships
LLaVA code only; the published Qwen port is OpenVINO GenAI's (openvinotoolkit/openvino.genai @da1db86,
``src/cpp/src/visual_language/cdpruner/`` and ``vision_token_pruning_processor.cpp``; Qwen2-VL,
Qwen2.5-VL, Qwen3-VL). What it does, and mmfast with it: the candidates are an image's merged tokens
(the PatchMerger's output, the LLM-input embeddings: the adapter's ``project``), one DPP per image
(``enable_frame_chunking``); relevance = mean cosine of each token with the *mean LLM input embedding*
of the prompt's text tokens (``extract_text_features``), not negated (``use_negative_relevance`` is
for CLIP models only), min-max normalised; kernel diag(r) S diag(r) with S the tokens' cosine
similarity, greedy MAP: this is mmfast's LLM-embedding default above, so no CLIP tower is needed.
Deviations from that port: (a) the text is the instruction (the user prompt, answer-format suffix
removed, as the release) where the port averages every token outside the vision spans, chat template
and system prompt included; (b) the DPP runs on the whole image, the release's rule, where the port
by default (``CDPRUNER_SPLIT_THRESHOLD`` = 1) splits the tokens into two halves and picks half of T
in each (its documentation: "not semantically equivalent"; ``CDPRUNER_SPLIT_THRESHOLD=0`` gives the
whole-kernel rule); (c) ``theta`` defaults to off (the release) where the port's ``relevance_weight``
defaults to 0.5 (set ``theta: 0.5`` for its exp(0.5 r) weighting); (d) min-max with the release's
+1e-6 in the numerator (the port: none, and a range below 1e-6 counts as 1); (e) positions: kept
tokens keep their grid cells' (t, h, w) ids and the text after the image keeps its unpruned ids
(mmfast's pre-LLM rule, docs/methods.md), where the port starts the text after the image at the
largest kept id + 1. Qwen3-VL's deepstack rows follow the kept tokens. Budget under dynamic
resolution: ``ratio`` (the port's ``pruning_ratio`` is the fraction pruned, T = round(N (1 - p)));
``budget: {tokens: B}`` sets ``keep`` = B, so every image keeps B of its own tokens (a ``ratio`` budget,
whose target differs per image, is refused: give ``params.ratio``).
Families: llava, llava_next and the Qwen-VL families. Refused where anyres tiles are downscaled across
tiles (llava_onevision; ``caps.needs``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch

from ..capabilities import Capabilities, Need
from ..config import opt
from ..errors import ConfigError
from ..registry import PRUNERS
from ._clip_text import load_clip_text
from ._grid import per_sample
from .base import Pruner
from .divprune import select_image_rows


def relevance(
    image: torch.Tensor, text: torch.Tensor, *, negate: bool = False, theta: float | None = None
) -> torch.Tensor:
    """[N] fp32: mean cosine of each image embedding [N, D] with the instruction embeddings [M, D]
    (negated if ``negate``), min-max normalised, then exp(alpha r) when ``theta`` is set."""
    v = image.float() / image.float().norm(dim=-1, keepdim=True)
    t = text.float() / text.float().norm(dim=-1, keepdim=True)
    rel = v @ t.T  # [N, M]
    rel = (-rel if negate else rel).mean(-1)  # [N]
    rel = (rel - rel.min() + 1e-6) / (rel.max() - rel.min())
    if theta is not None:
        rel = torch.exp(theta / (2 * (1 - theta)) * rel)
    return rel


def dpp_kernel(tokens: torch.Tensor, rel: torch.Tensor) -> torch.Tensor:
    """L = diag(r) S diag(r) [N, N] fp32, S the cosine similarity of the tokens [N, d], r [N]."""
    x = tokens.float()
    x = x / x.norm(dim=-1, keepdim=True)
    return rel[:, None] * (x @ x.T) * rel[None, :]


def greedy_map(kernel: torch.Tensor, k: int) -> torch.Tensor:
    """Fast greedy MAP inference of a DPP with kernel [N, N]: [k] indices in pick order."""
    n = kernel.shape[0]
    k = min(k, n)
    cis = torch.zeros(k, n, dtype=kernel.dtype, device=kernel.device)  # [k, N]
    di2s = kernel.diagonal().clone()  # [N]
    picks = []
    for i in range(k):  # each pick stays on the device (indexing with a 0-d tensor would sync per pick)
        j = di2s.argmax(dim=0, keepdim=True)  # [1]
        picks.append(j)
        row = kernel.index_select(0, j)  # [1, N]
        if i > 0:  # c_j^T C: [1, i] @ [i, N] (the first pick subtracts nothing)
            row = row - cis[:i].index_select(1, j)[:, 0].unsqueeze(0) @ cis[:i]
        eis = row[0] / di2s.index_select(0, j).sqrt()  # [N]
        cis[i] = eis
        di2s = di2s - eis.square()
        di2s.index_fill_(0, j, -math.inf)
    return torch.cat(picks) if picks else torch.empty(0, dtype=torch.long, device=kernel.device)


def dpp_picks(tokens: torch.Tensor, rel: torch.Tensor, k: int) -> torch.Tensor:
    """[k] picks (in pick order) of the DPP with kernel diag(rel) S diag(rel) over ``tokens`` [N, d]."""
    return greedy_map(dpp_kernel(tokens, rel), k)


def dpp_rows(
    tokens: torch.Tensor, image: torch.Tensor, text: torch.Tensor, k: int, negate: bool, theta: float | None
) -> torch.Tensor:
    """[k] rows of ``tokens`` [N, d] that CDPruner keeps, in their original order: relevance of ``image`` [N, D]
    to ``text`` [M, D], the kernel, the greedy MAP (one captured graph where the session captures:
    ``MethodContext.captured``; the 64-pick loop is ~770 kernels launched one by one otherwise)."""
    return dpp_picks(tokens, relevance(image, text, negate=negate, theta=theta), k).sort().values


def max_tiles(adapter) -> int:
    """The most tiles (base view + crops) LLaVA-NeXT cuts an image into: 1 + the largest pinpoint grid."""
    cfg = adapter.model.config
    size = int(cfg.vision_config.image_size)
    return 1 + max((h // size) * (w // size) for h, w in cfg.image_grid_pinpoints)


#: The answer-format suffixes the release removes from the relevance text (``model_vqa_loader.py``:
#: POPE, GQA, TextVQA, VQAv2, VizWiz, MME; ``model_vqa_science.py``: ScienceQA), exactly as written
#: there, leading newline included.
RELEASE_SUFFIXES = (
    "\nAnswer the question using a single word or phrase.",
    "\nAnswer with the option's letter from the given choices directly.",
)


def instruction_text(prompt: str) -> str:
    """The relevance text: the user prompt without the answer-format suffixes the release strips."""
    for suffix in RELEASE_SUFFIXES:
        prompt = prompt.replace(suffix, "")
    return prompt


@PRUNERS.register(
    "cdpruner", description="CDPruner: conditional DPP (instruction relevance x token similarity), greedy MAP"
)
class CDPruner(Pruner):
    """CDPruner."""

    hook_points = frozenset({"vision_features"})
    # NeXT: the per-tile selection needs every tile whole, so it runs as the first vision-token edit
    caps = Capabilities(
        needs=frozenset({Need.WHOLE_TILES}),
        why={
            Need.WHOLE_TILES: "its per-tile DPP follows LLaVA-NeXT's whole tiles; a mosaic downscaled across tiles "
            "is a layout neither the release (LLaVA) nor OpenVINO GenAI's port (Qwen-VL only) covers"
        },
        edits_features=True,
        needs_full_grid=True,
    )

    @dataclass(frozen=True)
    class Config:
        keep: int = opt(64, lo=0, doc="T: tokens kept per image (release visual_token_num)")
        ratio: float | None = opt(
            None, lo=0.0, hi=1.0, doc="T = round(ratio N_i) per image (overrides keep; not on LLaVA-NeXT's tiles)"
        )
        theta: float | None = opt(
            None, lo=0.0, hi=0.99, doc="relevance weight: r = exp(theta / (2 (1 - theta)) r); None: off (release)"
        )
        negate: bool | None = opt(
            None, doc="relevance = -cos (None: the release's sign with clip_model, none with LLM embeddings)"
        )
        clip_model: str | None = opt(
            None, doc="local path of the tower's paired CLIP model (text tower, projections, tokenizer)"
        )

    budget_knobs = ("keep", "ratio")  # ratio overrides keep: a budget with it would be ignored
    budget_per_image = False  # LLaVA-NeXT: a per-tile count from a tokens budget, the same for every image

    @classmethod
    def noop_params(cls, adapter):
        if adapter.features.tiles != "anyres":  # every image keeps all its tokens, whatever its count
            return {"ratio": 1.0}
        rows, cols = adapter.grid
        return {"keep": rows * cols}

    @classmethod
    def budget_params(cls, tokens, n, adapter, config, path):
        """keep = B per image (LLaVA-NeXT: per tile, B / the most tiles an image can have; module docstring)."""
        if adapter.features.tiles != "anyres":
            return {"keep": tokens}
        return {"keep": max(1, round(tokens / max_tiles(adapter)))}

    @classmethod
    def check_facts(cls, config, facts) -> None:
        """``ratio`` needs whole images as candidates (LLaVA-NeXT picks T per tile: ``keep``);
        ``clip_model`` needs a CLIP vision tower (not Qwen-VL)."""
        if config.ratio is not None and facts.features.tiles == "anyres":
            raise ConfigError(
                "ratio", f"{facts.family} keeps T tokens per anyres tile, as the release; give keep instead"
            )
        if config.clip_model is not None and not facts.features.paired_text_tower:
            raise ConfigError(
                "clip_model",
                f"a CLIP text tower pairs with a CLIP vision tower; {facts.family}'s tower has none: leave clip_model "
                "unset (relevance in the LLM's embedding space, as OpenVINO GenAI's Qwen port)",
            )

    def n_keep(self, n: int) -> int:
        """T for an image of ``n`` tokens: ``keep``, or round(ratio n)."""
        cfg = self.config
        return min(n, cfg.keep if cfg.ratio is None else int(round(cfg.ratio * n)))

    @classmethod
    def test_params(cls, adapter):
        return {"keep": 5}

    def install(self) -> None:
        self.clip = None
        if self.config.clip_model is not None:
            self.clip = load_clip_text(self.config.clip_model, self.ctx.device, self.ctx.dtype, self.ctx.tokenizer)

    def instruction_embeddings(self, prompt: str) -> torch.Tensor:
        """[M, D]: CLIP's pooled text embeddings per 77-token segment (``clip_model``), else [1, d]: the
        mean LLM input embedding of the instruction's tokens (module docstring); the prompt's
        answer-format suffix removed first, as the release."""
        prompt = instruction_text(prompt)
        if self.clip is not None:
            return self.clip.embed_text(prompt)
        ids = self.ctx.tokenizer(prompt, add_special_tokens=False)["input_ids"] or [self.ctx.special.pad]
        emb = self.adapter.embed_tokens(torch.tensor(ids, device=self.ctx.device))  # [M_tok, d]
        return emb.float().mean(0, keepdim=True)

    def image_embeddings(self, vision, i: int, projected: torch.Tensor) -> torch.Tensor:
        """What relevance compares with the text: CLIP image embeddings of the selected-layer features
        (``clip_model``), else the projected tokens."""
        if self.clip is None:
            return projected
        tower = self.adapter.vision_tower
        post = getattr(tower, "vision_model", tower).post_layernorm  # transformers 5 flattens CLIPVisionModel
        return self.clip.visual_projection(post(vision.features[i]).to(self.clip.visual_projection.weight.dtype))

    def negate(self) -> bool:
        return (self.clip is not None) if self.config.negate is None else self.config.negate

    def prune_vision(self, vision, batch):
        cfg = self.config
        tiled = "n_tiles" in vision.extras  # LLaVA-NeXT: T picks per tile, as the release
        rows, cols = vision.grid
        counts = vision.counts()
        if all((cfg.keep >= rows * cols) if tiled else self.n_keep(n) >= n for n in counts):
            vision.stats[self.name] = {"per_sample_kept": per_sample(counts, batch.image_owner, batch.batch_size)}
            return vision
        projected = None if tiled else self.adapter.project(vision)
        text = [self.instruction_embeddings(p) for p in batch.prompts]
        for i, n in enumerate(counts):
            t = text[batch.image_owner[i]]
            if tiled:
                self._prune_tiles(vision, i, batch.image_sizes[i], t)
                continue
            k = self.n_keep(n)
            if k >= n:
                continue
            vision.projected[i] = projected[i]
            image, neg = self.image_embeddings(vision, i, projected[i]), self.negate()
            select = partial(dpp_rows, k=k, negate=neg, theta=cfg.theta)
            rows = self.ctx.captured(("cdpruner", k, neg, cfg.theta), select, projected[i], image, t.to(image.device))
            select_image_rows(vision, i, rows)
        vision.stats[self.name] = {"per_sample_kept": per_sample(vision.counts(), batch.image_owner, batch.batch_size)}
        return vision

    def _prune_tiles(self, vision, i: int, image_size: torch.Tensor, text: torch.Tensor) -> None:
        """LLaVA-NeXT: relevance normalised over all tiles of the image, one DPP per tile (base view
        and every crop) picking T tokens (as the release); the keep mask packed (unpadded) exactly as
        the features are, every row separator kept (the release neither unpads nor adds separators;
        module docstring)."""
        rows, cols = vision.grid
        n, n_t = rows * cols, vision.extras["n_tiles"][i]
        feats = vision.features[i]  # [n_t * n, Dv]
        index = torch.arange(1, n_t * n + 1, dtype=torch.float32, device=feats.device).reshape(n_t, n, 1)
        packed, _ = self.adapter.base.pack_image_features(
            [index], image_size[None], self.adapter.select_strategy, image_newline=index.new_zeros(1)
        )
        slot = packed[0][:, 0].round().long()  # [L] tile token (1-based) behind each packed row, 0 = row separator
        if feats.shape[0] != n_t * n or vision.projected[i].shape[0] != slot.numel():
            raise ValueError(
                "cdpruner needs every image's full tiles on LLaVA-NeXT; put it first among the feature stages"
            )
        tiles = self.adapter.projector(feats.reshape(n_t, n, -1))  # [n_t, n, d]
        emb = tiles.reshape(n_t * n, -1) if self.clip is None else self.image_embeddings(vision, i, None)
        rel = relevance(emb, text.to(feats.device), negate=self.negate(), theta=self.config.theta).reshape(n_t, n)
        mask = torch.zeros(n_t, n, dtype=torch.bool, device=feats.device)
        pick = partial(dpp_picks, k=self.config.keep)
        for t in range(n_t):
            mask[t, self.ctx.captured(("cdpruner.tile", self.config.keep), pick, tiles[t], rel[t])] = True
        keep = (slot == 0) | mask.flatten()[(slot - 1).clamp(min=0)]  # [L]
        select_image_rows(vision, i, keep.nonzero().squeeze(1).to(vision.projected[i].device))
