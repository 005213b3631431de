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
(``hooks.attach``); ``vision_features`` edit. Positions: the 1 + (D-1) + C tokens are spliced
contiguously (dominant in original order, then contextual), as the official code.
Limits: needs a CLS token and the full patch grid (put it first among the feature stages);
``D - 1 + C`` must not exceed the patch count (official issue #30). Deviations: none in the
algorithm; the merge is computed in fp32 (the official code runs it in the model dtype).
No-op: ``tokens`` >= the patch count (without explicit counts) returns the vision batch untouched.

Budget (``budget: {tokens: B}``, vision tokens per image at the LLM input; sets ``tokens``, so
``dominant``/``contextual`` must not be given): tokens = B, i.e. CLS + (D - 1) + C = B exactly.

Qwen-VL families (qwen2_vl, qwen2_5_vl, qwen3_vl): refused: needs the tower's CLS attention,
which Qwen-VL towers lack; the official repository's Qwen2.5-VL variant is not in the snapshot
readable here (dvlab-research/VisionZip @3151f6d holds the LLaVA code only), so its CLS substitute
is not implemented from memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..capabilities import QWEN_FAMILIES, Capabilities, why_not
from ..config import opt
from ..errors import ConfigError
from ..hooks import attach, cls_row
from ..registry import PRUNERS
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
        families=frozenset({"llava"}),
        needs_cls=True,
        edits_features=True,
        needs_full_grid=True,
        unsupported=why_not(
            (
                "llava_next",
                "selects on one square patch grid per image before the projector; LLaVA-NeXT re-packs tiles "
                "(unpad, newlines) after it",
            ),
            (
                "llava_onevision",
                "needs the tower's CLS attention (SigLIP has none), and a feature edit would have to be "
                "re-packed through unpad / downscale / newlines",
            ),
            (
                QWEN_FAMILIES,
                "needs the tower's CLS attention, which Qwen-VL towers lack; the official Qwen2.5-VL variant is "
                "not in the readable repository snapshot, so its CLS substitute is not implemented from memory",
            ),
        ),
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
        return {"dominant": 4, "contextual": 3}

    def budget(self) -> tuple[int, int]:
        cfg = self.config
        return (cfg.dominant, cfg.contextual) if cfg.dominant is not None else split_budget(cfg.tokens)

    def is_noop(self, n_patches: int) -> bool:
        return self.config.dominant is None and self.config.tokens >= n_patches

    def install(self) -> None:
        rows, cols = self.adapter.grid
        n = rows * cols
        if self.is_noop(n):
            return
        d, c = self.budget()
        if d - 1 + c > n:
            raise ConfigError("", f"dominant - 1 + contextual = {d - 1 + c} exceeds the {n} patches of this model")
        self.layer = self.adapter.vision_feature_layer_index()
        attn = self.adapter.vision_layers[self.layer].self_attn
        self.probe_key = f"visionzip.cls.{self.layer}"
        self.ctx.probe.watch(self.probe_key, attn, rows=cls_row, reduce=None)
        self._keys: torch.Tensor | None = None
        attach(self.ctx.hooks, attn).recorders.append(self._record_keys)

    def _record_keys(self, module, query, key, attention_mask, scaling) -> None:
        self._keys = key.mean(1)  # [n_img, 1 + N, head_dim]: the official "metric"

    def prune_vision(self, vision, batch):
        rows, cols = vision.grid
        n = rows * cols
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
