"""``mmfast bench`` kind ``gpu_speed``: full-depth random-weight models, HF ``generate`` and mmfast, one process.

What it measures (issue 27, item 4). For every shape of ``bench.params.shapes`` (full-depth random-weight
LLaVA-1.5-7B, LLaVA-NeXT-7B anyres, Qwen2.5-VL-7B, LLaVA-OneVision-7B anyres-max:
:data:`mmfast.models.factory.BENCH_MODELS`, built on
the device in ``bench.params.dtype``), every batch size of ``bench.params.batches`` and every workload
(``pope``: a one-token answer; ``caption``: ``bench.params.caption_tokens`` new tokens), these rows run on
the same prepared inputs:

- ``hf eager``: the HF model's own ``generate`` (dynamic cache);
- ``hf static``: ``generate(cache_implementation="static")`` (on CUDA transformers compiles the decode
  step itself; on a CPU it runs uncompiled, transformers' own rule);
- ``mmfast unpruned``: the recipe's baseline through mmfast's generate path (``Session.run``) with
  ``model.compile: off`` (the dynamic cache, eager steps);
- ``mmfast unpruned (compiled)``: the same with ``model.compile: auto`` (a static cache; on CUDA each decode
  step one captured graph);
- ``mmfast unpruned (fused norms)``: the compiled twin with ``model.fuse_norms: true`` (the language model's
  RMSNorm modules as one Inductor kernel each, mmfast/models/fused_norms.py);
- every ``bench.compare`` / ``bench.methods`` x ``bench.budgets`` variant with the bench recipe's own
  ``model.compile`` (``auto`` in configs/bench/gpu_speed.yaml; a method that cannot be captured runs its
  eager step and says why in the log) (pruners at 192 / 128 / 64,
  drafters, DivPrune-64 + FLASH). Trained parts run on seeded random stand-ins of the same sizes (as the
  pruning bench's shaped phase), drafts on random draft weights: only their cost is measured here; a
  drafter's projected decode speedup uses the tau that the embedded model measures in the same run.

Timing: a warm-up call (its wall time is the "first call" column: compile and capture land there, never in
the medians), then the median of ``bench.repeats`` calls; CUDA events on a GPU (synchronised), perf_counter
on a CPU. TTFT = a call with one new token (vision tower + prefill); end to end = a call with the workload's
tokens; decode ms/step = (end to end - TTFT) / (tokens - 1). EOS lies outside the vocabulary of these
random models, so every row generates exactly the workload's tokens. Columns derived from the device's
peaks (:data:`DEVICE_PEAKS`, overridable with ``bench.params.peak_bandwidth_tbs`` / ``peak_tflops``):
decode fraction of the memory-bandwidth limit = (LLM weight bytes + mean KV bytes) / (step time x peak
bandwidth); prefill fraction of peak FLOP/s = prefill FLOPs (:mod:`mmfast.flops`) / (prefill time x peak).
On a CPU both are "n/a", as is peak memory (``torch.cuda.max_memory_allocated``).

The embedded model's part: greedy decoding (compiled, "the captured greedy step", when ``model.compile``
exists) against every drafter of the recipe on the same caption prompts (batch 1), with real tau.

Rows run in the order shape, workload, batch, row (the table sorts them by shape, batch, workload) and are
appended to ``rows.jsonl`` as they finish; a re-run with the same output directory keeps the rows
whose settings (device, dtype, warm-up, repeats, tokens, the row's recipe) are unchanged and runs the rest,
so a run killed by a time limit loses at most the row in flight. ``results.md`` and ``summary.json`` are
rewritten after every row. The issue's targets are checked at the end (pass / fail / not measured).

Selection (``bench.params``): ``shapes``, ``batches``, ``workloads``, ``rows`` (fnmatch patterns of row
names), ``embedded_rows`` (the drafters run on the embedded model; default: ``rows``), ``embedded_speculative``.

Limits and deviations: HF rows time inputs already on the device, mmfast rows move the pixels themselves
(both exclude the image processor); speculative decoding verifies one sample at a time, so its batch rows are
serial; HF static-cache KV bytes are counted for live tokens, not the whole buffer; a variant a shape cannot
run is a "refused" row with the reason (PyramidDrop's default stages at layers 8/16/24 cannot average 64
tokens on 32 layers); an unexpected error is a "failed" row (logged with its traceback, re-run on resume).
Measured on an H100: benchmarks/gpu_speed/ (scripts/gpu_bench.sh); the CPU path is tested in tests/test_gpu_bench.py.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import gc
import hashlib
import json
import logging
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from PIL import Image

from ..config import Recipe, load_recipe
from ..errors import InputError, MMFastError
from ..eval.data import resolve_data
from ..flops import LMShape, prefill_flops
from ..model import MMModel, load_model
from ..models.factory import BENCH_MODELS, build_bench_model, check_cpu_build_fits
from ..pipeline import apply
from ..pruning._budget import CalibrationSet
from ..speculative._eagle_model import write_random_draft
from .common import Variant, row_recipe, variants
from .pruning import _untrained
from .render import budget_text

logger = logging.getLogger(__name__)

#: (peak memory bandwidth B/s, dense fp16/bf16 FLOP/s) by a substring of the CUDA device name, first match wins
DEVICE_PEAKS: tuple[tuple[str, float, float], ...] = (
    ("H200", 4.8e12, 989e12),
    ("H100 PCIe", 2.0e12, 756e12),
    ("H100", 3.35e12, 989e12),  # SXM
)
HF_EAGER, HF_STATIC = "hf eager", "hf static"
UNPRUNED, COMPILED = "mmfast unpruned", "mmfast unpruned (compiled)"
FUSED = "mmfast unpruned (fused norms)"  # compiled + model.fuse_norms (mmfast/models/fused_norms.py)
WORKLOAD_PROMPTS = {
    "pope": "Is there a dog in the image?\nAnswer the question using a single word or phrase.",
    "caption": "Please describe this image in detail.",
}
EMBEDDED = "embedded"


@dataclass(frozen=True)
class DeviceInfo:
    name: str
    torch: str
    cuda: str | None
    transformers: str
    peak_bandwidth: float | None  # bytes / s
    peak_flops: float | None  # FLOP / s

    @classmethod
    def detect(cls, device: torch.device, params: dict[str, Any]) -> DeviceInfo:

        bw = flops = None
        if device.type == "cuda":
            name = torch.cuda.get_device_name(device)
            match = next((p for p in DEVICE_PEAKS if p[0] in name), None)
            if match:
                bw, flops = match[1], match[2]
            if "peak_bandwidth_tbs" in params:
                bw = float(params["peak_bandwidth_tbs"]) * 1e12
            if "peak_tflops" in params:
                flops = float(params["peak_tflops"]) * 1e12
        else:  # peak fractions of a CPU are not what this bench is for: n/a
            name = f"cpu ({platform.processor() or platform.machine()})"
        return cls(name, torch.__version__, torch.version.cuda, transformers.__version__, bw, flops)


@dataclass
class Measurement:
    """One finished row (one line of rows.jsonl). Times in seconds, sums over the batch."""

    shape: str
    batch: int
    workload: str
    row: str
    settings: str  # fingerprint of everything the numbers depend on (resume reuses matching rows only)
    status: str = "ok"  # ok | refused: ... | failed: ... | not available ...
    new_tokens: int = 0
    repeats: int = 0  # timed calls behind each median
    first_call_s: float | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    prefill_s: float | None = None  # LLM prefill alone (mmfast rows)
    peak_mem_bytes: int | None = None
    n_vision_tokens: float | None = None  # per sample, at the LLM input
    flops_prefill: float | None = None  # papers' convention, summed over the batch
    kv_bytes_mean: float | None = None  # KV cache bytes read per decode step (mean over the answer), batch sum
    weight_bytes: int | None = None  # LLM weights read per decode step
    cycles: int | None = None  # speculative verification cycles (sum over the batch)
    tau: float | None = None  # measured tokens per verification (random drafts here; real on the embedded model)
    tokens_sha: str | None = None  # hash of the greedy tokens of every sample
    capture_s: float | None = None  # graph capture inside the first call (model.compile: auto)
    # graph capture inside the timed calls: none while the graphs kept between calls serve them
    capture_timed_s: float | None = None

    @property
    def key(self) -> tuple[str, int, str, str]:
        return (self.shape, self.batch, self.workload, self.row)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def decode_step_s(self) -> float | None:
        if not self.ok or self.new_tokens < 2 or self.e2e_s is None or self.ttft_s is None:
            return None
        return max(0.0, self.e2e_s - self.ttft_s) / (self.new_tokens - 1)

    @property
    def tokens_per_s(self) -> float | None:
        return self.batch * self.new_tokens / self.e2e_s if self.ok and self.e2e_s else None


@dataclass(frozen=True)
class GpuBenchParams:
    shapes: tuple[str, ...]
    batches: tuple[int, ...]
    workloads: tuple[str, ...]
    caption_tokens: int
    rows: tuple[str, ...]  # fnmatch patterns of row names ("*": all)
    dtype: torch.dtype
    embedded: bool
    embedded_samples: int
    embedded_rows: tuple[str, ...]  # drafters run on the embedded model (fnmatch patterns)

    @classmethod
    def of(cls, recipe: Recipe) -> GpuBenchParams:

        p = recipe.bench.params
        shapes = tuple(p.get("shapes", ("llava-1.5-7b", "llava-next-7b", "qwen2.5-vl-7b", "llava-onevision-7b")))
        for i, s in enumerate(shapes):
            if s not in BENCH_MODELS:
                close = difflib.get_close_matches(s, list(BENCH_MODELS), n=1)
                raise InputError(
                    f"bench.params.shapes[{i}]: unknown shape {s!r}"
                    + (f"; did you mean {close[0]!r}?" if close else "")
                    + f" (known: {', '.join(BENCH_MODELS)})"
                )
        workloads = tuple(p.get("workloads", ("pope", "caption")))
        for i, w in enumerate(workloads):
            if w not in WORKLOAD_PROMPTS:
                raise InputError(
                    f"bench.params.workloads[{i}]: unknown workload {w!r} (known: {', '.join(WORKLOAD_PROMPTS)})"
                )
        batches = tuple(int(b) for b in p.get("batches", (1, 8, 32)))
        if any(b < 1 for b in batches):
            raise InputError("bench.params.batches: batch sizes must be >= 1")
        rows = tuple(p.get("rows", ("*",)))
        counts = {
            "caption_tokens": int(p.get("caption_tokens", 128)),
            "embedded_samples": int(p.get("embedded_samples", 4)),
        }
        for key, n in counts.items():  # every caption row would be refused one by one, after each model build
            if n < 1:
                raise InputError(f"bench.params.{key}: must be >= 1, got {n}")
        return cls(
            shapes,
            batches,
            workloads,
            counts["caption_tokens"],
            rows,
            getattr(torch, p.get("dtype", "float16")),
            bool(p.get("embedded_speculative", True)),
            counts["embedded_samples"],
            tuple(p.get("embedded_rows", rows)),
        )

    def tokens(self, workload: str) -> int:
        return 1 if workload == "pope" else self.caption_tokens

    def wants(self, row: str, embedded: bool = False) -> bool:
        return any(fnmatch.fnmatchcase(row, pat) for pat in (self.embedded_rows if embedded else self.rows))


# -- timing --------------------------------------------------------------------------------------
def _timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    """Wall time of ``fn()``: CUDA events around it on a GPU (synchronised), perf_counter on a CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1000, out
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


