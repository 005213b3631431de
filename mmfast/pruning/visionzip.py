"""VisionZip (Yang et al., "VisionZip: Longer is Better but Not Necessary in Vision Language Models",
CVPR 2025, arXiv 2412.04467; code dvlab-research/VisionZip).

Algorithm (per image, before the projector, on the features of the vision layer L that feeds it):
1. Dominant: sum over heads the attention CLS -> patch of layer L; keep the top D-1 patches (original
   order) and the CLS token itself (fed to the projector like a patch).
2. Contextual: of the other R patches, take layer L's keys (mean over heads), L2-normalised.
3. Pick C targets uniformly by stride (``step = max(1, R // C)``, the first C of ``0, step, ...``).
4. Assign every non-target patch to its most cosine-similar target (argmax).
5. Contextual token = target feature + mean of its assigned features (the target is *added*, not
   averaged in; a target with nothing assigned stays itself). Output: CLS, dominant, contextual.

Budgets D + C: 54+10, 108+20, 162+30 for 64/128/192 tokens (``tokens``; any other total keeps the
same 27:5 split, ``D = round(tokens * 27 / 32)``), or explicit ``dominant`` and ``contextual``.

Hook points: attention probe on vision layer L (CLS row only) and a key recorder on the same module
(``hooks.attach``; both depend on shapes only, so the tower still runs as a captured graph where the session
captures, their results carried across replays); ``vision_features`` edit. Positions: the 1 + (D-1) + C tokens are spliced
contiguously (dominant in original order, then contextual), as the official code.
Limits: needs a CLS token (LLaVA families; Qwen-VL: the substitute below) and the full patch grid
(put it first among the feature stages);
``D - 1 + C`` must not exceed the patch count (official issue #30). Deviations: none in the
algorithm; the merge is computed in fp32 (the official code runs it in the model dtype).
No-op: ``tokens`` >= the patch count (without explicit counts) returns the vision batch untouched.

Budget (``budget: {tokens: B}``, vision tokens per image at the LLM input; sets ``tokens``, so
``dominant``/``contextual`` must not be given): tokens = B, i.e. CLS + (D - 1) + C = B exactly.

LLaVA-OneVision (SigLIP, no CLS): refused. HoliTom (cokeshao/HoliTom @e9b2972, ``visionzip/llava_arch.py``,
``LLaVA-NeXT/llava/model/multimodal_encoder/siglip_encoder.py``) adapts VisionZip to OneVision by the
attention each patch receives in the last SigLIP layer (head mean, query mean), 2x2-pooled with the
frame features, but for *video* frames only (images pass through unpruned); mmfast's OneVision input
is images, whose anyres-max packing no release covers.

Qwen-VL families (qwen2_vl, qwen2_5_vl, qwen3_vl): towers without a CLS token. The official
repository has no Qwen code (dvlab-research/VisionZip @3151f6d, branches main and demo-chat: LLaVA
only); the published substitute is LightCompress's Qwen2.5-VL VisionZip (ModelTC/LightCompress
@9701d03, ``llmc/compression/token_reduction/visionzip.py``), implemented here as it does it
(``_received.py``):
1. Rank: in the tower's last block (the one feeding the merger), the attention each patch receives:
   softmax rows averaged over heads, summed over every query row of the block's attention span;
   the mean over each 2x2 merge unit's 4 patches is the unit's score (window order put back to
   raster order on Qwen2.5-VL). Keys: that block's keys after the vision RoPE, averaged over heads
   and over the unit's 4 patches.
2. Dominant: the top int(d N) units of an image of N merged tokens by that score.
3. Contextual: of the other units (raster order), max(int(c N), 1) targets by stride and the
   cosine argmax assignment of steps 3-4 above, on the unit keys; the merge is done on the *LLM
   input embeddings* (the merger's output: target + mean of its assigned tokens), as the release
   merges ``inputs_embeds``, not the tower features.
4. Layout: the kept units (dominant and targets) stay in raster order, each contextual token in its
   target's slot with the target's (t, h, w) M-RoPE ids (the release keeps those rows of
   ``position_ids``); the text after the image keeps its unpruned ids (mmfast's pre-LLM rule).
d and c are the release's fractions: D / 576 and C / 576 of the counts above (``tokens`` split
27:5 or the paper's presets, or ``dominant`` / ``contextual``), so params keep about (D + C) / 576 of
every image: int(N D / 576) + max(int(N C / 576), 1) (the release's int() rounding). A ``budget``
keeps its target of every image instead (``tokens: B``: B, split 27:5 into D and C; ``ratio: r``:
round(r N_i)), as every pruner's budget does. Deviations from LightCompress: every image of every sample is ranked and merged on
its own (the release: the whole batch as one sequence, first to last image token of sample 0);
scores and the merge in fp32 (release: the tower's dtype); Qwen2-VL and Qwen3-VL get the same rule
(the release: Qwen2.5-VL; their towers have no windows); Qwen3-VL's deepstack rows of a contextual
token are merged like its embedding (no release code has deepstack). Hook points: a recorder on the last block's
attention through the probe wrapper (``hooks.attach``; the model keeps sdpa, that one block runs
transformers' per-chunk loop instead of mmfast's fused tower attention; the release patches the block
to eager math), ``observe_tower`` (per-unit scores into ``VisionBatch.extras``), ``vision_features``.
The pre-merger ``features`` rows follow the kept units (a target's row is its own, unmerged).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..capabilities import Capabilities, Need
from ..config import opt
from ..errors import ConfigError
from ..hooks import attach, cls_row
from ..hooks.attention import Carried, replayable
from ..registry import PRUNERS
from . import _received
from ._budget import vision_tokens_per_image
from ._grid import grid_features, per_sample
from .base import Pruner

#: The paper's (dominant, contextual) splits (Table 1; README: ``visionzip(model, dominant=54, contextual=10)``).
PRESETS: dict[int, tuple[int, int]] = {64: (54, 10), 128: (108, 20), 192: (162, 30)}


def split_budget(tokens: int) -> tuple[int, int]:
    """(dominant incl. CLS, contextual) for a total of ``tokens``: the paper's presets, else the 27:5 split."""
    if tokens in PRESETS:
        return PRESETS[tokens]
    dominant = max(1, round(tokens * 27 / 32))
    return dominant, tokens - dominant


