"""``mmfast bench`` kind ``video_cost``: what each video pruner costs on random-weight 7B video shapes.

What it measures (issue 28, item 3). For every shape of ``bench.params.shapes`` (random-weight
Qwen2.5-VL-7B and LLaVA-OneVision-7B: :data:`mmfast.models.factory.BENCH_MODELS`, built on the device in
``bench.params.dtype``) and every frame count of ``bench.params.frames``, one clip of the video world
(:func:`mmfast.world.video_render.render_clip` at ``seed`` / ``clip`` with ``clip_frames`` (64) frames of
``image_size`` x ``image_size`` pixels: the clip ``python -m mmfast.world.video --out DIR --clips 1
--frames 64 --image-size 448 --seed 0`` writes as ``VWORLD_000001`` with the defaults) is sampled to that
many frames (``num_frames``: transformers' uniform rule, :mod:`mmfast.video`) and asked one prompt. Rows, in
one process on the same prepared inputs:

- ``unpruned``: the recipe's baseline (no pruning);
- every ``bench.methods`` x ``bench.budgets`` variant (equal budgets: a ``{ratio: r}`` keeps round(r N) of the
  video's N tokens, ``{tokens: n}`` keeps n; layer-averaged for in-LLM methods, :class:`mmfast.config.Budget`)
  and every ``bench.compare`` item (DyCoke at its own defaults: it takes no budget).

Columns per row: the prompt's tokens and the video's vision tokens at the LLM input (what the pruner kept),
their layer average in the KV cache after prefill (in-LLM methods drop inside the LLM), the KV-cache bytes
after prefill (logical: K and V of every layer's kept slots) and their ratio to unpruned, the LLM prefill
FLOPs (:mod:`mmfast.flops`, the papers' convention, the model at hand) and their ratio, TTFT (a one-token
call: video tower + prefill; median of ``bench.repeats`` after ``bench.warmup`` untimed calls), the tower's
and the LLM prefill's share of it (the pipeline's own timings, medians), and the peak memory of the row's
calls, warm-ups included (``torch.cuda.max_memory_allocated``; with the memory the row started from, so the part above the
weights shows). On a CPU peak memory is "n/a" (a process's peak RSS mixes rows and the allocator's cache).

Reduced depth (``bench.params.layers`` / ``tower_layers``): the same shapes at full width with fewer LLM
layers / tower blocks (:func:`mmfast.models.factory.reduced_shape`), for a CPU, where a 7B prefill of
thousands of video tokens takes minutes. Tokens, KV bytes and FLOPs are then per-layer quantities of the
real widths (their ratios to unpruned hold for pre-LLM methods at any depth); absolute TTFT and memory are
not the 7B model's, and in-LLM methods meet their depth floor (K N / L tokens on average, K their pruning
layer) sooner, so they are refused rows that name it. The report labels a reduced-depth table as such.
Full depth (``layers: null``) is the default, for a GPU (scripts/gpu_bench.sh, phase ``video``).

Rows are appended to ``rows.jsonl`` as they finish (the gpu_speed bench's :class:`RowStore`): a re-run with
the same output directory keeps the rows whose settings are unchanged. A variant a shape cannot run is a
"refused" row with the reason; an unexpected error a "failed" row (logged with its traceback; re-run on
resume). Tested in tests/test_video_cost.py.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import gc
import hashlib
import json
import logging
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from ..config import Recipe
from ..errors import InputError
from ..model import MMModel
from ..models.factory import BENCH_MODELS, build_bench_model, check_cpu_build_fits, reduced_shape
from ..pipeline import apply
from ..video import VideoSampling, open_video
from ..world.video_render import MAX_FRAMES, MIN_FRAMES, VideoConfig, render_clip
from .common import Variant, row_recipe, variants, warm_repeats
from .gpu_speed import DeviceInfo, RowStore, measure_row
from .pruning import _untrained
from .render import budget_text

logger = logging.getLogger(__name__)

UNPRUNED = "unpruned"
PROMPT = "Describe what happens in the video."
VIDEO_FAMILIES = ("qwen2_5_vl", "llava_onevision")


@dataclass
class VideoRow:
    """One finished row (a line of rows.jsonl): one variant on one (shape, frame count)."""

    shape: str
    frames: int
    row: str
    settings: str  # fingerprint of everything the numbers depend on (resume reuses matching rows only)
    status: str = "ok"  # ok | refused: ... | failed: ...
    budget: str = ""  # the budget asked for ("ratio 0.25", "tokens 512"; "" without one)
    repeats: int = 0
    prompt_tokens: int | None = None  # tokens at the LLM input (text + vision)
    vision_tokens: int | None = None  # the video's tokens at the LLM input (what a pre-LLM pruner kept)
    layer_avg: float | None = None  # layer-averaged vision tokens in the KV cache after prefill
    kv_bytes: int | None = None  # KV cache after prefill (logical bytes, all layers)
    flops: float | None = None  # LLM prefill FLOPs (papers' convention, the model at hand)
    ttft_s: float | None = None  # median one-token call: tower + prefill
    vision_s: float | None = None  # median tower time inside it
    prefill_s: float | None = None  # median LLM prefill time inside it
    start_mem_bytes: int | None = None  # CUDA memory allocated when the row began (the model)
    peak_mem_bytes: int | None = None  # CUDA peak of the row's calls

    @property
    def key(self) -> tuple[str, int, str]:
        return (self.shape, self.frames, self.row)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass(frozen=True)
class VideoCostParams:
    shapes: tuple[str, ...]
    frames: tuple[int, ...]
    image_size: int
    seed: int
    clip: int
    clip_frames: int  # frames of the rendered clip (every frame count samples it)
    layers: int | None  # LLM layers (None: the shape's own depth)
    tower_layers: int | None  # vision-tower blocks (None: the shape's own depth)
    dtype: torch.dtype
    rows: tuple[str, ...]  # fnmatch patterns of row names
    prompt: str

    @classmethod
    def of(cls, recipe: Recipe) -> VideoCostParams:
        """The bench's parameters, checked before anything is built (InputError names the key and the fix)."""
        p = recipe.bench.params
        shapes = tuple(p.get("shapes", ("qwen2.5-vl-7b", "llava-onevision-7b")))
        video_shapes = [k for k, s in BENCH_MODELS.items() if s.family in VIDEO_FAMILIES]
        for i, s in enumerate(shapes):
            if s not in video_shapes:
                close = difflib.get_close_matches(s, video_shapes, n=1)
                raise InputError(
                    f"bench.params.shapes[{i}]: {s!r} is not a video shape"
                    + (f"; did you mean {close[0]!r}?" if close else "")
                    + f" (video shapes: {', '.join(video_shapes)})"
                )
        clip_len = int(p.get("clip_frames", MAX_FRAMES))
        if not MIN_FRAMES <= clip_len <= MAX_FRAMES:
            raise InputError(f"bench.params.clip_frames: must be in [{MIN_FRAMES}, {MAX_FRAMES}], got {clip_len}")
        frames = tuple(int(f) for f in p.get("frames", (16, 64)))
        if not frames or any(not 1 <= f <= clip_len for f in frames):
            raise InputError(
                f"bench.params.frames: frame counts must be in [1, {clip_len}] (bench.params.clip_frames, the "
                f"clip's length), got {list(frames)}"
            )
        layers, tower = p.get("layers"), p.get("tower_layers")
        for s in shapes:  # a depth the shape does not have is refused now, not after a 7B build
            try:
                reduced_shape(BENCH_MODELS[s], layers, tower)
            except ValueError as exc:
                raise InputError(f"bench.params.layers / tower_layers: {exc}") from None
        return cls(
            shapes,
            frames,
            int(p.get("image_size", 448)),
            int(p.get("seed", 0)),
            int(p.get("clip", 1)),
            clip_len,
            None if layers is None else int(layers),
            None if tower is None else int(tower),
            getattr(torch, p.get("dtype", "float16")),
            tuple(p.get("rows", ("*",))),
            str(p.get("prompt", PROMPT)),
        )

    @property
    def reduced(self) -> bool:
        return self.layers is not None or self.tower_layers is not None

    def wants(self, row: str) -> bool:
        return row == UNPRUNED or any(fnmatch.fnmatchcase(row, pat) for pat in self.rows)

    def depth(self, shape: str) -> tuple[int, int, int, int]:
        """(LLM layers run, of the shape's, tower blocks run, of the shape's)."""
        full = reduced_shape(BENCH_MODELS[shape])
        run = reduced_shape(BENCH_MODELS[shape], self.layers, self.tower_layers)
        return run.text_layers, full.text_layers, run.vision_layers, full.vision_layers