@dataclass
class _Timing:
    first_call_s: float
    ttft_s: float
    e2e_s: float
    repeats: int
    last: Any  # the last end-to-end call's output
    peak_mem_bytes: int | None

    def into(self, m: Measurement) -> None:
        """Write these timings into row ``m``."""
        m.first_call_s, m.ttft_s, m.e2e_s, m.repeats, m.peak_mem_bytes = (
            self.first_call_s,
            self.ttft_s,
            self.e2e_s,
            self.repeats,
            self.peak_mem_bytes,
        )


def _measure(call: Callable[[int], Any], n: int, device: torch.device, warmup: int, repeats: int) -> _Timing:
    """First call (compile / capture included), warm-up, then medians of TTFT (1 token) and end to end (n)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    first, _ = _timed(lambda: call(n), device)
    for _ in range(max(0, warmup - 1)):
        call(n)
    if n > 1:  # a one-token call has its own shapes (e.g. a static cache's length): warm it up too
        for _ in range(max(1, warmup)):
            call(1)
    ttfts, e2es, last, last1 = [], [], None, None
    for _ in range(repeats):
        t, last1 = _timed(lambda: call(1), device)
        ttfts.append(t)
        if n > 1:
            t, last = _timed(lambda: call(n), device)
            e2es.append(t)
    if n == 1:
        e2es, last = ttfts, last1
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return _Timing(first, statistics.median(ttfts), statistics.median(e2es), repeats, last, peak)


def _capture_cell(m: Measurement) -> str:
    if m.capture_s is None and not m.capture_timed_s:  # nothing captured (a CPU, an HF row, model.compile: off)
        return "n/a"
    first = _fmt(m.capture_s * 1000 if m.capture_s else 0.0, ".1f")
    return f"{first} / {_fmt((m.capture_timed_s or 0.0) * 1000, '.1f')}" if m.capture_timed_s is not None else first


def _sha(rows: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]


# -- rows ------------------------------------------------------------------------------------------
@dataclass
class _Shape:
    """A built shape: the model, its inputs per (batch, workload), and what the derived columns need."""

    name: str
    mm: Any
    images: list
    weight_bytes: int
    kv_bytes_per_token: int  # K + V over all layers, one token
    calibration: Any
    draft_dir: tempfile.TemporaryDirectory
    drafts: dict[str, str] = field(default_factory=dict)
    batches: dict[tuple[int, str], Any] = field(default_factory=dict)

    def batch(self, b: int, workload: str):
        if (b, workload) not in self.batches:
            prompt = WORKLOAD_PROMPTS[workload]
            self.batches[(b, workload)] = self.mm.prepare(
                [self.images[i % len(self.images)] for i in range(b)], [prompt] * b
            )
        return self.batches[(b, workload)]


def _build_shape(name: str, device: torch.device, dtype: torch.dtype, n_images: int) -> _Shape:

    t0 = time.perf_counter()
    model, processor = build_bench_model(
        name, device=device, dtype=dtype, init_std=0.02 if dtype != torch.float32 else 0.2
    )
    mm = MMModel(model, processor, name)
    logger.info("gpu bench: built %s on %s in %.1f s", name, device, time.perf_counter() - t0)
    h, w = BENCH_MODELS[name].image
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for _ in range(n_images)]
    tmp = tempfile.TemporaryDirectory(prefix="mmfast-gpu-bench-")
    paths = []
    for i, im in enumerate(images[:2]):
        paths.append(str(Path(tmp.name) / f"calib{i}.png"))
        im.save(paths[-1])
    calibration = CalibrationSet(tuple(paths), (WORKLOAD_PROMPTS["pope"],) * len(paths))
    params = [p for layer in mm.adapter.layers for p in layer.parameters()] + list(mm.adapter.lm_head.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in params)
    tc = model.config.get_text_config()
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    kv_per_token = 2 * tc.num_hidden_layers * tc.num_key_value_heads * head_dim * torch.finfo(dtype).bits // 8
    return _Shape(name, mm, images, weight_bytes, kv_per_token, calibration, tmp)


def _hf_call(shape: _Shape, batch, static: bool) -> tuple[Callable[[int], Any], dict[str, Any]]:
    mm = shape.mm
    flat = [im for ims in batch.images for im in ims]
    processed = mm.processor(images=flat, text=batch.texts, return_tensors="pt", padding=True)
    # [B, L] ids and mask, the pixels (and image sizes / grids) on the model's device, float pixels in its dtype
    inputs = {
        k: (v.to(mm.device, mm.dtype) if v.is_floating_point() else v.to(mm.device)) if torch.is_tensor(v) else v
        for k, v in dict(processed).items()
    }
    kw: dict[str, Any] = {"do_sample": False, "pad_token_id": mm.pad_token_id}
    if static:
        kw["cache_implementation"] = "static"
    n_in = inputs["input_ids"].shape[1]

    @torch.inference_mode()
    def call(n: int):
        return mm.model.generate(**inputs, max_new_tokens=n, **kw)[:, n_in:].tolist()

    lengths = inputs["attention_mask"].sum(1).tolist()
    n_vision = (inputs["input_ids"] == mm.adapter.image_token_id).sum(1).float().mean().item()
    return call, {"lengths": lengths, "n_vision": n_vision}


def _variant_recipe(v: Variant, shape: _Shape, model: dict[str, Any] | None) -> Recipe:
    """The variant's recipe with trained parts swapped for random stand-ins (and random draft weights)."""

    recipe = _untrained(v.recipe)
    data = recipe.to_dict()
    spec = recipe.speculative
    if spec is not None and spec.method in ("msd", "flash"):
        if spec.method not in shape.drafts:
            shape.drafts[spec.method] = str(
                write_random_draft(shape.mm, spec.method, Path(shape.draft_dir.name) / spec.method)
            )
        data["speculative"] = dict(
            data["speculative"],
            params={**(data["speculative"].get("params") or {}), "weights": shape.drafts[spec.method]},
        )
    if model:  # the row's model keys (_row_model)
        data["model"] = dict(data["model"], **model)
    return load_recipe(data)


