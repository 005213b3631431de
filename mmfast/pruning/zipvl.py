"""ZipVL (He et al., "ZipVL: Efficient Large Vision-Language Models with Dynamic Token Sparsification
and KV Cache Compression", arXiv 2410.08584 v1; quantisation from ZipCache, arXiv 2405.14256).

Algorithm (paper Alg. 1, every LLM layer, prefill):
1. probe queries Q' = the most recent + randomly drawn earlier tokens; A' = softmax(Q'K^T/sqrt(d) + causal mask),
   averaged over heads;
2. accumulated scores a_j = sum_i A'_ij; the layer's ratio p/n = the smallest p whose top-p mass reaches tau * total;
3. normalised scores a~_j = a_j / #(probe queries that can attend to j) (removes the causal bias toward early
   tokens); important set T = top-p by a~, U = the rest;
4. sparse prefill: attention among T only, O_T = Attn(Q[T], K[T], V[T]); U rows get attention output 0
   (the last prompt token, whose output predicts the first answer token, always joins T: deviations);
5. KV cache: K/V[T] quantised to bits_high, K/V[U] to bits_low; while decoding, every ``requant_interval`` (100)
   generated tokens are re-scored with the current query (a = softmax(qK^T)[-100:]) and quantised the same way.

Hook points: an attention *override* on every LLM attention module (``hooks.attach(...).override``; the probe rows are
computed there with ``row_attention``, O(probes x keys)); ``runner.prefill_hooks`` installs
:class:`~mmfast.pruning._kv_quant.MixedPrecisionKVLayer` in every cache layer (really packed uint8 codes + per-group
scales/zero points, dequantised on read; on a static cache
:class:`~mmfast.pruning._kv_static.StaticMixedPrecisionLayer`); ``runner.step_hooks`` re-quantises the full-precision
decode buffer every ``requant_interval`` tokens.

Cost on a GPU: on the dynamic cache (``model.compile: off``) the override runs Python in every layer with one
device read each (whether anything left the important set, and the widest count, to gather it); the layers are
quantised together (``Segment.build_layers``; each layer's segment cut out of the fold when first read, so a
one-token call, which reads none, cuts none) and the probe rows of every layer drawn from one read per prefill.
On the static cache (``model.compile``) the override runs in fixed shapes with no host read
(:func:`~._zipvl_ops.masked_sparse_attention`, the gathered form's attention set), so the prefill's segments are
captured graphs, the probe rows staged as their input (``Carried.stage``), each layer's selection carried out.
After it, in a call that decodes, each segment is written back into its slots of the static buffers dequantised
(``StaticMixedPrecisionLayer``; a one-token call builds none, ``LMRunner.cache_unread``: its bytes come from the
class counts); the override's decode work (the last query) is carried out of the step: each decode step is the
unpruned model's captured graph. End KV bytes are counted on the host (:func:`~._kv_static.held_bytes`). Deviation of this path (not of the algorithm): the prefill's full-precision
buffers stay allocated and are read densely, so its saving is in the logical KV bytes only (``compile: off``: codes).

Positions: tokens are never removed from the residual stream or the cache; positions are unchanged.
U tokens skip attention in prefill (residual passthrough) but still go through the MLP.

Accounting: ``state.accounting.vision_override`` = important (T) vision tokens per layer, so
``vision_tokens_layer_avg`` is ZipVL's *equivalent* token count (every vision token stays cached, at low precision);
FLOPs are reported dense (the MLP runs on every token). ``LMState.stats["zipvl"]``: per-layer keep ratio p/n, important
vision tokens per layer, equivalent tokens, KV bytes (dense, after prefill, at the end), re-quantisation count.

Verified in the paper (v1 Alg. 1, Table 1, Fig. 5): the steps above incl. "compress new KV cache every
100 tokens generated" and O = FlashAttention(Q[T], K[T], V[T]); tau in {0.96, 0.975}; the GQA tau sweep
peaks near 0.97. From ZipCache's code (github ThisisBillhe/ZipCache, modeling_llama.py and the demo
config): probes = last 5% + random 5% of the prompt; 4 / 2 bits for K and V; K channel-wise, V
channel-separable token-wise; streaming gap 100. Not found: ZipVL's own probe counts and bit-widths.

Assumptions / deviations (the ZipVL code was not public):
- probe counts follow ZipCache (5% + 5%, at least one recent probe); random probes are drawn without
  replacement with a per-layer seed (ZipCache: with replacement), identical for a sample in any batch;
- heads are averaged (ZipCache keeps per-KV-head sets; ZipVL's token-level FlashAttention needs one set);
- the normalisation counts the probe queries that can attend to j (exact for the probe rows); ZipCache's
  code divides by (n - j), the count for *all* queries;
- U rows' attention output is 0 (Alg. 1 computes O only for T; the output of U is not stated);
- the last valid prompt slot always joins T (:func:`with_generating_row`; not in Alg. 1). Its output row
  predicts the first answer token: left in U it attends to nothing in that layer. Its normalised score is its
  own self-attention weight (only the last probe sees it), so a tight tau drops it: on the embedded 4-layer
  model the bench's 64-token tau (0.59, keep ratios 0.25/0.02/0.02/0.15) dropped it in every layer and
  every POPE answer began with "in" ("inNo", issue 29; with ``quantize_kv: false`` the same, with
  ``sparse_prefill: false`` well-formed). It is a text token, so the vision accounting is unchanged;
- ``tau >= 1`` keeps every token (exact no-op) instead of possibly dropping zero-probability tokens;
- decode re-scoring applies Eq. 6 to the last-100 scores with total = their sum, no normalisation
  (one query attends to each); only the newest block is quantised (Alg. 1), each block with its own
  parameters (ZipCache's code re-quantises the whole cache);
- quantisation statistics are per sample and ignore padding (ZipCache pools the batch).

Budget (``budget: {tokens: B}``, layer-averaged *equivalent* vision tokens per image, the accounting above; sets
``tau``; ``flops`` is refused): calibrated when the session opens: x = 1 - tau is bisected on a log scale in [1e-6, 1]
on the fixed calibration set of ``pruning._budget`` (rendered world images, POPE-style questions) until the mean
equivalent vision tokens are within 2% of B; the calibrated tau and the tokens it kept are logged and reported in the
stats (``calibration``, ``tau``). A budget outside its reachable range is refused.

Limits: refuses speculative decoding (drafts are verified against, and rolled back from, a cache that is being
quantised) and beam search (the paper defines decoding for one sequence; the per-layer accounting in ``extras`` is per
prefill row), and other stages that edit the KV cache (the quantised layer refuses dense slot edits). Prefill attention
runs on the base implementation (sdpa/eager) on the gathered important tokens; it saves attention FLOPs, not MLP FLOPs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .. import compat
from ..capabilities import Capabilities
from ..config import opt
from ..errors import IncompatibleRecipeError
from ..hooks import attach
from ..hooks.attention import Carried, replayable, row_attention, staged_copy
from ..registry import PRUNERS
from ._common import topk_keep
from ._kv_quant import SUPPORTED_BITS, MixedPrecisionKVLayer, QuantSpec, Segment, SegmentedLayer
from ._kv_static import StaticMixedPrecisionLayer, held_bytes
from ._zipvl_ops import (
    LayerSelection,
    Scratch,
    key_validity,
    layer_probe_rows,
    masked_sparse_attention,
    mass_count,
    select_important,
    sparse_attention,
    with_generating_row,
)
from .base import Pruner

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------- the method


@PRUNERS.register(
    "zipvl", description="ZipVL: attention-mass-adaptive important tokens, sparse prefill, 4/2-bit mixed-precision KV"
)
class ZipVL(Pruner):
    """ZipVL."""

    hook_points = frozenset({"attention_probe", "kv_cache"})
    caps = Capabilities(
        owns_kv_cache=True,
        kv_edit_prefill=True,
        kv_edit_decode=True,
        overrides_llm_attention=True,
    )

    @dataclass(frozen=True)
    class Config:
        tau: float = opt(
            0.975, lo=0.0, hi=1.0, doc="attention-mass threshold (paper: 0.96 / 0.975); 1.0 keeps every token"
        )
        probe_recent: float = opt(
            0.05, lo=0.0, hi=1.0, doc="fraction of most recent tokens used as probe queries (>= 1; ZipCache: 5%)"
        )
        probe_random: float = opt(
            0.05, lo=0.0, hi=1.0, doc="fraction of random earlier tokens used as probe queries (ZipCache: 5%)"
        )
        seed: int = opt(0, lo=0, doc="seed of the random probe draw (combined with the layer index)")
        sparse_prefill: bool = opt(True, doc="compute prefill attention among the important tokens only")
        quantize_kv: bool = opt(True, doc="store important tokens at bits_high, the rest at bits_low")
        bits_high: int = opt(4, lo=1, hi=8, doc="bits of important tokens' K/V (ZipCache: 4)")
        bits_low: int = opt(2, lo=1, hi=8, doc="bits of the other tokens' K/V (ZipCache: 2)")
        k_group_size: int = opt(
            0, lo=0, doc="tokens per key group (channel-wise); 0 = all tokens of a class (ZipCache)"
        )
        v_group_size: int = opt(
            0, lo=0, doc="channels per value group (token-wise); 0 = all KV heads x head_dim (ZipCache)"
        )
        requant_interval: int = opt(
            100, lo=1, doc="generated tokens between re-scoring + quantisation of the decode buffer (paper: 100)"
        )

        def __post_init__(self) -> None:
            for name in ("bits_high", "bits_low"):
                if getattr(self, name) not in SUPPORTED_BITS:
                    raise ValueError(
                        f"{name} must be one of {SUPPORTED_BITS} (packed into uint8), got {getattr(self, name)}"
                    )
            if self.bits_low > self.bits_high:
                raise ValueError(f"bits_low ({self.bits_low}) must not exceed bits_high ({self.bits_high})")

    budget_knobs = ("tau",)
    calibrated = True
    flops_refused = "it computes and caches every vision token, so its prefill FLOPs stay the unpruned model's"

    @classmethod
    def noop_params(cls, adapter):
        return {"tau": 1.0, "quantize_kv": False}

    def calibrate(self, tokens: int) -> None:
        """Bisect x = 1 - tau (module docstring) to land on ``tokens`` equivalent vision tokens."""
        import dataclasses

        from ._budget import calibrate_scalar, calibration_batch, check_reachable, measure_layer_avg

        batch = calibration_batch(self.ctx)

        def measure(x: float) -> float:
            self.config = dataclasses.replace(self.config, tau=1.0 - x)
            return measure_layer_avg(self.ctx, batch)

        check_reachable(self.budget_path, measure, tokens, 1e-6, 1.0, increasing=False)
        self.calibration = calibrate_scalar(
            "zipvl 1 - tau", measure, tokens, 1e-6, 1.0, increasing=False, log_scale=True
        )
        measure(self.calibration.value)
        logger.info("zipvl: budget %d -> tau %.6g", tokens, self.config.tau)

    def calibrated_setting(self) -> dict:
        return {"calibration": self.calibration, "tau": self.config.tau}

    def apply_calibrated(self, setting: dict) -> None:
        import dataclasses

        self.calibration = setting["calibration"]
        self.config = dataclasses.replace(self.config, tau=setting["tau"])

    @classmethod
    def test_params(cls, adapter):
        return {"tau": 0.9, "requant_interval": 2}

    # -- installation ---------------------------------------------------------------------------------
    def install(self) -> None:
        cfg = self.config
        text = self.adapter.text_config
        self.kv_heads = int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads)
        self.head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
        channels = self.kv_heads * self.head_dim
        if cfg.quantize_kv:
            for bits in (cfg.bits_high, cfg.bits_low):
                if channels % (8 // bits):
                    raise IncompatibleRecipeError(
                        f"ZipVL: {channels} KV channels cannot be packed {8 // bits} to a byte"
                    )
            if cfg.v_group_size and channels % cfg.v_group_size:
                raise IncompatibleRecipeError(
                    f"ZipVL: v_group_size {cfg.v_group_size} does not divide {channels} KV channels"
                )
        self.spec = QuantSpec(cfg.bits_high, cfg.bits_low, cfg.k_group_size, cfg.v_group_size, cfg.requant_interval)
        self._layer_of: dict[int, int] = {}
        # a captured prefill segment's input, the probe rows (:meth:`_stage`): memory per shape, (length, [L, B, W])
        self._row_buffers: dict[tuple, torch.Tensor] = {}
        self._staged: tuple[int, torch.Tensor] | None = None
        for i, layer in enumerate(self.adapter.layers):
            hooks = attach(self.ctx.hooks, layer.self_attn)
            if hooks.override is not None:
                raise IncompatibleRecipeError(
                    f"ZipVL: LLM layer {i}'s attention is already overridden by another method"
                )
            # replayed by a captured prefill segment and decode step (static cache); what it leaves for the KV
            # policy (its prefill selection, a decode step's query) carried out
            carried = Carried(
                lambda i=i: self._scratch().left_by(i), lambda got, i=i: self._scratch().put(i, got), self._stage, True
            )
            hooks.override = replayable(self._attention, carried)
            self._layer_of[id(layer.self_attn)] = i
        self.ctx.runner.prefill_hooks.append(self._after_prefill)
        self.ctx.runner.step_hooks.append(self._after_step)

    # -- attention override ----------------------------------------------------------------------------
    def _attention(self, module, query, key, value, attention_mask, scaling, base, dropout=0.0, **kwargs):
        if self.ctx.runner.active is None:  # another session's forward (or the model's own): this one steps aside
            return base(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)[0]
        layer = self._layer_of[id(module)]
        bsz, _, q_len, _ = query.shape
        k_len = key.shape[2]
        if q_len > 1 and q_len == k_len:  # prefill (every sequence starts with an empty cache)
            valid = key_validity(attention_mask, bsz, k_len, query.device)
            keep, p = self._select(layer, query, key, attention_mask, scaling, valid)
            keep = with_generating_row(keep, valid)
            self._scratch().prefill[layer] = LayerSelection(keep, valid, p)
            if self.config.sparse_prefill and self.config.tau < 1.0:
                if compat.is_static(self.ctx.runner.active.cache):  # fixed shapes, no host read (captured or not)
                    return masked_sparse_attention(
                        module, query, key, value, keep, scaling, base, dropout=dropout, **kwargs
                    )
                # one read: whether any slot left the important set, and the widest sample's important count
                differs, width = torch.stack([(keep != valid).any().long(), keep.sum(1).max()]).tolist()
                if differs:
                    return sparse_attention(
                        module, query, key, value, keep, scaling, base, dropout=dropout, width=width, **kwargs
                    )
        elif self.config.quantize_kv:
            self._scratch().last_query[layer] = (query[:, :, -1:], scaling)
        out, _ = base(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        return out

    def _select(self, layer, query, key, attention_mask, scaling, valid):
        cfg = self.config
        if cfg.tau >= 1.0:
            return valid.clone(), valid.sum(1)
        if self._staged is not None and self._staged[0] == valid.shape[1]:  # a captured segment's input
            rows = self._staged[1][layer]  # [B, W]
        else:
            scratch = self._scratch()
            mask_key = (attention_mask.data_ptr(), tuple(attention_mask.shape)) if attention_mask is not None else None
            if scratch.rows is None or scratch.rows[0] != (mask_key, tuple(valid.shape)):  # once per prefill
                scratch.rows = ((mask_key, tuple(valid.shape)), self._draw(valid).to(valid.device))
            rows = scratch.rows[1][layer]  # [B, W]
        probs = row_attention(query, key, attention_mask, scaling, rows, is_causal=True).mean(1)  # [B, W, K]
        return select_important(probs, rows, valid, cfg.tau)

    def _draw(self, valid: torch.Tensor) -> torch.Tensor:
        """[L, B, W] every layer's probe rows for key validity ``valid`` ([B, K]), on the host (one read)."""
        c = self.config
        return layer_probe_rows(valid, len(self.adapter.layers), c.probe_recent, c.probe_random, c.seed)

    def _stage(self, length: int | None):
        """Before a captured prefill segment of ``length`` slots runs (``Carried.stage``; once for the segment,
        though every layer's override carries it): draw every layer's probe rows from the running layer
        group's validity into the memory the graph reads; returns the graph's key part (the rows' width).
        ``length`` None: the segment is over."""
        if length is None:
            self._staged = None
            return None
        if self.config.tau >= 1.0:  # no selection: no rows
            return None
        if self._staged is None or self._staged[0] != length:  # drawn once for the segment's layers
            valid = self.ctx.runner.active.groups[-1].key_mask  # [B, length]: the group this segment runs on
            if valid.shape[1] != length:
                raise RuntimeError(f"ZipVL: a prefill segment of {length} slots on a layer group of {valid.shape[1]}")
            fresh = self._draw(valid)  # [L, B, W] on the host
            buf = staged_copy(self._row_buffers, (tuple(fresh.shape), valid.device), fresh, valid.device)
            self._staged = (length, buf)
        return ("zipvl rows", int(self._staged[1].shape[-1]))

    # -- KV-cache policy ---------------------------------------------------------------------------------
    def _scratch(self) -> Scratch:
        """What this forward's attention calls leave for the KV policy, kept on the running state."""
        state = self.ctx.runner.active
        if state is None:
            raise RuntimeError("ZipVL: the LLM ran outside the runner")
        return state.extras.setdefault(self.name, Scratch())

    def _after_prefill(self, state) -> None:
        scratch: Scratch = state.extras.pop(self.name, Scratch())
        sel = scratch.prefill
        keeps: dict[int, torch.Tensor] = {}  # layer -> [B, T_g] its important slots
        per_group = []  # [4, L_g, B]: kept, held, vision kept, vision slots
        for g, grp in enumerate(state.groups):  # the layers of a group in one stack (a few ops, not ~10 a layer)
            valid, vision, layers = grp.key_mask, state.vision_slots(g), state.layers_of(g)  # [B, T_g] each
            mine = [sel.get(i) for i in layers]
            keep = torch.stack([valid if s is None or s.keep.shape != valid.shape else s.keep for s in mine]) & valid
            keeps.update(zip(layers, keep.unbind(0)))  # keep: [L_g, B, T_g]
            n = len(layers)
            per_group.append(
                torch.stack(
                    [keep.sum(2), valid.sum(1).expand(n, -1), (keep & vision).sum(2), vision.sum(1).expand(n, -1)]
                )
            )
        counts = torch.cat(per_group, 1).transpose(1, 2).cpu()  # one read for every layer: [4, B, L]
        ratio = counts[0].double() / counts[1].clamp(min=1).double()  # [B, L] p / n
        vis_kept_f = counts[2].float()
        lay0 = state.cache.layers[0]
        slot = 2 * lay0.keys.shape[1] * lay0.keys.shape[-1] * lay0.keys.element_size()
        dense = counts[1].double().sum(1) * slot  # [B] the valid slots in a full-precision cache
        if self.config.quantize_kv and self.ctx.runner.cache_unread(state):  # the quantised cache's bytes, unbuilt
            state.accounting.kv_bytes_unbuilt = Segment.layers_bytes(counts[0], counts[1], lay0.keys, self.spec)
        elif self.config.quantize_kv:  # the layers of each layer group quantised together (Segment.build_layers)
            prefilled, quantised = state.cache, list(state.cache.layers)
            static = compat.is_static(prefilled)
            for g, grp in enumerate(state.groups):
                layers = state.layers_of(g)
                keys, values = [prefilled.layers[i].keys for i in layers], [prefilled.layers[i].values for i in layers]
                built = Segment.build_layers(keys, values, grp.key_mask, [keeps[i] for i in layers], self.spec)
                for i, k, v, (seg, nbytes) in zip(layers, keys, values, built):
                    quantised[i] = (
                        StaticMixedPrecisionLayer(prefilled.layers[i], seg, self.spec, nbytes)
                        if static
                        else MixedPrecisionKVLayer.of_segment(k, v, seg, self.spec, nbytes)
                    )
            # a static cache's layers over its buffers, in a cache of their own (the prefill's stays the pool's)
            if static:
                state.cache = compat.static_cache_of(quantised)
            else:
                state.cache.layers[:] = quantised
        state.accounting.vision_override = vis_kept_f.to(state.groups[0].key_mask.device)
        kv = state.kv_bytes_per_sample()
        state.stats[self.name] = {
            "per_sample_keep_ratio": [[round(x, 4) for x in row] for row in ratio.tolist()],  # p/n per layer
            "per_sample_important_vision": vis_kept_f.tolist(),  # per layer
            "per_sample_vision_tokens": counts[3][:, 0].float().tolist(),
            "per_sample_equiv_vision_tokens": vis_kept_f.mean(1).tolist(),
            "per_sample_kv_bytes_dense": [int(x) for x in dense.tolist()],
            "per_sample_kv_bytes_prefill": kv,
            "per_sample_kv_bytes_end": kv,
            "per_sample_requant_events": [0] * len(kv),  # buffers compressed while it decodes (rows_at_stop)
            "tau": self.config.tau,
            "bits": [self.config.bits_high, self.config.bits_low] if self.config.quantize_kv else None,
        }

    def _after_step(self, state) -> None:
        cfg = self.config
        scratch: Scratch = state.extras.pop(self.name, Scratch())
        events = 0
        for layer, lay in enumerate(state.cache.layers):
            if not isinstance(lay, SegmentedLayer) or lay.buffer_length < cfg.requant_interval:
                continue
            got = scratch.last_query.get(layer)
            valid = state.groups[state.group_of(layer)].key_mask
            n = lay.buffer_length
            vbuf = valid[:, valid.shape[1] - n :]
            if got is None or cfg.tau >= 1.0:
                keep = vbuf
            else:
                query, scaling = got
                keys = lay.keys  # dequantised, [B, Hkv, T, D]
                rows = torch.zeros(1, dtype=torch.long, device=query.device)
                probs = row_attention(query, keys, valid[:, None, None, :], scaling, rows, is_causal=False)
                scores = probs.mean(1)[:, 0, keys.shape[2] - n :]  # a = softmax(q K^T)[-n:], head mean
                keep = topk_keep(scores, vbuf, mass_count(scores, vbuf, cfg.tau))
            lay.compress_buffer(keep, vbuf)
            events += 1
        mine = state.stats.get(self.name)
        if mine:
            mine["per_sample_requant_events"] = [n + events for n in mine["per_sample_requant_events"]]
            since = state.groups[0].length - state.inputs.length  # tokens appended since the prefill
            mine["per_sample_kv_bytes_end"] = held_bytes(state.cache.layers, mine["per_sample_kv_bytes_prefill"], since)
