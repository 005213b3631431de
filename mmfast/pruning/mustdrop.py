"""MustDrop (Liu et al., "Multi-Stage Vision Token Dropping: Towards Efficient Multimodal Large
Language Model", arXiv 2411.10803; code liuting20/MustDrop).

Algorithm (three stages, per image / per sample):
1. Vision encoding: on the output of CLIP layer 0, split the patch grid into non-overlapping w x w
   windows (w = 3); a window whose mean off-diagonal pairwise cosine similarity is >= 0.8 collapses
   into one size-weighted (here: plain mean) token; r = the number of such windows, per image. Order: CLS, merged
   windows (most similar first), unmerged patches in raster order. Key set = the top
   ceil(0.08 * N') patches (N' after the merge) by head-mean CLS attention of the last CLIP layer.
2. Prefill: at the output of LLM layers [2, 6, 10, 14], A = head-mean attention of every token after
   the image to the surviving image tokens; g_j = sum_i A_ij, m_j = max_i A_ij; drop j iff
   g_j < lambda_g * sum_j g_j and m_j < lambda_i, then add the key set back (text always kept).
3. Decode: after prefill, the stages' keep decisions are composed and applied to the caches of the
   layers from the first pruning layer on, so they cache only the final survivors; earlier layers
   keep the full cache. Nothing is pruned during decode. (A one-token call on the static cache trims nothing:
   ``LMRunner.cache_unread``; the trimmed caches' bytes are published for the accounting.)
Budgets: ``preset`` "192" / "128" / "64" = (lambda_g, lambda_i) (0.001, 0.001), (0.0012, 0.001),
(0.011, 0.01) (README); the counts are adaptive, reported in the stats. (On the embedded model the
"192" and "128" presets both land near 386 tokens: the presets do not transfer between models.)
``budget: {tokens: B}`` (layer-averaged vision tokens per image, the prefill accounting below; sets
``preset``/``lambda_g``/``lambda_i``) is *calibrated* when the session opens: the thresholds are
s x (0.011, 0.01) (the "64" preset's ratio), and s is bisected on a log scale in [1e-4, 1e3] on the
fixed calibration set of ``pruning._budget`` (rendered world images, POPE-style questions) until the
mean layer-averaged vision tokens are within 2% of B. The calibrated thresholds, s and the tokens they
kept are logged and reported in the stats (``calibration``, ``thresholds``). Deviation: when even the
largest scale keeps more than B (on a shallow LLM the first filter follows layer 0, so every token the
merge leaves is computed there: on the embedded 4-layer model no lambda gets below ~129), the
thresholds stay at that scale and the window-merge threshold (paper: 0.8) is bisected in [-1, 0.8]
instead, so more windows merge; the stats report it (``merge_threshold``). A budget outside what
both can reach is refused with the reachable range.

Tensor operations (merge, drop rule, KV policy, prefill bookkeeping, token counts) are in ``_mustdrop_ops.py``, the
merge's hooks in the tower in ``_mustdrop_tower.py``. Hook points: an instance ``forward`` of CLIP layer 0 (set
through the HookSession, so the merged tokens are what the tower's hidden-state recorder and every later layer
see) and a pre-hook on the CLIP encoder (a padded merge's key mask, below); attention probe on the
last CLIP layer (CLS row) and on each LLM filter layer (rows = the text after the image,
``prefill_only``: a static decode step can be captured); ``runner.prune_at`` at layer l+1 for a filter at the output of layer l (the same thing: the
paper prunes the hidden states that leave layer l); ``runner.prefill_hooks`` for the KV policy.
Positions: compacted (``compact=True``, the code truncates position ids to 0..L'-1 after each
stage). In decode each layer's new position is its own cache length, as in the code: layers before
the first pruning layer continue from the full length, the trimmed layers from the final length
(keys already cached keep their rotations, the code's behaviour).

Limits and deviations: the window must divide the patch grid (the paper's grid is 24 x 24, w = 3;
the tiny test grid is 4 x 4, use w = 2). The released code is batch 1 in the LLM (it uses sample 0's
attention); here every decision is per sample, with left padding. The released vision code merges
the batch-minimum r; here every image merges its own r (the tower runs one image at a time for this
stage), so decisions never depend on the batch (equal to the release at batch 1, its evaluation setting).
The merge is computed in fp32. Where the session captures the vision tower (``model.compile: auto`` on CUDA), the
merge keeps the token count, zero padding after each image's tokens, and layers 1.. mask the padded keys: one
captured graph (~600 kernels launched one by one otherwise) for a batch's images at once (``_mustdrop_tower``). The
valid tokens equal the unpadded merge's exactly after layer 0 and within fp rounding after the masked layers; that
path computes layers 1.. over all 1 + N slots (no tower FLOPs saved; the reported FLOPs are the LLM's). The key set travels with the tokens as the ``mustdrop.key`` tag (through branches,
beams and rollbacks) and through the LLM stages by slot provenance; MustDrop must be the first feature stage (checked). Prefill FLOPs and the
layer-averaged token count are accounted from what prefill computed (before the KV policy trims the
caches), KV bytes from the trimmed caches; the stats also report the prefill layer-average of the vision tokens
(``prefill_tokens_layer_avg``) and the code's printed "tokens" figure (``equivalent_tokens``, which
counts layer l with its post-filter count), plus the kept count after each stage, the key-set size
and the merged windows.

Qwen-VL families (qwen2_vl, qwen2_5_vl, qwen3_vl): refused: its key set needs CLS attention
and its window merge a fixed square grid in CLIP layer 0; Qwen-VL towers have neither.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Literal

import torch

from ..capabilities import Capabilities, Need
from ..config import opt
from ..errors import ConfigError
from ..hooks import cls_row
from ..registry import PRUNERS
from ..runtime import LMState
from . import _mustdrop_ops as ops
from ._common import LayerMapping, map_layers
from ._mustdrop_tower import TowerMerge
from .base import Pruner

logger = logging.getLogger(__name__)

KEY_TAG = "mustdrop.key"  # LMInputs / VisionBatch tag: the key-set tokens (bool)


#: (lambda_g, lambda_i) of the paper's budgets (liuting20/MustDrop README, TextVQA examples).
PRESETS: dict[str, tuple[float, float]] = {"192": (0.001, 0.001), "128": (0.0012, 0.001), "64": (0.011, 0.01)}


NEEDS = frozenset({Need.CLS, Need.UNTILED, Need.SQUARE_GRID, Need.GLOBAL_TOWER_ATTENTION})
WHY = {
    Need.CLS: "its key set is ranked by the tower's CLS attention",
    Need.UNTILED: "its window merge needs one square patch grid per image in the tower",
    Need.SQUARE_GRID: "its window merge needs a fixed square grid in the tower's layer 0",
    Need.GLOBAL_TOWER_ATTENTION: "a merged window would straddle the tower's attention windows",
}


@PRUNERS.register(
    "mustdrop", description="MustDrop: window merge + key set in CLIP, dual-attention drop in prefill, KV policy"
)
class MustDrop(Pruner):
    """MustDrop."""

    hook_points = frozenset({"vision_tower", "attention_probe", "llm_layer", "kv_cache"})

    @classmethod
    def capabilities(cls, params) -> Capabilities:
        return Capabilities(
            needs=NEEDS,
            why=WHY,
            merges_in_tower=True,
            needs_full_grid=True,
            kv_edit_prefill=params is None or params.kv_policy,
            tower_per_image=True,
        )

    @dataclass(frozen=True)
    class Config:
        preset: Literal["192", "128", "64"] = opt("64", doc="paper budget: (lambda_g, lambda_i) of the README")
        lambda_g: float | None = opt(None, lo=0.0, doc="global-attention threshold (overrides the preset)")
        lambda_i: float | None = opt(None, lo=0.0, doc="individual-attention threshold (overrides the preset)")
        layers: tuple[int, ...] = opt(
            (2, 6, 10, 14), lo=1, doc="filter at the output of these LLM layers (32-layer indices)"
        )
        layer_mapping: LayerMapping = opt("absolute", doc="absolute, or proportional to the LLM depth")
        window: int = opt(3, lo=2, doc="w: local merge window (w x w); must divide the patch grid")
        sim_threshold: float = opt(
            0.8, lo=-1.0, hi=2.0, doc="merge a window whose mean pairwise cosine >= this (> 1: never)"
        )
        key_ratio: float = opt(0.08, lo=0.0, hi=1.0, doc="key set = top ceil(ratio * N') patches by CLS attention")
        key_layer: int = opt(-1, doc="vision layer whose CLS attention picks the key set (-1: last)")
        kv_policy: bool = opt(True, doc="trim the caches of layers >= the first filter layer to the final survivors")

    @classmethod
    def _fit(cls, adapter) -> dict:
        rows, cols = adapter.grid
        params: dict = {}
        if rows % 3 or cols % 3:
            params["window"] = 2
        if len(adapter.layers) < 15:
            params["layer_mapping"] = "proportional"
        return params

    budget_knobs = ("preset", "lambda_g", "lambda_i")
    calibrated = True
    #: the thresholds a calibration scales (the "64" preset's lambda_g : lambda_i ratio) and its range of scales
    CALIBRATION_BASE = PRESETS["64"]
    CALIBRATION_RANGE = (1e-4, 1e3)

    @classmethod
    def noop_params(cls, adapter):
        return {**cls._fit(adapter), "lambda_g": 0.0, "lambda_i": 0.0, "sim_threshold": 1.5}

    def calibrate(self, tokens: int) -> None:
        """Land on ``tokens`` layer-averaged tokens (module docstring): bisect the threshold scale s;
        when even the largest s keeps too many tokens, keep it and bisect the merge threshold."""
        from ._budget import (
            CALIBRATION_TOLERANCE,
            calibrate_scalar,
            calibration_batch,
            check_reachable,
            measure_layer_avg,
        )

        batch = calibration_batch(self.ctx)
        base_g, base_i = self.CALIBRATION_BASE

        def measure(s: float) -> float:
            self.lambda_g, self.lambda_i = s * base_g, s * base_i
            return measure_layer_avg(self.ctx, batch)

        def measure_merge(sim: float) -> float:
            self.sim_threshold = sim
            return measure_layer_avg(self.ctx, batch)

        lo, hi = self.CALIBRATION_RANGE
        if measure(hi) > tokens * (1 + CALIBRATION_TOLERANCE):
            # the filters cannot drop enough (a shallow LLM's first filter sees every merged token):
            # thresholds at their largest scale, then merge more windows
            merge_lo = -1.0
            check_reachable(
                self.budget_path, measure_merge, tokens, merge_lo, self.config.sim_threshold, increasing=True
            )
            self.calibration = calibrate_scalar(
                "mustdrop merge threshold", measure_merge, tokens, merge_lo, self.config.sim_threshold, increasing=True
            )
            measure_merge(self.calibration.value)
        else:
            check_reachable(self.budget_path, measure, tokens, lo, hi, increasing=False)
            self.calibration = calibrate_scalar(
                "mustdrop threshold scale", measure, tokens, lo, hi, increasing=False, log_scale=True
            )
            measure(self.calibration.value)  # leave the chosen thresholds in place
        logger.info(
            "mustdrop: budget %d -> lambda_g %.6g, lambda_i %.6g, merge threshold %.4g",
            tokens,
            self.lambda_g,
            self.lambda_i,
            self.sim_threshold,
        )

    def calibrated_setting(self) -> dict:
        return {
            "calibration": self.calibration,
            "lambda": (self.lambda_g, self.lambda_i),
            "sim_threshold": self.sim_threshold,
        }

    def apply_calibrated(self, setting: dict) -> None:
        self.calibration = setting["calibration"]
        self.lambda_g, self.lambda_i = setting["lambda"]
        self.sim_threshold = setting["sim_threshold"]

    @classmethod
    def test_params(cls, adapter):
        # every window merges (the same r for any batch), then both filter stages drop tokens
        return {**cls._fit(adapter), "sim_threshold": -1.0, "lambda_g": 0.2, "lambda_i": 1.0}

    # -- installation ------------------------------------------------------------------------------
    def thresholds(self) -> tuple[float, float]:
        cfg = self.config
        lg, li = PRESETS[cfg.preset]
        return (lg if cfg.lambda_g is None else cfg.lambda_g, li if cfg.lambda_i is None else cfg.lambda_i)

    @classmethod
    def check_facts(cls, config, facts) -> tuple[list[tuple[int, int]], int]:
        """The window divides the grid, every filter layer exists and leaves a layer to prune, the key
        layer exists (from the config before weights load, or the loaded model). Returns the filters
        ``[(probe layer, paper layer)]`` and the key layer."""
        rows, cols = facts.grid
        if rows % config.window or cols % config.window:
            raise ConfigError("window", f"{config.window} does not divide the {rows}x{cols} patch grid of this model")
        n_layers = facts.llm_layers
        filters = map_layers(config.layers, n_layers, config.layer_mapping)
        if filters[-1][0] + 1 >= n_layers:
            raise ConfigError(
                "layers",
                f"a filter at the output of layer {filters[-1][0]} leaves no layer to prune in "
                f"this {n_layers}-layer LLM; use layer_mapping: proportional or earlier layers",
            )
        n_vis = facts.vision_layers
        if not -n_vis <= config.key_layer < n_vis:
            raise ConfigError("key_layer", f"{config.key_layer} is not a layer of this {n_vis}-layer vision tower")
        return filters, config.key_layer % n_vis

    def install(self) -> None:
        cfg = self.config
        from ..capabilities import ModelFacts

        self.filters, key_layer = self.check_facts(
            cfg, ModelFacts.of_adapter(self.adapter)
        )  # [(probe layer, paper layer)]
        self.lambda_g, self.lambda_i = self.thresholds()
        self._lambdas = ops.DeviceScalars()  # the thresholds as the captured filters read them
        vis_layers = self.adapter.vision_layers

        # stage 1: window merge on the output of CLIP layer 0 (``_mustdrop_tower``: one image a tower call, or padded
        # and masked, a batch at once, where the tower is captured), key set from the CLS attention; a budget's
        # calibration may lower the merge threshold (module docstring)
        self.tower = TowerMerge(self.ctx.hooks, self.adapter, cfg.window, cfg.sim_threshold, self.ctx.device)
        self.key_probe = f"mustdrop.key.{key_layer}"
        self.ctx.probe.watch(self.key_probe, vis_layers[key_layer].self_attn, rows=cls_row, reduce="mean")

        # stage 2: dual-attention filter at the output of each layer l (= pruning at the input of l + 1)
        first = self.filters[0][0]
        self.first_layer = first
        self.ctx.runner.prune_at(first, self._capture)  # before the first probe: text rows, key slots
        for layer, paper in self.filters:
            attn = self.adapter.layers[layer].self_attn
            self.ctx.probe.watch(
                f"mustdrop.llm.{layer}",
                attn,
                rows=self._rows,
                when=lambda q, k: q == k and q > 1,
                reduce="mean",
                prefill_only=True,
                rows_from_inputs=True,  # from the prompt: a captured prefill segment stages them
            )
            self.ctx.runner.prune_at(layer + 1, self._make_select(layer), compact=True, ref_layer=paper + 1)

        # stage 3: output-aware KV policy after prefill
        self.ctx.runner.prefill_hooks.append(self._after_prefill)

    # -- stage 1 -----------------------------------------------------------------------------------
    @property
    def sim_threshold(self) -> float:
        return self.tower.threshold

    @sim_threshold.setter
    def sim_threshold(self, value: float) -> None:
        self.tower.threshold = value

    def tower_per_image(self) -> bool:
        """The unpadded merge needs one image a tower call (each its own count); the padded one merges each image
        of a batch on its own."""
        return not self.tower.padded()

    def observe_tower(self, vision) -> None:
        """Right after the tower ran (on one image, or on the batch with a padded merge): each image's merge and
        key-set attention, into ``vision`` (a padded merge's features cut to their valid tokens)."""
        rec = self.ctx.probe.get(self.key_probe)
        if rec is None:
            raise RuntimeError("MustDrop: the vision tower did not run with MustDrop's hooks")
        vision.extras["mustdrop.merge"] = self.tower.take(vision, rec.probs)

    def prune_vision(self, vision, batch):
        merges = vision.extras.pop("mustdrop.merge", None)
        if merges is None or len(merges) != vision.n_images:
            raise RuntimeError("MustDrop: the vision tower did not run with MustDrop's hooks")
        patch_ids, key_tags, key_sizes = [], [], []
        for i, (feats, (_r, ids, cls_attn)) in enumerate(zip(vision.features, merges)):
            n_post = ids.shape[0]
            offset = feats.shape[0] - n_post  # 1 when the select strategy keeps CLS
            if offset not in (0, 1) or vision.projected[i] is not None:
                raise ValueError(
                    f"MustDrop expected {n_post} patch tokens for image {i} (after its merge) but got "
                    f"{feats.shape[0]}; put MustDrop first among the feature stages"
                )
            n_key = min(n_post, math.ceil(self.config.key_ratio * n_post))
            key_idx = cls_attn.topk(n_key).indices  # [K] feature indices (after the offset) of the key set
            tag = torch.zeros(feats.shape[0], dtype=torch.bool, device=vision.patch_ids[i].device)
            tag[key_idx.to(tag.device) + offset] = True
            patch_ids.append(torch.cat([vision.patch_ids[i][:offset], ids.to(vision.patch_ids[i].device)]))
            key_tags.append(tag)
            key_sizes.append(n_key)  # the tag's True count (top-k indices are distinct): no read
        vision.patch_ids = patch_ids
        vision.tags[KEY_TAG] = key_tags  # travels with the tokens into LMInputs.tags
        owner = batch.image_owner
        vision.stats[self.name] = {
            "per_sample_merged_windows": [
                [m[0] for m, o in zip(merges, owner) if o == b] for b in range(batch.batch_size)
            ],
            "per_sample_key_set": [sum(n for n, o in zip(key_sizes, owner) if o == b) for b in range(batch.batch_size)],
        }
        return vision

    # -- stage 2 -----------------------------------------------------------------------------------
    def _capture(self, view) -> None:
        """At the first filter layer (before its attention runs): text-row counts and key slots.

        Everything MustDrop learns about a prefill lives in that state's ``extras`` (one state per
        branch), never on the stage."""
        key = view.state.inputs.tags.get(KEY_TAG)
        key_full = key.bool() if key is not None else torch.zeros_like(view.state.inputs.image_mask)  # [B, L]
        n_text = view.text_after.sum(1)  # [B]; text is never dropped, so constant over stages
        width = max(1, int(n_text.max()))  # the text rows' count: one read a prefill, for every filter's rows
        view.state.extras[self.name] = ops.PrefillData(n_text, width, key_full, [view.vision.sum(1)])
        return None

    def _rows(self, q_len: int, k_len: int) -> torch.Tensor:
        """Rows of the text after the image: the last n_b slots of each sample (-1 pads)."""
        state = self.ctx.runner.active
        data = state.extras.get(self.name) if state is not None else None
        if data is None:  # the LLM ran outside the runner's prefill: record nothing useful
            return torch.tensor([-1])
        return ops.text_rows(data.n_text, q_len, data.width)

    def _make_select(self, layer: int):
        key = f"mustdrop.llm.{layer}"

        def select(view) -> torch.Tensor:
            rec = self.ctx.probe[key]
            if rec.k_len != view.group.length:
                raise RuntimeError(f"MustDrop: stale attention record at layer {layer}")
            data: ops.PrefillData = view.state.extras[self.name]
            lambdas = self._lambdas((self.lambda_g, self.lambda_i), rec.probs.device)  # [2]
            inputs = (rec.probs, view.vision, data.key_full, view.group.source, lambdas)
            keep, kept = self.ctx.captured(("mustdrop", layer), ops.filter_keep, *inputs)  # [B, T], [B]
            data.counts.append(kept)
            return keep

        return select

    # -- stage 3 -----------------------------------------------------------------------------------
    def _after_prefill(self, state: LMState) -> None:
        data = state.extras.pop(self.name, None)
        if data is None:
            return
        self._stage_stats(state, data.counts)
        if not self.config.kv_policy:
            return
        last = self.filters[-1][0] + 1
        if self.ctx.runner.cache_unread(state):  # the bytes the trimmed caches would hold, for the accounting
            state.accounting.kv_bytes_unbuilt = ops.kv_policy_bytes(state, self.first_layer, last)
            return
        ops.apply_kv_policy(state, self.first_layer, last, ref_start=self.filters[0][1])

    def _stage_stats(self, state: LMState, counts: list[torch.Tensor]) -> None:
        state.stats[self.name] = {
            **ops.token_stats(counts, [layer for layer, _ in self.filters], state.n_layers),
            "thresholds": [self.lambda_g, self.lambda_i],
            "merge_threshold": self.sim_threshold,
        }