def _mmfast_row(
    shape: _Shape, v: Variant, b: int, workload: str, n: int, cfg, model: dict[str, Any] | None, m: Measurement
) -> None:

    batch = shape.batch(b, workload)
    recipe = _variant_recipe(v, shape, model)
    prefills: list[float] = []  # the LLM prefill of every one-token call (the pipeline's own timing)
    captures: list[float] = []  # graph capture inside each call, in call order

    def call(k: int):
        res = session.run(batch, max_new_tokens=k)
        if k == 1:
            prefills.append(res[0].timings.prefill_s)
        captures.append(res[0].stats.get("capture_s", 0.0))
        return res

    with apply(shape.mm, recipe, calibration=shape.calibration) as session:
        t = _measure(call, n, shape.mm.device, cfg.warmup, cfg.repeats)
    res = t.last
    t.into(m)
    m.prefill_s = statistics.median(prefills[-cfg.repeats :])  # the timed TTFT calls are the last ones
    m.n_vision_tokens = sum(r.n_vision_tokens for r in res) / len(res)
    m.flops_prefill = sum(r.flops_prefill for r in res)
    kv = [(r.kv_bytes_prefill + r.kv_bytes_end) / 2 for r in res]
    m.kv_bytes_mean = sum(kv) if all(kv) else None
    m.weight_bytes = shape.weight_bytes
    m.tokens_sha = _sha([r.token_ids for r in res])
    timed = cfg.repeats * (2 if n > 1 else 1)  # the last calls
    m.capture_s = captures[0] or None
    m.capture_timed_s = sum(captures[-timed:])
    spec = [r.stats.get("speculative") for r in res if r.stats.get("speculative")]
    if spec:
        m.cycles = sum(s["cycles"] for s in spec)
        m.tau = sum(s["committed"] for s in spec) / m.cycles if m.cycles else None