def clip_frames(cp: VideoCostParams) -> list[Image.Image]:
    """The video world's clip ``cp.clip`` of world seed ``cp.seed``, ``cp.clip_frames`` frames of
    ``cp.image_size`` pixels (each frame count of the bench samples it uniformly)."""
    cfg = VideoConfig(frames=cp.clip_frames, image_size=cp.image_size)
    return list(render_clip(cp.seed, cp.clip, cfg).frames)


def video_tokens(mm: MMModel, frames: list[Image.Image], n: int) -> int:
    """The video's vision tokens before any pruning (the processor's count) with ``n`` frames sampled."""
    clip = open_video(frames, VideoSampling(num_frames=n), mm.adapter.frame_rule(mm.video_settings))
    return mm.adapter.video_items(clip, 0, mm.video_settings).tokens


def _settings(info: DeviceInfo, cp: VideoCostParams, recipe: Recipe, shape: str, frames: int, row: Any) -> str:
    blob = json.dumps(
        {
            "device": info.name,
            "torch": info.torch,
            "transformers": info.transformers,
            "dtype": str(cp.dtype),
            "warmup": recipe.bench.warmup,
            "repeats": recipe.bench.repeats,
            "shape": repr(reduced_shape(BENCH_MODELS[shape], cp.layers, cp.tower_layers)),
            "clip": [cp.seed, cp.clip, cp.image_size, cp.clip_frames],
            "frames": frames,
            "prompt": cp.prompt,
            "row": row,
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _text_tokens(mm: MMModel, batch: Any) -> int:
    """Sample 0's text tokens: its token ids hold one placeholder per vision item (expanded at the LLM input)."""
    ids = batch.token_ids[0]
    vision = {mm.adapter.image_token_id, mm.adapter.video_token_id}
    return sum(1 for t in ids if t not in vision)


def _measure_row(mm: MMModel, batch: Any, text_tokens: int, v: Variant, warmup: int, repeats: int, m: VideoRow) -> None:
    """Warm-up, then ``repeats`` timed one-token calls of ``v``'s recipe on ``batch``; fills ``m``."""
    cuda = mm.device.type == "cuda"
    with apply(mm, _untrained(v.recipe)) as session:  # trained parts (HICom's guide): seeded stand-ins
        if cuda:
            torch.cuda.synchronize(mm.device)
            torch.cuda.reset_peak_memory_stats(mm.device)
            m.start_mem_bytes = torch.cuda.memory_allocated(mm.device)
        timed = warm_repeats(lambda: session.run(batch, max_new_tokens=1), warmup, repeats)
        if cuda:
            m.peak_mem_bytes = torch.cuda.max_memory_allocated(mm.device)
    results = [res[0] for _, res in timed]  # [repeats] GenerationResult of the one sample
    last = results[-1]
    m.repeats = len(timed)
    m.ttft_s = statistics.median(t for t, _ in timed)
    m.vision_s = statistics.median(r.timings.vision_s for r in results)
    m.prefill_s = statistics.median(r.timings.prefill_s for r in results)
    m.vision_tokens = last.n_vision_tokens
    m.layer_avg = last.vision_tokens_layer_avg
    m.kv_bytes = last.kv_bytes_prefill
    m.flops = last.flops_prefill
    m.prompt_tokens = text_tokens + last.n_vision_tokens


def run_video_cost(recipe: Recipe, out: Path, command: str) -> dict[str, Any]:
    """Run the bench into ``out`` (rows.jsonl as rows finish; results.md and summary.json after each)."""
    cfg = recipe.bench
    cp = VideoCostParams.of(recipe)
    vs = [Variant(UNPRUNED, variants(recipe)[0].recipe), *variants(recipe, include_baseline=False)]
    want = recipe.model.device
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if want == "auto" else want)
    info = DeviceInfo.detect(device, {})
    store = RowStore(out / "rows.jsonl", VideoRow)
    plan: dict[tuple, tuple[Variant, str]] = {}
    for shape in cp.shapes:
        for f in cp.frames:
            for v in vs:
                if cp.wants(v.name):
                    plan[(shape, f, v.name)] = (v, _settings(info, cp, recipe, shape, f, row_recipe(v.recipe)))
    store.prune({k: s for k, (_, s) in plan.items()})

    def report() -> dict[str, Any]:
        return write_report(recipe, cp, info, store, out, command, list(plan))

    for shape_name in cp.shapes:  # a shape too big for the CPU's memory is refused before any compute
        if any(k[0] == shape_name and store.done(k, s) is None for k, (_, s) in plan.items()):
            check_cpu_build_fits(shape_name, device, text_layers=cp.layers, vision_layers=cp.tower_layers)
    frames = clip_frames(cp) if any(store.done(k, s) is None for k, (_, s) in plan.items()) else []
    for shape_name in cp.shapes:
        todo = [k for k, (_, s) in plan.items() if k[0] == shape_name and store.done(k, s) is None]
        if not todo:
            logger.info("video cost: %s: every selected row is already in %s", shape_name, store.path)
            continue
        t0 = time.perf_counter()
        model, processor = build_bench_model(
            shape_name,
            device=device,
            dtype=cp.dtype,
            init_std=0.02 if cp.dtype != torch.float32 else 0.2,
            text_layers=cp.layers,
            vision_layers=cp.tower_layers,
        )
        mm = MMModel(model, processor, shape_name)
        logger.info("video cost: built %s on %s in %.1f s", shape_name, device, time.perf_counter() - t0)
        try:
            batches = {f: mm.prepare(None, [cp.prompt], videos=[frames], num_frames=f) for f in cp.frames}
            for key in todo:
                _, f, name = key
                v, settings = plan[key]
                m = VideoRow(
                    shape_name, f, name, settings, budget=budget_text([st._to_recipe() for st in v.recipe.pruning])
                )
                label = f"video cost: {shape_name}, {f} frames: {name}"
                logger.info("%s", label)
                batch = batches[f]
                measure_row(m, label, _measure_row, mm, batch, _text_tokens(mm, batch), v, cfg.warmup, cfg.repeats, m)
                store.add(m)
                report()
        finally:
            del mm, model
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    store.log_failed("video cost", lambda m: f"{m.shape} {m.frames}f {m.row}")
    return report()


# -- report ----------------------------------------------------------------------------------------
HEADER = [
    "shape",
    "frames",
    "row",
    "status",
    "budget",
    "prompt tok",
    "vision tok @LLM",
    "kept %",
    "layer-avg vision tok",
    "KV MiB after prefill",
    "KV ratio",
    "prefill TFLOPs",
    "FLOPs ratio",
    "TTFT ms",
    "tower ms",
    "LLM prefill ms",
    "peak mem GiB",
    "above start GiB",
    "repeats",
]


def _fmt(v: float | None, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def table_rows(store: RowStore, order: list[tuple]) -> list[list[str]]:
    """The table's cells, rows in the plan's order (shape, frames, row), stored rows of other plans after."""
    rows = store.rows
    keys = [k for k in order if k in rows] + sorted(k for k in rows if k not in order)
    out = []
    for key in keys:
        m = rows[key]
        if not m.ok:
            out.append([m.shape, str(m.frames), m.row, m.status, m.budget] + [""] * (len(HEADER) - 5))
            continue
        base = rows.get((m.shape, m.frames, UNPRUNED))
        base = base if base is not None and base.ok else None
        gib = 2**30
        out.append(
            [
                m.shape,
                str(m.frames),
                m.row,
                "ok",
                m.budget,
                _fmt(m.prompt_tokens, "d"),
                _fmt(m.vision_tokens, "d"),
                _fmt(100 * m.vision_tokens / base.vision_tokens if base and base.vision_tokens else None, ".1f"),
                _fmt(m.layer_avg, ".1f"),
                _fmt(m.kv_bytes / 2**20 if m.kv_bytes is not None else None, ".1f"),
                _fmt(_ratio(m.kv_bytes, base.kv_bytes if base else None), ".3f"),
                _fmt(m.flops / 1e12 if m.flops is not None else None, ".3f"),
                _fmt(_ratio(m.flops, base.flops if base else None), ".3f"),
                _fmt(m.ttft_s * 1000 if m.ttft_s is not None else None, ".1f"),
                _fmt(m.vision_s * 1000 if m.vision_s is not None else None, ".1f"),
                _fmt(m.prefill_s * 1000 if m.prefill_s is not None else None, ".1f"),
                _fmt(m.peak_mem_bytes / gib if m.peak_mem_bytes is not None else None, ".2f"),
                _fmt(
                    (m.peak_mem_bytes - m.start_mem_bytes) / gib
                    if m.peak_mem_bytes is not None and m.start_mem_bytes is not None
                    else None,
                    ".2f",
                ),
                str(m.repeats),
            ]
        )
    return out


def write_report(
    recipe: Recipe, cp: VideoCostParams, info: DeviceInfo, store: RowStore, out: Path, command: str, order: list
) -> dict[str, Any]:
    """``results.md`` and ``summary.json`` of the rows stored so far."""
    depth = {s: cp.depth(s) for s in cp.shapes}
    lines = ["# Video cost bench: video pruners on random-weight 7B video shapes", ""]
    if cp.reduced:
        lines += [
            "**REDUCED DEPTH, full widths:** "
            + "; ".join(f"{s}: {a} of {b} LLM layers, {c} of {d} tower blocks" for s, (a, b, c, d) in depth.items())
            + ". Vision tokens, KV bytes and FLOPs are those of this depth (per layer: the 7B widths); their ratios "
            "to unpruned carry over to full depth for methods that prune before the LLM. Absolute TTFT and memory "
            "are NOT the 7B model's, and in-LLM methods are refused sooner (their depth floor).",
            "",
        ]
    lines += [f"Command: `{command}`", ""]
    lines += [
        f"Device: **{info.name}**; torch {info.torch}; CUDA {info.cuda or 'n/a'}; transformers {info.transformers}; "
        f"dtype {str(cp.dtype).replace('torch.', '')}; warm-up {recipe.bench.warmup}, median of {recipe.bench.repeats} repeats.",
        "",
        f"Input: the video world's clip {cp.clip} (world seed {cp.seed}, {cp.clip_frames} frames of {cp.image_size} x "
        f"{cp.image_size} px: `python -m mmfast.world.video --out DIR --clips {cp.clip} --frames {cp.clip_frames} "
        f"--image-size {cp.image_size} --seed {cp.seed}`), sampled uniformly to each frame count; prompt {cp.prompt!r}; "
        "batch 1, one new token (TTFT).",
        "",
    ]
    if info.name.startswith("cpu"):
        lines += [
            "No GPU ran this table: GPU rows (full depth, fp16) are unmeasured here; scripts/gpu_bench.sh phase "
            "`video` runs them on a lent GPU.",
            "",
        ]
    failed = [m for m in store.rows.values() if m.status.startswith("failed")]
    if failed:
        lines += [f"**{len(failed)} rows failed** (status column; they re-run when the same command runs again).", ""]
    cells = table_rows(store, order)
    lines += ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(r) + " |" for r in cells]
    lines += [
        "",
        "Notes:",
        "",
        "- vision tok @LLM: the video's tokens entering the LLM (what a pre-LLM pruner kept; DyCoke: what its TTM "
        "kept, its decode-time pruning does not act in a one-token call); kept %: of the unpruned row's. "
        "layer-avg vision tok: the layer average held in the KV cache after prefill (in-LLM methods drop inside the LLM).",
        "- KV MiB after prefill: K and V of every layer's kept slots (logical bytes). prefill TFLOPs: the LLM's "
        "4nd^2 + 2n^2d + 3ndm per layer (mmfast.flops), vision tower excluded; ratios are to the unpruned row of "
        "the same shape and frame count.",
        "- TTFT: a one-token call (video tower + LLM prefill), median after the warm-up; tower ms and LLM prefill "
        "ms: the pipeline's own timings inside it. peak mem: torch.cuda.max_memory_allocated over the row's calls, "
        "above start: minus the memory allocated when the row began (the model); n/a on a CPU.",
        "- Random weights: only costs are measured (no accuracy: no shipped model was trained on video).",
    ]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    summary = {
        "kind": "video_cost",
        "device": dataclasses.asdict(info),
        "dtype": str(cp.dtype),
        "reduced_depth": {
            s: dict(zip(("layers", "of_layers", "tower_layers", "of_tower"), d)) for s, d in depth.items()
        }
        if cp.reduced
        else None,
        "clip": {"seed": cp.seed, "clip": cp.clip, "image_size": cp.image_size, "frames": cp.clip_frames},
        "rows": [dataclasses.asdict(m) for m in store.rows.values()],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary
