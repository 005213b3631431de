"""SparseVLM (Zhang et al., "SparseVLM: Visual Token Sparsification for Efficient Vision-Language
Model Inference", ICML 2025, arXiv 2410.04417; code Gumpest/SparseVLMs read at 9e1f649 (Dec 2025), its
default ``USE_VERSION=1_0`` rule (the v1.x fixed per-layer counts); the optional v2.0 "SparseVLM+" mode is not implemented).

Algorithm (prefill only, per sample):
1. Text raters, once, on the LLM input embeddings: M = softmax over the text tokens after the image of
   (vision embeds x text embeds^T), averaged over the vision tokens; the raters are the text tokens
   with M above its mean.
2. At the output of each filter layer l in ``[2, 6, 15]``: score of a vision token = layer l's
   attention from the raters (head mean, softmax over all keys with the causal mask), averaged over
   the raters. Keep the top ``min(k_s, n - 1)`` of the n vision tokens present (k_s the release's
   fixed counts: "192" -> [300, 200, 110], "128" -> [303, 110, 36], "96" -> [238, 48, 26],
   "64" -> [66, 30, 17]; given for 576 tokens and scaled by N_i / 576 for an image of N_i tokens).
3. Token recycling: of the m deleted tokens, the top int(0.3 m) + 1 by score are clustered by DPC-kNN
   (k = number of clusters = int(top / 10) + 1; density exp(-mean squared kNN distance), distance
   indicator = distance to the nearest denser token, centres = top score density x indicator, every
   token to its nearest centre), each cluster averaged (sum / (size + 1e-6), the release's weights)
   and the merged tokens inserted right after the kept vision tokens (cluster order). They are vision
   tokens for the next filters.
Text is never dropped. Positions (1-D RoPE families): renumbered 0..L'-1 after each filter
(``compact``), as v1.x truncates its position ids; in decode each layer continues from its own cache length (the release's
``get_usable_length`` rule). Nothing is pruned in decode.

Hook points: attention probe on each filter layer l (rows = the raters, ``prefill_only``: a static decode step can be captured; head mean);
each filter, once the images' present counts are read (one read per filter), is two captured calls over the batch (``MethodContext.captured``): :func:`~._sparsevlm_ops.filter_ranks`, then, with the recycled slots' hidden states gathered between them, :func:`~._sparsevlm_ops.filter_edit`;
``runner.prune_at(l + 1, compact=True)`` (Qwen-VL: ``compact=False``) returning a ``SlotEdit``: each merged token takes the slot of
its cluster centre (so its provenance is the centre's token, and it counts as a vision token of that
image), and the edit's layout key puts it after the kept vision tokens.

Budget accounting: mmfast counts what each layer computed: vision tokens *entering* each layer,
recycled tokens included (layer l computes the n tokens it was given; the drop takes effect from
l + 1). The release's "192" is the nominal schedule average (2 x 576 + 4 x 300 + 10 x 200 + 16 x 110) / 32
= 191, which counts layer l with its output and leaves the recycled tokens out (SparseVLMs issues
#10, #29, #33, #35); the real average of the "192" schedule on LLaVA-1.5 is 202.75 without and 206.5 with recycling
(computed by ``simulate``). The stats
report both (``per_sample_layer_avg_nominal``: the release's way). ``budget: {tokens: B}`` sets
``keep`` (``{ratio: r}``: B = round(r N_i)): the preset whose nominal average is nearest B gives the
shape, scaled so the real layer average (simulated exactly: the counts do not depend on the image's
content) is nearest B, for the image's own N_i (per image count where images differ, ``_budget.py``).

Capabilities: all six families (on LLaVA-NeXT every token of an image's packed span, the
``image_newline`` tokens included, is a vision token, as the release's span arithmetic would treat
them; the release itself ships LLaVA-1.5 only).

Deviations: (1) the release is batch 1 (``mask[0]``, one image per sample); here every decision is
per sample and, for the keep counts and recycling, per image, with left padding, so results never
depend on the batch; the raters rank the tokens of every image of the sample. (2) DPC-kNN's random
1e-6 density noise is replaced by a deterministic tie-break (equal density: the earlier token counts
as denser). (3) Scores, raters and clustering are computed in fp32. (4) With no text token strictly above the mean
relevance (one text token), every text token is a rater (the release would average an empty set).
(5) A count k_s >= n keeps every token (no drop, nothing recycled: the no-op setting); the release's
min(k_s, n - 1) would still drop the lowest token and re-insert it as its own one-token cluster. (6) The filter layers must map onto distinct layers with a layer after the last (``layers``; on a
4-layer LLM give e.g. ``layers: [0, 1, 2]`` with ``layer_mapping: absolute``). (7) DPC-kNN's pairwise
distances are the release's norms of differences computed a block of rows at a time (``_dpc_knn.pairwise_distance``,
equal values): the release holds all [n, n, C] differences at once, 60 GiB at 64 video frames on OneVision-7B.
Families: all six (the release: LLaVA-1.5 and, on its video branch, Video-LLaVA). On every family a
preset's counts are round(k_s N_i / 576) for an image of N_i tokens; counts given in ``keep`` (or set by
a budget for the image's N_i) are kept as they are. Under M-RoPE the survivors keep their original
(t, h, w) ids and a merged token takes its centre's ids, as LightCompress's Qwen2.5-VL SparseVLM does
(ModelTC/LightCompress @9701d03, ``llmc/compression/token_reduction/sparsevlm.py``: after each filter
it index-selects the layer's ``position_embeddings`` by the kept slots, the cluster centres' slots for
the merged tokens); decode continues from the largest kept id + 1 (the last prompt token's, as HF's
``rope_deltas``). The release has no Qwen code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Literal

import torch

from ..capabilities import Capabilities
from ..config import opt
from ..errors import ConfigError
from ..registry import PRUNERS
from ..runtime import SlotEdit
from ._budget import vision_tokens_per_image
from ._common import REFERENCE_LAYERS, LayerMapping, image_counts
from ._sparsevlm_ops import filter_edit, filter_ranks, text_raters
from .base import Pruner

#: the release's per-filter keep counts for 576 vision tokens (score.py, v1.x)
PRESETS: dict[str, tuple[int, int, int]] = {
    "192": (300, 200, 110),
    "128": (303, 110, 36),
    "96": (238, 48, 26),
    "64": (66, 30, 17),
}
REFERENCE_TOKENS = 576


def recycled_count(n_deleted: int, ratio: float, divisor: int) -> tuple[int, int]:
    """(tokens clustered, clusters) for ``n_deleted`` deleted tokens (0, 0 when none)."""
    if n_deleted <= 0:
        return 0, 0
    top = min(n_deleted, int(n_deleted * ratio) + 1)
    return top, int(top / divisor) + 1


def simulate(
    n: int, keeps: list[int], starts: list[int], n_layers: int, recycle: tuple[float, int] | None
) -> tuple[list[int], float]:
    """Vision tokens of one image of ``n`` tokens after each filter, and the layer average of the
    tokens entering each layer (filters start at ``starts``)."""
    counts, cur = [n], n
    for k in keeps:
        kept = min(k, cur)
        cur = kept + (recycled_count(cur - kept, *recycle)[1] if recycle else 0)
        counts.append(cur)
    bounds = [0, *starts, n_layers]
    return counts, sum(c * (bounds[i + 1] - bounds[i]) for i, c in enumerate(counts)) / n_layers


@dataclass
class _Prefill:
    raters: torch.Tensor  # [B, R] rater offsets into each sample's text after the image (-1 pads)
    n_text: torch.Tensor  # [B]
    counts: list[list[int]]  # per sample: vision tokens after each filter
    recycled: list[list[int]]  # per sample: merged tokens inserted at each filter
    n_image: list[list[int]]  # per sample, per image: its vision tokens in the prompt (N_i)


@PRUNERS.register(
    "sparsevlm", description="SparseVLM: text-rater-guided drops at LLM layers [2,6,15] with token recycling"
)
class SparseVLM(Pruner):
    """SparseVLM."""

    hook_points = frozenset({"attention_probe", "llm_layer"})
    caps = Capabilities()  # acts on the spliced sequence; M-RoPE: original 3-D ids kept

    @dataclass(frozen=True)
    class Config:
        preset: Literal["192", "128", "96", "64"] = opt(
            "192", doc="release keep counts per filter (for 576 tokens, scaled by N/576)"
        )
        keep: tuple[int, ...] | None = opt(
            None, lo=0, doc="vision tokens kept per image at each filter, as given (overrides preset)"
        )
        layers: tuple[int, ...] = opt((2, 6, 15), lo=0, doc="filter at the output of these layers (32-layer indices)")
        layer_mapping: LayerMapping = opt("absolute", doc="absolute, or proportional to the LLM depth")
        recycle: bool = opt(True, doc="merge the best deleted tokens (DPC-kNN) and insert them after the kept ones")
        recycle_ratio: float = opt(0.3, lo=0.0, hi=1.0, doc="fraction (+1) of the deleted tokens that are recycled")
        cluster_divisor: int = opt(10, lo=1, doc="clusters = int(recycled / divisor) + 1")

    budget_knobs = ("preset", "keep")

    @classmethod
    def _fit(cls, adapter) -> dict:
        n = len(adapter.layers)
        return {"layers": (0, 1, 2), "layer_mapping": "absolute"} if n < 16 else {}

    @classmethod
    def noop_params(cls, adapter):
        return {**cls._fit(adapter), "keep": (10**6,) * 3}

    @classmethod
    def test_params(cls, adapter):
        n = adapter.n_image_tokens or 24  # images of their own counts (the tiny test models': a few dozen)
        return {**cls._fit(adapter), "keep": (n * 5 // 8, n * 3 // 8, n // 8)}

    @classmethod
    def check_facts(cls, config, facts) -> list[tuple[int, int]]:
        """[(filter layer, paper filter layer)]: distinct, with a layer after the last; ``keep`` matches."""
        n = facts.llm_layers
        if config.keep is not None and len(config.keep) != len(config.layers):
            raise ConfigError(
                "keep", f"{len(config.keep)} counts for {len(config.layers)} filter layers; give one per filter"
            )
        if config.keep is None and len(config.layers) != 3:
            raise ConfigError("layers", "the presets have three filters; give keep with one count per layer")
        out = []
        for p in config.layers:
            layer = p if config.layer_mapping == "absolute" else round(p * n / REFERENCE_LAYERS)
            if not 0 <= layer < n - 1:
                raise ConfigError(
                    "layers",
                    f"a filter at the output of layer {layer} (from {p}) leaves no layer to prune in this "
                    f"{n}-layer LLM; use smaller layer indices or layer_mapping: proportional",
                )
            out.append((layer, p))
        if [x for x, _ in out] != sorted({x for x, _ in out}):
            raise ConfigError(
                "layers",
                f"{list(config.layers)} map onto layers {[x for x, _ in out]} of this {n}-layer LLM: "
                "they must be strictly increasing; give absolute layers",
            )
        return out

    @classmethod
    def keeps(cls, config, n_vision: int) -> list[int]:
        if config.keep is not None:
            return list(config.keep)
        return [round(k * n_vision / REFERENCE_TOKENS) for k in PRESETS[config.preset]]

    @classmethod
    def budget_params(cls, tokens, n, adapter, config, path):
        """keep: the nearest preset's shape, scaled so the real layer average of an image of n tokens is
        nearest ``tokens``."""
        from ..capabilities import ModelFacts

        n_layers = len(adapter.layers)
        starts = [layer + 1 for layer, _ in cls.check_facts(config, ModelFacts.of_adapter(adapter))]
        recycle = (config.recycle_ratio, config.cluster_divisor) if config.recycle else None

        def nominal(ks):  # the release's naming: layer l counted with its output, no recycled tokens
            bounds = [0, *[s - 1 for s in starts], n_layers]
            counts = [n, *ks]
            return sum(c * (bounds[i + 1] - bounds[i]) for i, c in enumerate(counts)) / n_layers

        shape = min(PRESETS.values(), key=lambda ks: abs(nominal([k * n / REFERENCE_TOKENS for k in ks]) - tokens))
        lo = simulate(n, [0] * len(starts), starts, n_layers, recycle)[1]
        if tokens > n or tokens < lo - 1e-9:
            raise ConfigError(
                f"{path}.tokens",
                f"{tokens} layer-averaged tokens is infeasible for SparseVLM with filters before "
                f"layers {starts} of {n_layers} and {n} vision tokens in this image: the smallest "
                f"feasible budget is {math.ceil(lo - 1e-9)}, the largest {n}",
            )
        best = None
        for i in range(4001):
            scale = i / 4000 * REFERENCE_TOKENS / min(shape)
            ks = [min(n, round(scale * k * n / REFERENCE_TOKENS)) for k in shape]
            avg = simulate(n, ks, starts, n_layers, recycle)[1]
            # the same average again: the larger keeps (fewer tokens merged; at B = N every token, a no-op)
            if best is None or abs(avg - tokens) < best[0] or avg == best[1]:
                best = (abs(avg - tokens), avg, ks)
        return {"keep": tuple(best[2])}

    def install(self) -> None:
        from ..capabilities import ModelFacts

        self.filters = self.check_facts(self.config, ModelFacts.of_adapter(self.adapter))
        self.key = f"{self.name}@{id(self):x}"  # per-instance extras / probe names (a recipe may stack two)
        self.keep_counts = self.keeps(self.config, vision_tokens_per_image(self.adapter))  # stats: the base grid's
        compact = self.adapter.features.rope == "1d"  # M-RoPE: original ids (module docstring)
        for s, (layer, paper) in enumerate(self.filters):
            attn = self.adapter.layers[layer].self_attn
            self.ctx.probe.watch(
                f"{self.key}.{layer}",
                attn,
                rows=self._rows,
                when=lambda q, k: q == k and q > 1,
                reduce="mean",
                prefill_only=True,
                rows_from_inputs=True,  # from the prompt: a captured prefill segment stages them
            )
            self.ctx.runner.prune_at(layer + 1, self._make_select(s, layer), compact=compact, ref_layer=paper + 1)

    # -- raters ----------------------------------------------------------------------------------
    def _prefill_data(self, state) -> _Prefill:
        data = state.extras.get(self.key)
        if data is not None:
            return data
        inp = state.inputs
        text = inp.text_after_image  # [B, L]
        raters = text_raters(inp.embeds, inp.image_mask, text)  # [B, R]
        n_image = image_counts(inp.image_index.masked_fill(~inp.image_mask, -1))  # [B][J]
        bsz = len(n_image)
        data = _Prefill(raters, text.sum(1), [[] for _ in range(bsz)], [[] for _ in range(bsz)], n_image)
        state.extras[self.key] = data
        return data

    def _rows(self, q_len: int, k_len: int) -> torch.Tensor:
        """The raters' slots: text after the image is the tail of every (left-padded) row."""
        state = self.ctx.runner.active
        if state is None:
            return torch.tensor([-1])
        data = self._prefill_data(state)
        rows = q_len - data.n_text[:, None] + data.raters  # [B, R]
        return rows.masked_fill(data.raters < 0, -1)

    # -- filters -----------------------------------------------------------------------------------
    def _make_select(self, stage: int, layer: int):
        key = f"{self.key}.{layer}"
        cfg = self.config

        def select(view):
            state = view.state
            data = self._prefill_data(state)
            rec = self.ctx.probe[key]
            if rec.k_len != view.group.length:
                raise RuntimeError(f"SparseVLM: stale attention record at layer {layer}")
            image = view.images  # [B, T]
            present = image_counts(image)  # [B][J] image j's slots still here: the read
            plan = []  # (sample, image, slots present, kept, recycled, clusters) of every image still present
            for b in range(len(present)):
                n_vis, n_rec = 0, 0
                for j, n in enumerate(present[b]):
                    if n == 0:
                        continue
                    n_j = data.n_image[b][j]
                    k = min(self.keeps(self.config_for(n_j), n_j)[stage], n)  # counts for this image's own N_i
                    top, n_clusters = (
                        recycled_count(n - k, cfg.recycle_ratio, cfg.cluster_divisor) if cfg.recycle else (0, 0)
                    )
                    plan.append((b, j, n, k, top, n_clusters))
                    n_vis += k + n_clusters
                    n_rec += n_clusters
                data.counts[b].append(n_vis)
                data.recycled[b].append(n_rec)
            if stage == len(self.filters) - 1:
                self._stats(state, data)
            plan = tuple(plan)
            if not plan:
                return None  # no vision token left (a branch's image-free prompt): nothing to filter
            run = self.ctx.captured
            ranks = run(("sparsevlm.ranks", plan), partial(filter_ranks, plan=plan), rec.probs, rec.rows, image)
            n_recycled = sum(p[4] for p in plan)
            hidden = view.hidden.reshape(-1, view.hidden.shape[-1])  # [B * T, d]
            recycled = hidden.index_select(0, ranks[ranks.numel() - n_recycled :])  # [sum top, d]
            out = run(("sparsevlm.edit", plan), partial(filter_edit, plan=plan), ranks, recycled, view.vision)
            if not any(p[-1] for p in plan):
                return out  # nothing recycled: a plain drop (or, keeping everything, no new group)
            keep, replace, order, places, merged = out
            new_hidden = torch.zeros_like(hidden).index_copy_(0, places, merged.to(hidden.dtype))  # [B * T, d]
            return SlotEdit(keep, replace, new_hidden.view_as(view.hidden), order)

        return select

    def _preset_per_image(self) -> bool:
        """Whether the preset's counts scale by each image's own count (no one count for every image)."""
        return self.config.keep is None and self.adapter.n_image_tokens is None

    def _stats(self, state, data: _Prefill) -> None:
        n_layers = state.n_layers
        filters = [x for x, _ in self.filters]
        n0 = state.inputs.image_mask.sum(1).tolist()

        def avg(b: int, starts: list[int], counts: list[int]) -> float:
            bounds = [0, *starts, n_layers]
            cs = [n0[b], *counts]
            return sum(c * (bounds[i + 1] - bounds[i]) for i, c in enumerate(cs)) / n_layers

        state.stats[self.name] = {
            "filter_layers": filters,
            # a budget, or a preset on images of their own counts: scaled per image (the base grid's counts were not kept)
            "keep": "per image" if self.maps_per_image or self._preset_per_image() else self.keep_counts,
            "per_sample_kept": data.counts,
            "per_sample_recycled": data.recycled,
            "per_sample_raters": (data.raters >= 0).sum(1).tolist(),
            # the release's "tokens" naming: layer l counted with its output, recycled tokens left out
            "per_sample_layer_avg_nominal": [
                avg(b, filters, [c - r for c, r in zip(data.counts[b], data.recycled[b])]) for b in range(len(n0))
            ],
        }
