"""Dynamic-LLaVA (Huang et al., "Dynamic-LLaVA: Efficient Multimodal Large Language Models via Dynamic
Vision-language Context Sparsification", ICLR 2025, arXiv 2412.00876; code Osilly/dynamic_llava).

Algorithm (inference):
1. at the input of LLM layer K (``sparse_layer``, 2), a learned *image predictor* scores every image token
   of a sample (small transformer over the sample's image tokens, local + masked-mean global channels);
2. prefill keeps the top k = int(N_img * ``vision_keep_rate``) (0.2: 115 of 576) by log p(keep), in
   their original order, and layers >= K run on the shorter sequence; layers >= K cache only them;
3. decoding with KV cache: at layer K a per-token *output-text predictor* judges each new token; if
   "drop" (keep logit not above drop logit) its K/V are not appended to layers >= K (the token still
   attends to the cache and itself in that step; layers < K always append);
4. decoding without KV cache (``use_cache: false``): every step recomputes the sequence and at layer K
   drops the generated tokens the output-text predictor marks "drop"; the last token is always kept
   (the image rule applies at every step too);
5. both predictors are trained with hard Gumbel-softmax + straight-through masks, masked attention and
   a keep-ratio loss (``scripts/train_dynamic_llava.py``, ``mmfast/train/dynamic_llava.py``).

Hook points: ``runner.prune_at(K)`` (prefill: image top-k; no-cache steps: generated-text drops),
``runner.on_decode(K)`` (runs the text predictor on the token entering layer K, before layers >= K) and a
``runner.step_hooks`` KV policy that removes the token's slot from every layer group starting at >= K:
physically (cache tensors sliced) when the whole batch drops it, otherwise masked out of that group's
``key_mask`` for the rows that drop it (both shrink ``kv_bytes_per_sample``); on a static cache (fixed buffers,
``model.compile``) always masked, with no host read, so the step is one captured graph: the decode function is
tensor work only, marked ``replayable``, its decision carried out of each replay. When no group starts at K
(e.g. ``vision_keep_rate: 1``), the first drop splits one off, with identical contents (on a static cache the
first step). A token generated after a drop keeps, in layers >= K, group 0's position (the runner's rule for
groups that keep their slots' ids, ``LMRunner.step``).

Positions: ``original``. Kept image tokens keep their position ids; a token generated after some were
dropped gets, in layers >= K, the same position as in layers < K (the full sequence length), as the
released code does (RoPE position from layer K-1's cache length).

Budget (``budget: {tokens: B}`` or ``{ratio: r}``, layer-averaged equivalent vision tokens per image at
prefill; sets ``vision_keep_rate``): with the mapped layer K of an L-layer LLM and an image of N vision
tokens (its own count; where images differ, mapped per count, ``_budget.py``; the top-k is per sample,
over the sum of its images' k, each mapped at the image's own count),
k = round((L * B - K * N) / (L - K)) (as FastV) and vision_keep_rate = (k + 1e-6) / N (capped at 1),
so int(N * rate) = k, and a sample of m images of N tokens keeps int(m N rate) = m k (a half-token
nudge would keep m k + m // 2); budgets below ceil(K * N / L) are refused, naming that smallest budget.

Predictors (``predictors``): ``auto`` = ``<model dir>/dynamic_llava/`` (the embedded model ships them
there), a directory written by the training script, or a released Dynamic-LLaVA checkpoint directory
(its ``sparse_config`` sets the predictor sizes; ``model.image_score_predictor.*`` and
``model.output_text_score_predictor.*`` are renamed, see ``_dynamic_llava_modules``), or ``random``
(untrained deterministic weights: tests only). A released checkpoint's predictors only make sense on that
checkpoint's own fine-tuned LLM (converted to the HF LLaVA format).

Limits: the text rule judges one generated token per decode step; a multi-token append (a new
instruction turn) is kept whole, as in the code with its instruction predictor off (the released setting;
that predictor is not implemented); speculative drafting (multi-token verification with rollback) is
refused with the text rule; beam search works; predictors are trained per model; the predictors' own
FLOPs are not added to the prefill accounting.

Deviations (with reasons):
- batch > 1 without cache: each sample drops exactly its own "drop" tokens (the code keeps, for every
  sample, the batch's largest keep count by score), so a batch equals its samples run alone;
- the image predictor masks padded image slots (attention and global mean) so samples with different
  image-token counts can share a batch; with equal counts it is the released computation;
- predictor sizes scale with the LLM width (c = max(32, d/8), see ``_dynamic_llava_modules``): the
  released c = 512 is wider than the embedded model's whole LLM (d = 256); released checkpoints keep theirs.

Stats (``LMState.stats["dynamic_llava"]``): ``image_tokens``, ``kept`` (image tokens after prefill), ``generated`` (generated
tokens fed back: decode steps with cache, generated tokens in the last forward without), ``kv_skipped``
and ``kv_skipped_fraction`` (of those, dropped from layers >= K; without cache the last token is never a
candidate). Decode steps a batch runs after a sample finished (on padding) count for that sample; with
beam search the counts are summed over the sample's beams.

Qwen-VL families (qwen2_vl, qwen2_5_vl, qwen3_vl): refused: its predictors are trained for a
LLaVA LLM; no Qwen-VL weights.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F

from .. import compat
from ..capabilities import Capabilities, Need
from ..config import opt
from ..errors import ConfigError, ModelLoadError
from ..hooks.attention import Carried, replayable
from ..models.base import GENERATED
from ..models.captured_tower import eager_call
from ..registry import PRUNERS
from ..runtime import LayerGroup
from ._common import LayerMapping, image_counts, map_layers
from ._dynamic_llava_modules import Predictors, gather_rows, keep_topk, load_predictors, random_predictors
from .base import Pruner

logger = logging.getLogger(__name__)

_DECISION = "dynamic_llava.decision"  # state.extras: [B, Q] bool keep decisions of the current step
_COUNTS = "dynamic_llava.counts"  # state.extras: per-sample (fed, skipped) decode-token counters
PREDICTOR_DIR = "dynamic_llava"


@PRUNERS.register(
    "dynamic_llava",
    description="Dynamic-LLaVA: learned predictors drop image tokens at prefill and generated-text KV while decoding",
)
class DynamicLLaVA(Pruner):
    """Dynamic-LLaVA."""

    hook_points = frozenset({"llm_layer", "kv_cache"})

    @classmethod
    def capabilities(cls, params) -> Capabilities:
        # acts on the spliced sequence, any vision layout; the decode rule drops generated tokens'
        # KV from layers >= K one step at a time (or recomputes without a cache)
        decode_rule = params is not None and params.text_keep == "predictor"
        return Capabilities(
            needs=frozenset({Need.ROPE_1D}),
            why={Need.ROPE_1D: "its predictors are trained for a 1-D RoPE LLaVA LLM; no multimodal-RoPE weights"},
            kv_edit_decode=decode_rule and params.use_cache,
            decodes_without_cache=params is not None and not params.use_cache,
            decode_free_setting="text_keep: always and use_cache: true",
        )

    @dataclass(frozen=True)
    class Config:
        predictors: str = opt(
            "auto",
            doc="auto (<model dir>/dynamic_llava), a trained predictor dir, a released Dynamic-LLaVA checkpoint dir, "
            "or random (untrained: tests and timings on random-weight shapes)",
        )
        sparse_layer: int = opt(2, lo=1, doc="K: predictors read the hidden states entering layer K (paper: 2)")
        layer_mapping: LayerMapping = opt("absolute", doc="absolute, or proportional to the LLM depth")
        vision_keep_rate: float = opt(
            0.2, lo=0.0, hi=1.0, doc="fraction of image tokens kept at prefill, k = int(N * rate) (paper: 0.2)"
        )
        text_keep: Literal["predictor", "always"] = opt(
            "predictor",
            doc="generated tokens: the output-text predictor decides, or always keep (no text sparsification)",
        )
        use_cache: bool = opt(True, doc="false: decode without KV cache (recompute; drop generated tokens at layer K)")

    budget_knobs = ("vision_keep_rate",)

    @classmethod
    def noop_params(cls, adapter):
        return {"vision_keep_rate": 1.0, "text_keep": "always", "predictors": "random"}

    @classmethod
    def budget_params(cls, tokens, n, adapter, config, path):
        """vision_keep_rate = (k + 1e-6) / N with k from the layer-average closed form (m images: m k)."""
        from ._budget import in_llm_keep

        n_layers = len(adapter.layers)
        ((layer, _),) = map_layers([config.sparse_layer], n_layers, config.layer_mapping)
        k = in_llm_keep(tokens, n, layer, n_layers, path)
        return {"vision_keep_rate": 1.0 if k >= n else (k + 1e-6) / n}

    @classmethod
    def test_params(cls, adapter):
        return {"predictors": "random"}

    @classmethod
    def random_shape_params(cls):
        return {"predictors": "random"}

    @classmethod
    def check_facts(cls, config, facts) -> None:
        """The sparse layer must exist in this LLM (checked from the config, before weights load)."""
        map_layers([config.sparse_layer], facts.llm_layers, config.layer_mapping, param="sparse_layer")

    # -- installation ------------------------------------------------------------------------------
    def install(self) -> None:
        cfg = self.config
        ((layer, paper),) = map_layers(
            [cfg.sparse_layer], len(self.adapter.layers), cfg.layer_mapping, param="sparse_layer"
        )
        self.layer, self.paper_layer = layer, paper
        self.text_rule = cfg.text_keep == "predictor"
        needed = cfg.vision_keep_rate < 1.0 or self.text_rule
        self.predictors: Predictors | None = None
        if needed or cfg.predictors != "auto":
            self.predictors = self._load()
        runner = self.ctx.runner
        runner.prune_at(layer, self.select, ref_layer=paper)
        if not cfg.use_cache:
            runner.use_cache = False
        elif self.text_rule:
            # shape-only (a captured step replays it): its decision is carried across replays to the KV policy
            carried = Carried(
                lambda: self._active().extras.get(_DECISION),
                lambda keep: self._active().extras.__setitem__(_DECISION, keep),
            )
            runner.on_decode(layer, replayable(self._decide, carried))
            runner.step_hooks.append(self._apply)

    def _load(self) -> Predictors:
        cfg = self.config
        hidden = self.adapter.text_config.hidden_size
        if cfg.predictors == "random":
            logger.warning(
                "dynamic_llava: untrained random predictors (predictors: random) decide nothing meaningful: "
                "for tests and timings on random-weight shapes only"
            )
            predictors, sparse = random_predictors(hidden), {}
        else:
            path = self._predictor_dir()
            predictors, sparse = load_predictors(path, hidden, model_dir=self._model_dir())
            trained = sparse.get("sparse_layer")
            if trained is not None and int(trained) != self.layer:
                raise ConfigError(
                    "sparse_layer",
                    f"the predictors in {path} were trained on the hidden states entering layer {trained}, but this "
                    f"recipe applies them at layer {self.layer} (sparse_layer={cfg.sparse_layer}, "
                    f"layer_mapping={cfg.layer_mapping}); set sparse_layer: {trained}",
                )
        if self.text_rule and predictors.text is None:
            raise ConfigError("text_keep", "these predictors have no output-text predictor; set text_keep: always")
        device = next(self.adapter.layers[self.layer].parameters()).device
        return predictors.to(device).eval().requires_grad_(False)

    def _model_dir(self) -> Path | None:
        path = Path(self.ctx.model_path)
        return path if str(path) not in ("", ".") and path.is_dir() else None

    def _predictor_dir(self) -> Path:
        if self.config.predictors != "auto":
            return Path(self.config.predictors).expanduser()
        model_dir = self._model_dir()
        if model_dir is None:
            raise ModelLoadError(
                f"dynamic_llava predictors: auto looks in <model dir>/{PREDICTOR_DIR}, but {self.ctx.model_name!r} "
                "was not loaded from a local directory; set the pruning param `predictors:` to a trained directory "
                "or a released Dynamic-LLaVA checkpoint"
            )
        return model_dir / PREDICTOR_DIR

    def _device(self) -> torch.device:
        assert self.predictors is not None
        return next(self.predictors.parameters()).device

    # -- prefill (and every no-cache step) -----------------------------------------------------------
    def select(self, view) -> torch.Tensor:
        cfg = self.config
        vision = view.vision  # [B, T]
        keep = torch.ones_like(vision)
        n_vis = vision.sum(1).tolist()
        if self.maps_per_image:  # a budget: each image's k at its own count, summed over the sample's images
            per_image = image_counts(view.images)  # [B][J]
            k = [sum(int(n * self.config_for(n).vision_keep_rate) for n in row if n) for row in per_image]
        else:
            k = [int(n * cfg.vision_keep_rate) if n else 0 for n in n_vis]
        kept = list(n_vis)
        if any(kk < n for kk, n in zip(k, n_vis)):
            x, valid, index = gather_rows(view.hidden, vision)
            t, dense = vision.shape[1], len(set(n_vis)) == 1  # dense: every row holds the widest count

            def chosen_slots(x, valid, index, k) -> torch.Tensor:  # [B, T] the kept vision slots
                dev = self._device()
                logits = self.predictors.image(x.to(dev, torch.float32), valid.to(dev), dense=dense)
                score = F.log_softmax(logits, dim=-1)[..., 0].to(valid.device)
                return _scatter_rows(keep_topk(score, valid, k), valid, index, t)

            # the predictor, the top-k and the scatter: one captured call where the session captures (a prefill's
            # length takes a few bucketed values; without a decode cache every step re-prefills a new length: eager)
            run = self.ctx.captured if cfg.use_cache else eager_call
            with torch.no_grad():
                chosen = run(
                    ("dynamic_llava.image", t, dense),
                    chosen_slots,
                    x,
                    valid,
                    index,
                    torch.tensor(k, device=vision.device),
                )
            keep &= ~vision | chosen
            kept = k
        stats = {"layer": self.layer, "per_sample_image_tokens": n_vis, "per_sample_kept": kept}
        if not cfg.use_cache and self.text_rule:
            keep &= ~self._drop_generated(view, stats)
        elif self.text_rule:  # decode steps fill these in (_apply)
            zeros = [0] * len(n_vis)
            stats.update(
                per_sample_generated=zeros,
                per_sample_kv_skipped=zeros,
                per_sample_kv_skipped_fraction=[0.0] * len(n_vis),
            )
        view.state.stats[self.name] = stats
        return keep

    def _drop_generated(self, view, stats: dict) -> torch.Tensor:
        """[B, T] bool: generated answer tokens (all but the last) the text predictor marks "drop".

        Generated tokens are the ones decoding appended (the inputs' ``generated`` tag), so the rule
        needs no memory of earlier prompts."""
        inputs = view.state.inputs
        gen = inputs.tags.get(GENERATED)
        gen = gen.bool() if gen is not None else torch.zeros_like(inputs.image_mask)  # [B, L]
        n_gen = gen.sum(1).tolist()
        drop = torch.zeros_like(view.vision)
        gen = gen.clone()
        gen[:, -1] = False  # the newest token always enters (it produces the next logits)
        if bool(gen.any()):
            src = view.group.source
            cand = gen.gather(1, src.clamp(min=0)) & (src >= 0) & view.group.key_mask
            x, valid, index = gather_rows(view.hidden, cand)
            with torch.no_grad():
                logits = self.predictors.text(x.to(self._device(), torch.float32)).to(drop.device)
            dropped = (logits[..., 0] <= logits[..., 1]) & valid
            drop = _scatter_rows(dropped, valid, index, drop.shape[1])
        skipped = drop.sum(1).tolist()
        stats["per_sample_generated"] = n_gen
        stats["per_sample_kv_skipped"] = skipped
        stats["per_sample_kv_skipped_fraction"] = [s / n if n else 0.0 for s, n in zip(skipped, n_gen)]
        return drop

    # -- decode with KV cache ------------------------------------------------------------------------
    def _active(self):
        state = self.ctx.runner.active
        if state is None:
            raise RuntimeError("dynamic_llava: a decode decision outside a decode step")
        return state

    def _decide(self, layer: int, hidden: torch.Tensor, state) -> None:
        """At layer K: keep/drop of the new token (its position in layers >= K follows group 0's: the runner's
        rule, ``LMRunner.step``). Tensor work only, no host read: it runs inside a captured step."""
        if hidden.shape[1] != 1:  # a multi-token append is a new instruction, not generated text: kept (as the code)
            return
        with torch.no_grad():
            logits = self.predictors.text(hidden.to(self._device(), torch.float32)).to(hidden.device)
        state.extras[_DECISION] = logits[..., 0] > logits[..., 1]  # [B, Q]

    def _apply(self, state) -> None:
        """After a step: remove the dropped new tokens from every layer group starting at >= K (on a static cache,
        whose buffers are fixed, masked out of the groups' slot validity: no host read, the same attention)."""
        keep = state.extras.pop(_DECISION, None)
        if keep is None:
            return
        bsz, q = keep.shape
        drop = ~keep
        zeros = torch.zeros(bsz, dtype=torch.long, device=keep.device)
        fed, skipped = state.extras.get(_COUNTS, (zeros, zeros))
        fed, skipped = fed + q, skipped + drop.sum(1)  # [B] on the device: no read per step
        state.extras[_COUNTS] = (fed, skipped)
        mine = state.stats.setdefault(self.name, {})
        n = len(mine.get("per_sample_kept", [])) or bsz
        if bsz != n and bsz % n == 0:  # beam search: rows are samples x beams, summed per sample
            fed, skipped = fed.view(n, -1).sum(1), skipped.view(n, -1).sum(1)
        state.stats[self.name] = {  # device tensors, read once as lists (LMState.stats_rows)
            **mine,
            "per_sample_generated": fed,
            "per_sample_kv_skipped": skipped,
            "per_sample_kv_skipped_fraction": skipped.double() / fed.clamp(min=1),
        }
        static = compat.is_static(state.cache)
        if not static and not bool(drop.any()):
            return
        self._ensure_group(state)
        all_drop = drop.all(0)  # [Q]
        for g, grp in enumerate(state.groups):
            if grp.start < self.layer:
                continue
            t = grp.length
            mask = grp.key_mask.clone()
            mask[:, t - q :] &= keep
            grp.key_mask = mask
            if static or not bool(all_drop.any()):
                continue
            cols = torch.ones(t, dtype=torch.bool, device=keep.device)
            cols[t - q :] = ~all_drop
            n_cols = int(cols.sum())
            if bool(cols[:n_cols].all()):  # a suffix: slice every layer of the group (no copy)
                for layer in state.layers_of(g):
                    lay = state.cache.layers[layer]
                    compat.set_layer_kv(state.cache, layer, lay.keys[:, :, :n_cols], lay.values[:, :, :n_cols])
                grp._map(lambda x: x[:, :n_cols])
            else:
                state.select_slots(g, cols.nonzero().squeeze(1).expand(bsz, -1))

    def _ensure_group(self, state) -> None:
        """Split a layer group starting exactly at K off the group that contains K (same contents)."""
        g = state.group_of(self.layer)
        src = state.groups[g]
        if src.start == self.layer:
            return
        grp = LayerGroup(
            self.layer,
            src.key_mask.clone(),
            src.positions.clone(),
            src.source.clone(),
            src.compact,
            float(self.paper_layer),
        )
        state.groups.insert(g + 1, grp)


def _scatter_rows(values: torch.Tensor, valid: torch.Tensor, index: torch.Tensor, length: int) -> torch.Tensor:
    """Inverse of ``gather_rows`` for a [B, N] bool: a [B, length] bool with ``values`` at ``index``."""
    out = torch.zeros(values.shape[0], length + 1, dtype=torch.bool, device=values.device)
    out.scatter_(1, index.masked_fill(~valid, length), values & valid)
    return out[:, :length]