def contextual_merge(hidden: torch.Tensor, metric: torch.Tensor, n_ctx: int) -> torch.Tensor:
    """VisionZip's contextual tokens from ``hidden`` [R, Dv] with keys ``metric`` [R, Dk]: [min(C, R), Dv] fp32."""
    r = hidden.shape[0]
    n_ctx = min(n_ctx, r)
    if n_ctx == 0:
        return hidden.new_zeros(0, hidden.shape[1], dtype=torch.float32)
    m = metric.float()
    m = m / m.norm(dim=-1, keepdim=True)
    step = max(1, r // n_ctx)
    targets = torch.arange(0, r, step, device=hidden.device)[:n_ctx]
    is_target = torch.zeros(r, dtype=torch.bool, device=hidden.device)
    is_target[targets] = True
    assign = (m[~is_target] @ m[targets].T).argmax(1)  # [R - C] target of each merged token
    h = hidden.float()
    summed = torch.zeros(n_ctx, h.shape[1], device=h.device).index_add_(0, assign, h[~is_target])
    counts = torch.bincount(assign, minlength=n_ctx).clamp(min=1).unsqueeze(1)
    return h[targets] + summed / counts


@PRUNERS.register(
    "visionzip", description="VisionZip: CLS-attention dominant tokens + merged contextual tokens before the projector"
)
class VisionZip(Pruner):
    """VisionZip."""

    hook_points = frozenset({"attention_probe", "vision_features"})
    caps = Capabilities(
        needs=frozenset({Need.CLS, Need.UNTILED}),
        # LightCompress's received-attention rule on dynamic-grid towers without CLS (module docstring)
        substitutes={Need.CLS: frozenset({Need.DYNAMIC_GRID})},
        why={
            Need.CLS: "it ranks patches by the tower's CLS attention; the published received-attention substitutes "
            "cover dynamic-resolution towers (Qwen2.5-VL, LightCompress) and *video* frames of tiled towers "
            "(HoliTom, which passes images through unpruned), and a per-tile image selection would have to be "
            "re-packed through the tiles' unpad / downscale / newlines, which no release covers",
            Need.UNTILED: "it selects on one patch grid per image before the projector, which the tile packing "
            "re-orders after it",
        },
        edits_features=True,
        needs_full_grid=True,
    )

    @dataclass(frozen=True)
    class Config:
        tokens: int = opt(64, lo=1, doc="D + C per image; 64/128/192 use the paper's 54+10, 108+20, 162+30")
        dominant: int | None = opt(
            None, lo=1, doc="D: dominant tokens including CLS (with contextual; overrides tokens)"
        )
        contextual: int | None = opt(None, lo=0, doc="C: contextual (merged) tokens (with dominant; overrides tokens)")

        def __post_init__(self) -> None:
            if (self.dominant is None) != (self.contextual is None):
                raise ValueError("set both dominant and contextual, or neither (tokens then picks the split)")

    budget_knobs = ("tokens", "dominant", "contextual")

    @classmethod
    def noop_params(cls, adapter):
        rows, cols = adapter.grid
        return {"tokens": rows * cols}

    @classmethod
    def budget_params(cls, tokens, n, adapter, config, path):
        """tokens = B."""
        return {"tokens": tokens}

    @classmethod
    def test_params(cls, adapter):
        if not adapter.features.cls_token:  # received attention, fractions of 576: about half of each tiny image
            return {"tokens": 288}
        return {"dominant": 4, "contextual": 3}

    def budget(self, cfg=None) -> tuple[int, int]:
        cfg = self.config if cfg is None else cfg
        return (cfg.dominant, cfg.contextual) if cfg.dominant is not None else split_budget(cfg.tokens)

    def is_noop(self, n_patches: int) -> bool:
        return self.config.dominant is None and self.config.tokens >= n_patches

    def fractions(self) -> tuple[float, float]:
        """Qwen-VL: the release's (dominant, contextual) fractions of each image, D / 576 and C / 576."""
        d, c = self.budget()
        n_ref = vision_tokens_per_image(self.adapter)
        return d / n_ref, c / n_ref

    def install(self) -> None:
        rows, cols = self.adapter.grid
        n = rows * cols
        if self.is_noop(n):
            return
        self.layer = self.adapter.vision_feature_layer_index()
        if not self.adapter.features.cls_token:  # the received-attention substitute (``caps.substitutes``)
            block = self.adapter.vision_layers[self.layer]
            self._received = _received.ReceivedAttention()
            attach(self.ctx.hooks, block.attn).recorders.append(self._received)
            return
        d, c = self.budget()
        if d - 1 + c > n:
            raise ConfigError("", f"dominant - 1 + contextual = {d - 1 + c} exceeds the {n} patches of this model")
        attn = self.adapter.vision_layers[self.layer].self_attn
        self.probe_key = f"visionzip.cls.{self.layer}"
        self.ctx.probe.watch(self.probe_key, attn, rows=cls_row, reduce=None)
        self._keys: torch.Tensor | None = None
        # shape-only work (as the probe's CLS row): the tower may run both as a captured graph, the keys carried
        carried = Carried(lambda: self._keys, lambda keys: setattr(self, "_keys", keys.clone()))
        attach(self.ctx.hooks, attn).recorders.append(replayable(self._record_keys, carried))

    def _record_keys(self, module, query, key, attention_mask, scaling) -> None:
        self._keys = key.mean(1)  # [n_img, 1 + N, head_dim]: the official "metric"

    def observe_tower(self, vision) -> None:
        """Qwen-VL: the last block's received attention and keys, per merge unit in raster order, per image."""
        if getattr(self, "_received", None) is None:
            return
        received, keys = self._received.take()
        unit = self.adapter.merge**2
        order = _received.window_order(self.adapter.vision_tower, vision.extras["grid_thw"], self.adapter.merge)
        counts = vision.counts()
        if received.numel() != unit * sum(counts):
            raise RuntimeError(f"visionzip: vision block {self.layer} did not run on every patch of the images")
        vision.extras["visionzip.received"] = _received.per_unit(received, unit, order, counts)
        vision.extras["visionzip.keys"] = _received.per_unit(keys, unit, order, counts)

    def prune_vision(self, vision, batch):
        rows, cols = vision.grid
        n = rows * cols
        if not self.adapter.features.cls_token and not self.is_noop(n):
            return self._prune_units(vision, batch)
        if self.is_noop(n):
            vision.stats[self.name] = {
                "per_sample_kept": per_sample(vision.counts(), batch.image_owner, batch.batch_size)
            }
            return vision
        d, c = self.budget()
        cls_attn = self.ctx.probe[self.probe_key].probs[:, :, 0, 1:].sum(1)  # [n_img, N], sum over heads
        keys, self._keys = self._keys, None
        if keys is None or cls_attn.shape[1] != n:
            raise RuntimeError(f"visionzip: vision layer {self.layer} did not run on the full {rows}x{cols} grid")
        for i in range(vision.n_images):
            grid, _ = grid_features(vision, i, "visionzip")  # the CLS (if any) comes from vision.cls
            patches = grid.reshape(n, -1)
            top = cls_attn[i].topk(d - 1).indices.sort().values.to(patches.device)
            rest = torch.ones(n, dtype=torch.bool, device=patches.device)
            rest[top] = False
            ctx = contextual_merge(patches[rest], keys[i, 1:].to(patches.device)[rest], c).to(patches.dtype)
            cls = vision.cls[i].to(patches.device, patches.dtype).unsqueeze(0)
            vision.features[i] = torch.cat([cls, patches[top], ctx])
            vision.patch_ids[i] = torch.cat(
                [torch.tensor([-1], device=patches.device), top, torch.full((ctx.shape[0],), -1, device=patches.device)]
            ).long()
        vision.stats[self.name] = {
            "per_sample_kept": per_sample(vision.counts(), batch.image_owner, batch.batch_size),
            "dominant": d,
            "contextual": c,
        }
        return vision

    def _prune_units(self, vision, batch):
        """Qwen-VL: LightCompress's rule on each image's merged tokens (module docstring)."""
        frac_d, frac_c = self.fractions()
        projected = self.adapter.project(vision)  # [N_i, d] each: the LLM input embeddings the release merges
        received, keys = vision.extras.pop("visionzip.received"), vision.extras.pop("visionzip.keys")
        dominant, contextual = [0] * batch.batch_size, [0] * batch.batch_size  # what each sample's images kept
        for i, n in enumerate(vision.counts()):
            if received[i].numel() != n or not torch.equal(vision.patch_ids[i].cpu(), torch.arange(n)):
                raise ValueError(
                    "visionzip needs every image's full merged grid; put it first among the feature stages"
                )
            if self.maps_per_image:  # a budget: its target for this image's own count, split as the presets
                d, c = self.budget(self.config_for(n))
            else:  # the release's fractions of 576
                d, c = int(frac_d * n), max(int(frac_c * n), 1)
            if d + c >= n:
                dominant[batch.image_owner[i]] += n
                continue  # every token kept (targets would cover the rest): the image untouched
            kept, rows_t, rest, assign = _received.select(received[i], keys[i], d, c)
            dominant[batch.image_owner[i]] += kept.numel() - rows_t.numel()
            contextual[batch.image_owner[i]] += rows_t.numel()
            kept_dev = kept.to(projected[i].device)
            vision.projected[i] = _received.merge_rows(
                projected[i], kept_dev, rows_t.to(kept_dev.device), rest.to(kept_dev.device), assign.to(kept_dev.device)
            )
            vision.features[i] = vision.features[i][kept_dev]
            vision.patch_ids[i] = vision.patch_ids[i][kept.to(vision.patch_ids[i].device)]
            for tags in vision.tags.values():
                t = tags[i]
                k = kept.to(t.device)
                if t.is_floating_point():  # Qwen3-VL's deepstack rows merge like the embeddings
                    tags[i] = _received.merge_rows(t, k, rows_t.to(t.device), rest.to(t.device), assign.to(t.device))
                else:
                    tags[i] = t[k]
        vision.stats[self.name] = {
            "per_sample_kept": per_sample(vision.counts(), batch.image_owner, batch.batch_size),
            "per_sample_dominant": dominant,
            "per_sample_contextual": contextual,
        }
        if not self.maps_per_image:  # a budget splits each image's own target instead of these fractions
            vision.stats[self.name].update(dominant_fraction=frac_d, contextual_fraction=frac_c)
        return vision
