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
  negated as the release;
- without it (default): relevance in the LLM's input embedding space: v_i = the projected image token
  (what the LLM reads), t = the mean of the instruction's LLM token embeddings (one pooled vector, the
  analogue of CLIP's pooled text embedding); the CLIP-specific sign inversion is not applied.

``negate`` overrides the sign in either case. The instruction is the user prompt without the chat
template (the release passes the bare question). The DPP kernel, the min-max normalisation and the
greedy MAP are the release's.

Other deviations: (a) the min-max normalisation is per image (the release normalises over the whole
batch of images/tiles; equal at batch 1); (b) every image of every sample is pruned on its own.
LLaVA-NeXT is refused: the release prunes each tile (the base view and every crop) to T tokens before
unpadding and always keeps the row separators, which needs the tile layout before packing; mmfast's
NeXT adapter packs tiles before feature stages run.

Hook points: ``vision_features`` (the projector is run here, per image, as splicing would run it).
Positions: kept tokens spliced contiguously (as the release). No-op: ``keep`` >= the tokens of an
image leaves the vision batch untouched (the release's default of 576 selects every token).

Budget (``budget: {tokens: B}``, vision tokens per image at the LLM input): ``keep`` = B (exact; the
release's ``visual_token_num``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..capabilities import Capabilities
from ..config import opt
from ..registry import PRUNERS
from ._grid import per_sample
from .base import Pruner
from .divprune import select_image_rows


def dpp_kernel(tokens: torch.Tensor, text: torch.Tensor, image: torch.Tensor | None = None, *,
               negate: bool = False, theta: float | None = None) -> torch.Tensor:
    """L = diag(r) S diag(r) [N, N] fp32: S from the image tokens [N, d]; r from the image embeddings
    ``image`` [N, D] (default: the tokens) against the instruction embeddings ``text`` [M, D]."""
    x = tokens.float()
    x = x / x.norm(dim=-1, keepdim=True)
    similarity = x @ x.T  # [N, N]
    v = x if image is None else image.float() / image.float().norm(dim=-1, keepdim=True)
    t = text.float()
    t = t / t.norm(dim=-1, keepdim=True)
    rel = v @ t.T  # [N, M]
    rel = (-rel if negate else rel).mean(-1)  # [N]
    rel = (rel - rel.min() + 1e-6) / (rel.max() - rel.min())
    if theta is not None:
        rel = torch.exp(theta / (2 * (1 - theta)) * rel)
    return rel[:, None] * similarity * rel[None, :]


def greedy_map(kernel: torch.Tensor, k: int) -> torch.Tensor:
    """Fast greedy MAP inference of a DPP with kernel [N, N]: [k] indices in pick order."""
    n = kernel.shape[0]
    k = min(k, n)
    cis = torch.zeros(k, n, dtype=kernel.dtype, device=kernel.device)  # [k, N]
    di2s = kernel.diagonal().clone()  # [N]
    picked = torch.empty(k, dtype=torch.long, device=kernel.device)
    for i in range(k):
        j = di2s.argmax()
        picked[i] = j
        eis = (kernel[j] - cis[:i, j] @ cis[:i]) / di2s[j].sqrt()  # [N]
        cis[i] = eis
        di2s = di2s - eis.square()
        di2s[j] = -math.inf
    return picked


class ClipText:
    """The parts of a CLIP checkpoint the release's relevance needs: text tower with projection,
    visual projection, tokenizer (loaded from a local path only)."""

    def __init__(self, model, tokenizer) -> None:
        self.text_model = model.text_model
        self.text_projection = model.text_projection
        self.visual_projection = model.visual_projection
        self.tokenizer = tokenizer
        self.width = int(model.config.text_config.max_position_embeddings)

    @torch.inference_mode()
    def embed_text(self, text: str) -> torch.Tensor:
        """[M, D] pooled, projected embeddings of the text's zero-padded 77-token segments (as the release)."""
        enc = self.tokenizer(text=text, return_tensors="pt")
        ids, mask = enc["input_ids"], enc["attention_mask"]
        pad = -ids.shape[1] % self.width
        ids = torch.cat([ids, ids.new_zeros(1, pad)], 1).reshape(-1, self.width)
        mask = torch.cat([mask, mask.new_zeros(1, pad)], 1).reshape(-1, self.width)
        dev = self.text_projection.weight.device
        pooled = self.text_model(input_ids=ids.to(dev), attention_mask=mask.to(dev)).pooler_output  # [M, H]
        return self.text_projection(pooled)


def load_clip_text(path: str, device, dtype) -> ClipText:
    from transformers import AutoTokenizer, CLIPModel

    from ..errors import ConfigError

    try:
        model = CLIPModel.from_pretrained(path, local_files_only=True, dtype=dtype).to(device).eval()
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError("clip_model", f"cannot load a CLIP model (text tower, projections, tokenizer) from {path!r}: {exc}") from None
    return ClipText(model, tokenizer)


@PRUNERS.register("cdpruner", description="CDPruner: conditional DPP (instruction relevance x token similarity), greedy MAP")
class CDPruner(Pruner):
    """CDPruner."""

    hook_points = frozenset({"vision_features"})
    caps = Capabilities(families=frozenset({"llava"}), edits_features=True)

    @dataclass(frozen=True)
    class Config:
        keep: int = opt(64, lo=0, doc="T: tokens kept per image (release visual_token_num)")
        theta: float | None = opt(None, lo=0.0, hi=0.99, doc="relevance weight: r = exp(theta / (2 (1 - theta)) r); None: off (release)")
        negate: bool | None = opt(None, doc="relevance = -cos (None: the release's sign with clip_model, none with LLM embeddings)")
        clip_model: str | None = opt(None, doc="local path of the tower's paired CLIP model (text tower, projections, tokenizer)")

    budget_knobs = ("keep",)

    @classmethod
    def noop_params(cls, adapter):
        rows, cols = adapter.grid
        return {"keep": rows * cols}

    @classmethod
    def budget_params(cls, tokens, adapter, config, path):
        """keep = B."""
        return {"keep": tokens}

    @classmethod
    def test_params(cls, adapter):
        return {"keep": 5}

    def install(self) -> None:
        self.clip = None
        if self.config.clip_model is not None:
            self.clip = load_clip_text(self.config.clip_model, self.ctx.device, self.ctx.dtype)

    def instruction_embeddings(self, prompt: str) -> torch.Tensor:
        """[M, D]: CLIP's pooled text embeddings per 77-token segment (``clip_model``), else [1, d]: the
        mean LLM input embedding of the instruction's tokens (module docstring)."""
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

    def prune_vision(self, vision, batch):
        cfg = self.config
        counts = vision.counts()
        if all(cfg.keep >= n for n in counts):
            vision.stats[self.name] = {"per_sample_kept": per_sample(counts, batch.image_owner, batch.batch_size)}
            return vision
        projected = self.adapter.project(vision)
        text = [self.instruction_embeddings(p) for p in batch.prompts]
        for i, n in enumerate(counts):
            if cfg.keep >= n:
                continue
            vision.projected[i] = projected[i]
            negate = (self.clip is not None) if cfg.negate is None else cfg.negate
            rel_img = self.image_embeddings(vision, i, projected[i])
            kernel = dpp_kernel(projected[i], text[batch.image_owner[i]].to(projected[i].device), rel_img, negate=negate, theta=cfg.theta)
            select_image_rows(vision, i, greedy_map(kernel, cfg.keep).sort().values)
        vision.stats[self.name] = {"per_sample_kept": per_sample(vision.counts(), batch.image_owner, batch.batch_size)}
        return vision