def _hf_row(shape: _Shape, b: int, workload: str, n: int, cfg, static: bool, m: Measurement) -> None:

    call, info = _hf_call(shape, shape.batch(b, workload), static)
    t = _measure(call, n, shape.mm.device, cfg.warmup, cfg.repeats)
    t.into(m)
    lm = LMShape.of(shape.mm.model.config.get_text_config())
    m.flops_prefill = sum(prefill_flops([L] * lm.n_layers, lm) for L in info["lengths"])
    m.n_vision_tokens = info["n_vision"]
    m.kv_bytes_mean = sum((L + n / 2) * shape.kv_bytes_per_token for L in info["lengths"])
    m.weight_bytes = shape.weight_bytes
    m.tokens_sha = _sha(t.last)


def _settings(device: DeviceInfo, dtype: torch.dtype, cfg, n: int, row_spec: Any) -> str:
    blob = json.dumps(
        {
            "device": device.name,
            "torch": device.torch,
            "transformers": device.transformers,
            "dtype": str(dtype),
            "warmup": cfg.warmup,
            "repeats": cfg.repeats,
            "new_tokens": n,
            "row": row_spec,
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


class RowStore:
    """``rows.jsonl``: one line per finished row, appended as it finishes; on a re-run the rows whose
    settings still match are kept (stale ones dropped, a torn last line ignored), failed rows re-run.
    ``row_type``: the dataclass of a row (:class:`Measurement`; the video cost bench's ``VideoRow``), with
    ``key``, ``settings`` and ``status``."""

    def __init__(self, path: Path, row_type: type = Measurement) -> None:
        self.path = path
        self.rows: dict[tuple, Any] = {}
        if path.exists():
            for i, line in enumerate(path.read_text().splitlines()):
                try:
                    m = row_type(**json.loads(line))
                except (json.JSONDecodeError, TypeError) as exc:
                    logger.warning("bench: %s line %d unreadable (%s), that row re-runs", path, i + 1, exc)
                    continue
                if not m.status.startswith("failed"):
                    self.rows[m.key] = m

    def done(self, key: tuple, settings: str) -> Any:
        m = self.rows.get(key)
        return m if m is not None and m.settings == settings else None

    def prune(self, wanted: dict[tuple, str]) -> None:
        """Drop rows whose settings changed (they re-run); rows outside this run's selection stay."""
        stale = [k for k, m in self.rows.items() if k in wanted and m.settings != wanted[k]]
        for k in stale:
            del self.rows[k]
        if stale:
            logger.warning(
                "bench: %d stored rows have other settings (device, dtype, repeats, tokens or recipe) and re-run",
                len(stale),
            )
        self.path.write_text("".join(json.dumps(dataclasses.asdict(m)) + "\n" for m in self.rows.values()))

    def add(self, m: Any) -> None:
        self.rows[m.key] = m
        with self.path.open("a") as f:
            f.write(json.dumps(dataclasses.asdict(m)) + "\n")
            f.flush()

    def log_failed(self, bench: str, describe: Callable[[Any], str]) -> None:
        """Say, as one error, which rows failed (``describe(row)`` names one; ``bench`` the bench)."""
        failed = [m for m in self.rows.values() if m.status.startswith("failed")]
        if failed:
            logger.error(
                "%s: %d rows failed (see their status in results.md; they re-run on resume): %s",
                bench,
                len(failed),
                "; ".join(describe(m) for m in failed),
            )


def measure_row(m: Any, label: str, measure: Callable[..., None], *args: Any) -> None:
    """Run ``measure(*args)`` (it fills row ``m``) so that one broken row cannot cost the device time of the rest:
    a variant the shape cannot run (an :class:`MMFastError`) is ``refused: ...`` in ``m.status``, any other
    exception (CUDA out of memory included) ``failed: ...`` (such rows re-run on resume); each is logged
    with ``label``, the row's name."""
    try:
        measure(*args)
    except MMFastError as exc:  # a variant this shape cannot run: said so in its row
        m.status = f"refused: {exc}"
        logger.warning("%s refused: %s", label, exc)
    except torch.cuda.OutOfMemoryError as exc:
        m.status = f"failed: CUDA out of memory ({str(exc).splitlines()[0][:120]})"
        logger.error("%s ran out of memory", label)
        torch.cuda.empty_cache()
    except Exception as exc:  # noqa: BLE001  one broken row must not cost the device time of the rest
        m.status = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        logger.exception("%s failed (the row re-runs on resume)", label)


def _row_specs(recipe: Recipe, vs: list[Variant], cp: GpuBenchParams) -> list[tuple[str, Any]]:
    """(row name, what the row runs) in table order, filtered by ``bench.params.rows``."""
    rows: list[tuple[str, Any]] = [
        (HF_EAGER, "hf-dynamic"),
        (HF_STATIC, "hf-static"),
        (UNPRUNED, vs[0]),
        (COMPILED, vs[0]),
        (FUSED, vs[0]),
    ]
    rows += [(v.name, v) for v in vs[1:]]
    return [(name, what) for name, what in rows if cp.wants(name)]


def _row_model(name: str) -> dict[str, Any] | None:
    """The row's ``model`` keys: compile off for ``mmfast unpruned``, auto for its compiled twin, auto and
    fuse_norms for the fused one; None (the bench recipe's own ``model``, e.g. ``--set model.compile=auto``)
    for every method row."""
    return {
        UNPRUNED: {"compile": "off"},
        COMPILED: {"compile": "auto"},
        FUSED: {"compile": "auto", "fuse_norms": True},
    }.get(name)


def _spec_of(what: Any, model: dict[str, Any] | None) -> Any:
    if isinstance(what, str):
        return what
    model = model or {}
    spec = {"recipe": row_recipe(what.recipe), "compile": model.get("compile")}
    if model.get("fuse_norms"):  # only then: the other rows' settings stay as they were stored
        spec["fuse_norms"] = True
    return spec


def run_gpu_speed(recipe: Recipe, out: Path, command: str) -> dict[str, Any]:
    """Run the bench into ``out`` (rows.jsonl as rows finish; results.md / summary.json after each)."""

    cfg = recipe.bench
    cp = GpuBenchParams.of(recipe)
    vs = variants(recipe)
    want = recipe.model.device  # load_model's rule: auto = cuda when there is one
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if want == "auto" else want)
    info = DeviceInfo.detect(device, cfg.params)
    store = RowStore(out / "rows.jsonl")
    specs = _row_specs(recipe, vs, cp)
    plan: dict[tuple, str] = {}
    for shape in cp.shapes:  # run order: shape, workload (one-token answers first by default), batch, row
        for w in cp.workloads:
            for b in cp.batches:
                for name, what in specs:
                    plan[(shape, b, w, name)] = _settings(
                        info,
                        cp.dtype,
                        cfg,
                        cp.tokens(w),
                        {"row": _spec_of(what, _row_model(name)), "shape": repr(BENCH_MODELS[shape])},
                    )
    emb_plan = _embedded_plan(recipe, vs, cp, info) if cp.embedded else {}
    store.prune({**plan, **emb_plan})
    for shape_name in cp.shapes:  # a shape too big for the CPU's memory is refused before any compute
        if any(k[0] == shape_name and store.done(k, plan[k]) is None for k in plan):
            check_cpu_build_fits(shape_name, device)
    report = lambda: write_gpu_report(recipe, cp, info, store, out, command, vs)  # noqa: E731
    if cp.embedded:
        _run_embedded(recipe, vs, cp, info, store, emb_plan, report)
    for shape_name in cp.shapes:
        todo = [k for k in plan if k[0] == shape_name and store.done(k, plan[k]) is None]
        if not todo:
            logger.info("gpu bench: %s: every selected row is already in %s", shape_name, store.path)
            continue
        shape = _build_shape(shape_name, device, cp.dtype, max(cp.batches))
        try:
            for key in todo:
                _, b, w, name = key
                what = dict(specs)[name]
                n = cp.tokens(w)
                m = Measurement(shape_name, b, w, name, plan[key], new_tokens=n)
                label = f"gpu bench: {shape_name} batch {b} {w}: {name}"
                logger.info("%s", label)
                if isinstance(what, str):
                    measure_row(m, label, _hf_row, shape, b, w, n, cfg, what == "hf-static", m)
                else:
                    measure_row(m, label, _mmfast_row, shape, what, b, w, n, cfg, _row_model(name), m)
                store.add(m)
                report()
        finally:
            shape.draft_dir.cleanup()
            del shape
            gc.collect()  # the next shape needs the memory (a compiled generate holds the model in a cycle)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    store.log_failed("gpu bench", lambda m: f"{m.shape} b{m.batch} {m.workload} {m.row}")
    return report()


# -- the embedded model: real tau ------------------------------------------------------------------
def _embedded_rows(vs: list[Variant], cp: GpuBenchParams | None = None) -> list[Variant]:
    """The drafters without pruning (selected by ``bench.params.embedded_rows`` when ``cp`` is given)."""
    return [
        v
        for v in vs[1:]
        if v.recipe.speculative is not None and not v.recipe.pruning and (cp is None or cp.wants(v.name, embedded=True))
    ]


def _embedded_plan(recipe: Recipe, vs: list[Variant], cp: GpuBenchParams, info: DeviceInfo) -> dict[tuple, str]:
    names = [UNPRUNED] + [v.name for v in _embedded_rows(vs, cp)]
    spec = {
        "model": recipe.model.name,
        "samples": cp.embedded_samples,
        "compiled": True,  # the captured greedy step (a key of the committed rows' settings)
        "data": recipe.eval.data,
    }
    return {
        (EMBEDDED, 1, "caption", n): _settings(
            info, recipe.model.dtype, recipe.bench, cp.caption_tokens, {**spec, "row": n}
        )
        for n in names
    }


def _run_embedded(
    recipe: Recipe,
    vs: list[Variant],
    cp: GpuBenchParams,
    info: DeviceInfo,
    store: RowStore,
    plan: dict[tuple, str],
    report: Callable[[], Any],
) -> None:

    todo = [k for k in plan if store.done(k, plan[k]) is None]
    if not todo:
        return
    mm = load_model(recipe.model)
    # the first images of the evaluation data (the world's val split by default), in file order; only the
    # images are needed, so no task (CHAIR's parser alone takes tens of CPU seconds to build) is set up
    image_dir = resolve_data(recipe.eval, ("pope",)).image_dir  # the world is generated if missing
    images = sorted(p for p in image_dir.iterdir() if p.suffix.lower() in (".png", ".jpg", ".jpeg"))[
        : cp.embedded_samples
    ]
    if len(images) < cp.embedded_samples:
        raise InputError(
            f"bench.params.embedded_samples is {cp.embedded_samples} but {image_dir} holds {len(images)} images"
        )
    batches = [mm.prepare([im], [WORKLOAD_PROMPTS["caption"]]) for im in images]
    rows = {UNPRUNED: vs[0], **{v.name: v for v in _embedded_rows(vs, cp)}}
    for key in todo:
        v = rows[key[3]]
        data = v.recipe.to_dict()
        data["model"] = dict(data["model"], compile="auto")  # the captured greedy step, and the drafters' target
        m = Measurement(*key, settings=plan[key], new_tokens=cp.caption_tokens)
        logger.info("gpu bench: embedded model: %s", key[3])
        try:
            with apply(mm, load_recipe(data)) as session:

                def run_all():
                    return [session.run(b, max_new_tokens=cp.caption_tokens)[0] for b in batches]

                first, _ = _timed(run_all, mm.device)
                for _ in range(max(0, recipe.bench.warmup - 1)):
                    run_all()
                walls, res = [], None
                for _ in range(recipe.bench.repeats):
                    t, res = _timed(run_all, mm.device)
                    walls.append(t)
        except MMFastError as exc:
            m.status = f"refused: {exc}"
            store.add(m)
            continue
        m.first_call_s, m.e2e_s, m.repeats = first, statistics.median(walls), len(walls)
        m.new_tokens = sum(len(r.token_ids) for r in res)  # real answers stop at EOS: total tokens of the prompts
        m.tokens_sha = _sha([r.token_ids for r in res])
        spec = [r.stats["speculative"] for r in res if r.stats.get("speculative")]
        if spec:
            m.cycles = sum(s["cycles"] for s in spec)
            m.tau = sum(s["committed"] for s in spec) / m.cycles if m.cycles else None
        store.add(m)
        report()


# -- report ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TargetCheck:
    target: str
    value: float | None
    threshold: float
    detail: str

    @property
    def status(self) -> str:
        if self.value is None:
            return "not measured"
        return "pass" if self.value >= self.threshold else "fail"


def _fmt(v: Any, spec: str = ".2f") -> str:
    return "n/a" if v is None else format(v, spec)


def _drafter_tau(rows: dict[tuple, Measurement], vs: list[Variant], v: Variant) -> float | None:
    """Tau measured on the embedded model by the embedded row whose drafter equals ``v``'s."""
    if v.recipe.speculative is None:
        return None
    mine = v.recipe.speculative._to_recipe()
    for e in _embedded_rows(vs):
        if e.recipe.speculative._to_recipe() == mine:
            m = rows.get((EMBEDDED, 1, "caption", e.name))
            return m.tau if m is not None and m.ok else None
    return None


def projected_decode(rows: dict[tuple, Measurement], m: Measurement, tau: float | None) -> float | None:
    """A drafter row's projected decode speedup: tau x the unpruned step / (batch x time per cycle). The unpruned
    step is the compiled twin's (the captured step: the drafters' own decode path) where it ran."""
    ref = next(
        (r for r in (rows.get((*m.key[:3], COMPILED)), rows.get((*m.key[:3], UNPRUNED))) if r is not None and r.ok),
        None,
    )
    if not tau or not m.cycles or ref is None or not ref.decode_step_s or m.decode_step_s is None:
        return None
    t_cycle = (m.e2e_s - m.ttft_s) / m.cycles  # one draft + verification of one sample
    return tau * ref.decode_step_s / (m.batch * t_cycle)


def _ttft_targets(rows: dict[tuple, Measurement], vs: list[Variant], unpruned: Callable) -> list[TargetCheck]:
    """Item 2's targets, per shape and batch of one-token answers that ran pruners: no pruner's TTFT is slower
    than the unpruned model's (the value: unpruned TTFT over the slowest pruner row's, >= 1 passes), and ZipVL's
    LLM prefill is at most 1.1x the unpruned one (unpruned prefill over ZipVL's, >= 0.909). Against the method
    rows' own decode path (the compiled twin where it ran)."""
    pruners = {v.name for v in vs if v.recipe.pruning and v.recipe.speculative is None}
    out = []
    for shape, b in sorted({(k[0], k[1]) for k in rows if k[0] != EMBEDDED and k[2] == "pope"}):
        base = unpruned(shape, b, "pope")
        ran = [m for (s, bb, w, n), m in rows.items() if (s, bb, w) == (shape, b, "pope") and n in pruners and m.ok]
        if not ran:
            continue
        slowest = max(ran, key=lambda m: m.ttft_s)
        out.append(
            TargetCheck(
                f"{shape} b{b}: no pruner's TTFT above the unpruned model's (slowest: {slowest.row})",
                base.ttft_s / slowest.ttft_s if base else None,
                1.0,
                f"unpruned TTFT / slowest pruner TTFT, pope workload, {len(ran)} pruner rows, against "
                f"{base.row if base else 'the unpruned row'}",
            )
        )
        zipvl = [m for m in ran if m.row.startswith("zipvl") and m.prefill_s]
        if zipvl:
            slow = max(zipvl, key=lambda m: m.prefill_s)
            out.append(
                TargetCheck(
                    f"{shape} b{b}: {slow.row} prefill <= 1.1 x unpruned prefill",
                    base.prefill_s / slow.prefill_s if base and base.prefill_s else None,
                    1 / 1.1,
                    "value = unpruned LLM prefill / ZipVL's (>= 0.909 passes), pope workload",
                )
            )
    return out


def targets(rows: dict[tuple, Measurement], vs: list[Variant]) -> list[TargetCheck]:
    """The issue's targets, each pass / fail / not measured."""

    def get(shape, b, w, name):
        m = rows.get((shape, b, w, name))
        return m if m is not None and m.ok else None

    out = []
    for shape in sorted({k[0] for k in rows if k[0] != EMBEDDED}):
        for b in (1, 8):
            hf = get(shape, b, "caption", HF_STATIC)
            # mmfast's most optimised decode path that ran: fused norms, else the captured step, else eager
            ours = next((r for r in (get(shape, b, "caption", n) for n in (FUSED, COMPILED, UNPRUNED)) if r), None)
            which = ours.row if ours else UNPRUNED
            ratio = (
                (hf.decode_step_s / ours.decode_step_s)
                if hf and ours and hf.decode_step_s and ours.decode_step_s
                else None
            )
            out.append(
                TargetCheck(
                    f"{shape} b{b}: {which} decode ms/token <= 1.1 x hf static",
                    ratio,
                    1 / 1.1,
                    "value = hf static step / mmfast step (>= 0.909 passes)",
                )
            )

    def unpruned(shape, b, w):  # the method rows' decode path: the compiled twin where it ran
        return get(shape, b, w, COMPILED) or get(shape, b, w, UNPRUNED)

    for shape, thr in (("llava-1.5-7b", 1.4), ("llava-next-7b", 2.5)):
        base, dp = unpruned(shape, 32, "caption"), get(shape, 32, "caption", "divprune-64")
        out.append(
            TargetCheck(
                f"{shape} b32: divprune-64 end-to-end throughput >= {thr} x unpruned",
                dp.tokens_per_s / base.tokens_per_s if base and dp else None,
                thr,
                f"tokens/s ratio, caption workload, against {base.row if base else 'the unpruned row'}",
            )
        )
    base, dp = unpruned("llava-next-7b", 1, "pope"), get("llava-next-7b", 1, "pope", "divprune-64")
    out.append(
        TargetCheck(
            "llava-next-7b b1: divprune-64 TTFT >= 2 x faster than unpruned",
            base.ttft_s / dp.ttft_s if base and dp else None,
            2.0,
            "unpruned TTFT / divprune-64 TTFT, pope workload",
        )
    )
    for (shape, b, w, name), m in sorted(rows.items()):
        base = unpruned(shape, b, w)  # the prefill path the method rows take (captured where it ran)
        if (
            shape == EMBEDDED
            or b != 8
            or w != "pope"
            or not m.ok
            or name in (UNPRUNED, COMPILED, FUSED, HF_EAGER, HF_STATIC)
            or base is None
        ):
            continue
        v = next((v for v in vs if v.name == name), None)
        pre_llm = (
            v is not None
            and v.recipe.speculative is None
            and m.n_vision_tokens is not None
            and m.n_vision_tokens < base.n_vision_tokens
        )
        if pre_llm and m.prefill_s and m.flops_prefill and base.flops_prefill:
            out.append(
                TargetCheck(
                    f"{shape} b8: {name} prefill >= 0.85 of the FLOPs ideal",
                    base.prefill_s / m.prefill_s * m.flops_prefill / base.flops_prefill,
                    0.85,
                    f"LLM prefill speedup x FLOPs ratio, against {base.row}",
                )
            )
    out.extend(_ttft_targets(rows, vs, unpruned))
    base = get(EMBEDDED, 1, "caption", UNPRUNED)
    flash = [m for (s, _, _, n), m in rows.items() if s == EMBEDDED and m.ok and "flash" in n]
    for m in flash or [None]:
        out.append(
            TargetCheck(
                f"embedded: {m.row if m else 'flash'} >= 3 x end to end over the captured greedy step",
                (m.tokens_per_s / base.tokens_per_s) if m and base else None,
                3.0,
                "tokens/s ratio, caption prompts, batch 1",
            )
        )
    return out


def write_gpu_report(
    recipe: Recipe, cp: GpuBenchParams, info: DeviceInfo, store: RowStore, out: Path, command: str, vs: list[Variant]
) -> dict[str, Any]:
    rows = store.rows
    header = [
        "shape",
        "batch",
        "workload",
        "row",
        "status",
        "budget",
        "vision tok",
        "TTFT ms",
        "decode ms/token",
        "tokens/s",
        "peak mem GiB",
        "FLOPs ratio",
        "decode % BW limit",
        "prefill % peak FLOP/s",
        "first call s",
        "capture ms first / timed",
        "repeats",
        "tokens = hf eager",
        "= hf static",
        "tau (embedded)",
        "projected decode x",
    ]
    table = []
    for _key, m in sorted(((k, m) for k, m in rows.items() if k[0] != EMBEDDED), key=lambda km: _order(km[0], vs)):
        base = rows.get((m.shape, m.batch, m.workload, UNPRUNED))
        hf = rows.get((m.shape, m.batch, m.workload, HF_EAGER))
        v = next((v for v in vs if v.name == m.row), None)
        asked = budget_text([st._to_recipe() for st in v.recipe.pruning]) if v is not None else ""
        if not m.ok:
            table.append([m.shape, m.batch, m.workload, m.row, m.status, asked] + [""] * (len(header) - 6))
            continue
        step = m.decode_step_s
        bw = info.peak_bandwidth
        frac_bw = (m.weight_bytes + (m.kv_bytes_mean or 0)) / (step * bw) if bw and step and m.weight_bytes else None
        prefill_t = m.prefill_s if m.prefill_s else m.ttft_s
        frac_fl = (
            m.flops_prefill / (prefill_t * info.peak_flops)
            if info.peak_flops and m.flops_prefill and prefill_t
            else None
        )
        flops_ratio = (
            m.flops_prefill / base.flops_prefill
            if base is not None and base.ok and base.flops_prefill and m.flops_prefill
            else None
        )
        tau = _drafter_tau(rows, vs, v) if v is not None else None
        proj = projected_decode(rows, m, tau)
        same = (
            (m.tokens_sha == hf.tokens_sha)
            if hf is not None and hf.ok and m.row in (HF_STATIC, UNPRUNED, COMPILED, FUSED)
            else None
        )
        hfs = rows.get((m.shape, m.batch, m.workload, HF_STATIC))
        same_static = (
            (m.tokens_sha == hfs.tokens_sha)
            if hfs is not None and hfs.ok and m.row in (UNPRUNED, COMPILED, FUSED)
            else None
        )
        table.append(
            [
                m.shape,
                m.batch,
                m.workload,
                m.row,
                "ok",
                asked,
                _fmt(m.n_vision_tokens, ".0f"),
                _fmt(m.ttft_s * 1000, ".1f"),
                _fmt(step * 1000 if step is not None else None, ".2f"),
                _fmt(m.tokens_per_s, ".1f"),
                _fmt(m.peak_mem_bytes / 2**30 if m.peak_mem_bytes else None, ".1f"),
                _fmt(flops_ratio, ".3f"),
                _fmt(frac_bw * 100 if frac_bw is not None else None, ".1f"),
                _fmt(frac_fl * 100 if frac_fl is not None else None, ".1f"),
                _fmt(m.first_call_s, ".2f"),
                _capture_cell(m),
                m.repeats,
                "" if same is None else ("yes" if same else "no"),
                "" if same_static is None else ("yes" if same_static else "no"),
                _fmt(tau, ".2f"),
                _fmt(proj, ".2f"),
            ]
        )
    emb = []
    ebase = rows.get((EMBEDDED, 1, "caption", UNPRUNED))
    for _key, m in sorted(((k, m) for k, m in rows.items() if k[0] == EMBEDDED), key=lambda km: km[0][3] != UNPRUNED):
        if not m.ok:
            emb.append([m.row, m.status, "", "", "", "", ""])
            continue
        sp = m.tokens_per_s / ebase.tokens_per_s if ebase is not None and ebase.ok and m.tokens_per_s else None
        same = (m.tokens_sha == ebase.tokens_sha) if ebase is not None and ebase.ok else None
        emb.append(
            [
                ("greedy" if m.row == UNPRUNED else m.row),
                "ok",
                _fmt(m.tau, ".2f"),
                m.new_tokens,
                _fmt(m.e2e_s, ".3f"),
                _fmt(sp, ".2f"),
                "" if same is None else ("yes" if same else "no"),
            ]
        )
    checks = targets(rows, vs)
    failed = [m for m in rows.values() if m.status.startswith("failed")]
    lines = [
        "# GPU speed bench: full-depth random-weight models, HF generate and mmfast",
        "",
        f"Command: `{command}`",
        "",
        f"Device: **{info.name}**; torch {info.torch}; CUDA {info.cuda or 'n/a'}; transformers {info.transformers}; "
        f"dtype {str(cp.dtype).replace('torch.', '')}; warm-up {recipe.bench.warmup}, median of {recipe.bench.repeats} repeats; "
        f"peaks: {_fmt(info.peak_bandwidth and info.peak_bandwidth / 1e12)} TB/s, {_fmt(info.peak_flops and info.peak_flops / 1e12, '.0f')} TFLOP/s; "
        "method rows: model.compile as the bench recipe says (auto: captured steps on CUDA)",
        "",
        *(
            [f"**{len(failed)} rows failed** (status column; they re-run when the same command is run again).", ""]
            if failed
            else []
        ),
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(str(c) for c in r) + " |" for r in table),
        "",
        "## Targets",
        "",
        "| target | value | threshold | status | how |",
        "|---|---|---|---|---|",
        *(f"| {c.target} | {_fmt(c.value, '.3f')} | {c.threshold:.3f} | {c.status} | {c.detail} |" for c in checks),
        "",
    ]
    if emb:
        lines += [
            "## Speculative decoding on the embedded model (real tau)",
            "",
            f"Model `{recipe.model.name}`, {cp.embedded_samples} caption prompts at batch 1, up to {cp.caption_tokens} new tokens; "
            "baseline: greedy with model.compile: auto (the captured step).",
            "",
            "| row | status | tau | new tokens | wall s | e2e x | identical to greedy |",
            "|---|---|---|---|---|---|---|",
            *("| " + " | ".join(str(c) for c in r) + " |" for r in emb),
            "",
        ]
    lines += [
        "Notes:",
        "",
        "- TTFT: one-token call (vision tower + prefill); decode ms/token: (end to end - TTFT) / (tokens - 1), per step of the whole batch; "
        "tokens/s: batch x tokens / end to end. EOS is outside the random models' vocabulary: every row generates exactly the workload's tokens.",
        "- first call s: the first (untimed) call, compile / capture included; never part of the medians. capture ms first / timed: "
        "graph capture inside the first call, and inside all the timed calls together (model.compile: auto; the graphs and static "
        "buffers are kept between calls of a session, so the timed calls replay them: 0 unless a timed call needed a new shape).",
        "- FLOPs ratio: prefill FLOPs (4nd^2 + 2n^2d + 3ndm per layer) / the unpruned row's. decode % BW limit: (LLM weight bytes + mean KV bytes) / "
        "(step time x peak bandwidth); prefill % peak FLOP/s: prefill FLOPs / (LLM prefill time x peak) for mmfast rows, / TTFT for HF rows. n/a on a CPU.",
        "- Random weights: trained parts (HICom, Dynamic-LLaVA) run on seeded stand-ins and drafts on random weights, so only costs are measured; "
        "projected decode x = tau (embedded) x unpruned step (the compiled twin's where it ran) / (batch x measured time per verification cycle); speculative decoding verifies one sample at a time.",
        "- tokens = hf eager: the row's greedy tokens hash-equal HF eager generate's (fp16 kernels may differ in the last bit; fp32 on a CPU is exact).",
    ]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    summary = {
        "kind": "gpu_speed",
        "device": dataclasses.asdict(info),
        "dtype": str(cp.dtype),
        "rows": [
            dict(dataclasses.asdict(m), decode_step_s=m.decode_step_s, tokens_per_s=m.tokens_per_s)
            for m in rows.values()
        ],
        "targets": [dict(dataclasses.asdict(c), status=c.status) for c in checks],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary


def _order(key: tuple, vs: list[Variant]) -> tuple:
    names = [HF_EAGER, HF_STATIC, UNPRUNED, COMPILED, FUSED] + [v.name for v in vs[1:]]
    shape, b, w, name = key
    return (shape, b, w, names.index(name) if name in names else len(names), name)
