#!/usr/bin/env python
"""Where a captured decode step's or a speculative cycle's time goes on the device (issue 27's FLASH target).

    python scripts/cycle_time.py                                  # CUDA, the embedded model in fp16
    python scripts/cycle_time.py --device cpu --dtype float32     # a CPU smoke run (CUDA-graph emulator)

For greedy and each drafter of ``--recipes`` on the embedded model (its trained drafts; the bench's caption prompt
on the first world images, batch 1, ``model.compile: auto``; on a CPU ``static`` with the emulator), after one warm-up call per image (every graph
captured): per call the prefill and the decode time (the pipeline's own timings), and in the decode the graphs
replayed by kind (the LM step, which is a drafter's verify step; the greedy verdict; the target's keep; the
draft's proposal and accept steps) with the device time inside them (CUDA events recorded around each replay
call: its input copies and kernels, and any wait of the device for the host within the call, which a starved
device shows as a gap between the events). The rest of the decode time is the host's Python and launches, eager
kernels (``lm_head``, the draft's ``lm_head``) and the waits for the device: what the graphs do not explain. Prints a Markdown table and one JSON line; ratios are against greedy's (a sampled row: ``sample``'s) decode time per
token. On a CPU the graphs are the emulator's and every time is host time: a smoke run, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

import mmfast
from mmfast.config import load_recipe
from mmfast.eval.data import resolve_data
from mmfast.runtime import LMRunner

RECIPES = {
    "greedy": {},
    "flash": {"speculative": {"method": "flash"}},
    # a second block from one more draft forward (deeper trees, higher tau), its proposal one graph too
    "flash_rounds2": {"speculative": {"method": "flash", "params": {"rounds": 2}}},
    "msd": {"speculative": {"method": "msd"}},
    "prompt_lookup": {"speculative": {"method": "prompt_lookup"}},
    # sampled cycles on the device (temperature 1, seeded): the point-mass verdict on uniforms drawn before it
    "sample": {"decoding": {"method": "sample", "params": {"temperature": 1.0}, "seed": 3}},
    "sample_flash": {
        "decoding": {"method": "sample", "params": {"temperature": 1.0}, "seed": 3},
        "speculative": {"method": "flash"},
    },
    "sample_msd": {
        "decoding": {"method": "sample", "params": {"temperature": 1.0}, "seed": 3},
        "speculative": {"method": "msd"},
    },
}
#: a graph's kind from the string of its store key (``LMRunner.replay_or_capture``)
KINDS = {
    "greedy_accept": "verdict",
    "sampled_accept": "verdict",
    "keep": "keep",
    "reorder": "reorder",
    "sar": "draft proposal",
    "eagle2": "draft proposal",
    "accept": "draft accept",
}
STEP = "LM step"
PREFILL = "prefill"  # the tower's and the prefill segments' graphs (before the decode)


class _Timer:
    """Device time of the graph replays by kind: CUDA events around each (read after the call), or the host's
    clock on a CPU (replays are synchronous there)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.pending: list[tuple[str, object, object]] = []
        self.replays: dict[str, int] = defaultdict(int)
        self.seconds: dict[str, float] = defaultdict(float)
        self.active = False

    def timed(self, kind: str, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        if not self.active:
            return fn()
        self.replays[kind] += 1
        if not self.cuda:
            t0 = time.perf_counter()
            out = fn()
            self.seconds[kind] += time.perf_counter() - t0
            return out
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        self.pending.append((kind, start, end))
        return out

    def settle(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            for kind, start, end in self.pending:
                self.seconds[kind] += start.elapsed_time(end) / 1e3
        self.pending = []


@contextmanager
def _timing(timer: _Timer) -> Iterator[None]:
    """Route the runner's graph replays through ``timer`` (this process only: the originals are restored)."""
    replay, replay_or_capture = LMRunner._replay, LMRunner.replay_or_capture

    def step(self, state, inputs, *staged):
        return timer.timed(STEP, lambda: replay(self, state, inputs, *staged))

    def stored(self, store, key, *args):
        kind = KINDS.get(next((k for k in key if isinstance(k, str)), ""), PREFILL)
        return timer.timed(kind, lambda: replay_or_capture(self, store, key, *args))

    LMRunner._replay, LMRunner.replay_or_capture = step, stored
    try:
        yield
    finally:
        LMRunner._replay, LMRunner.replay_or_capture = replay, replay_or_capture


def measure(mm, name: str, batches: list, max_new_tokens: int) -> dict:
    timer = _Timer(mm.device)
    # auto: captured steps on CUDA; on a CPU, static with the emulator as the graph factory (main)
    mode = "auto" if mm.device.type == "cuda" else "static"
    recipe = load_recipe({**RECIPES[name], "model": {"compile": mode}})
    with _timing(timer), mmfast.apply(mm, recipe) as s:
        for b in batches:  # captures every graph these inputs need
            s.run(b, max_new_tokens=max_new_tokens)
        timer.active = True
        results = [s.run(b, max_new_tokens=max_new_tokens)[0] for b in batches]
        timer.settle()
    tokens = sum(len(r.token_ids) for r in results)
    spec = [r.stats["speculative"] for r in results if r.stats.get("speculative")]
    cycles = sum(x["cycles"] for x in spec) if spec else tokens - len(results)  # greedy: one step a token
    decode_s = sum(r.timings.decode_s for r in results)
    in_graphs = sum(v for k, v in timer.seconds.items() if k != PREFILL)
    decode_kinds = sorted(k for k in timer.seconds if k != PREFILL)
    return {
        "row": name,
        "tokens": tokens,
        "cycles": cycles,
        "prefill_ms": 1e3 * sum(r.timings.vision_s + r.timings.prefill_s for r in results),
        "decode_ms": 1e3 * decode_s,
        "decode_ms_per_token": 1e3 * decode_s / max(1, tokens - len(results)),
        "cycle_ms": 1e3 * decode_s / max(1, cycles),
        "prefill_graphs_ms": 1e3 * timer.seconds.get(PREFILL, 0.0),
        "graphs_ms_per_cycle": {k: 1e3 * timer.seconds[k] / max(1, cycles) for k in decode_kinds},
        "replays_per_cycle": {k: timer.replays[k] / max(1, cycles) for k in decode_kinds},
        "outside_graphs_ms_per_cycle": 1e3 * (decode_s - in_graphs) / max(1, cycles),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--recipes", default=",".join(RECIPES), help=f"comma-separated, of {', '.join(RECIPES)}")
    ap.add_argument("--samples", type=int, default=4, help="world images (one caption each)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    names = args.recipes.split(",")
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        raise SystemExit(f"--recipes: unknown {unknown}; choose from {', '.join(RECIPES)}")
    if args.device == "cpu":  # the CUDA-graph emulator, so the captured path runs (every time is host time)
        from mmfast.bench.host_ops import ReplayGraph
        from mmfast.pipeline import Session

        Session._capture_factory = lambda self: ReplayGraph
    mm = mmfast.load("mmfast/tiny-world", device=args.device, dtype=args.dtype)
    image_dir = resolve_data(load_recipe({}).eval, ("pope",)).image_dir  # the world is generated if missing
    paths = sorted(p for p in image_dir.iterdir() if p.suffix.lower() in (".png", ".jpg", ".jpeg"))[: args.samples]
    from mmfast.bench.gpu_speed import WORKLOAD_PROMPTS

    batches = [mm.prepare([p], [WORKLOAD_PROMPTS["caption"]]) for p in paths]
    rows = [measure(mm, n, batches, args.max_new_tokens) for n in names]
    by_name = {r["row"]: r for r in rows}
    print(f"device {mm.device} ({torch.cuda.get_device_name() if mm.device.type == 'cuda' else 'cpu'}), {args.dtype}")
    print(
        "| row | tokens | cycles | prefill ms | decode ms | ms/token | x baseline | ms/cycle | graphs ms/cycle | outside |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        # against greedy's decode, or the plain sampler's for a sampled row
        base = by_name.get("sample" if r["row"].startswith("sample") else "greedy")
        ratio = "n/a" if base is None else f"{base['decode_ms_per_token'] / r['decode_ms_per_token']:.2f}"
        graphs = ", ".join(
            f"{k} {v:.3f} ({r['replays_per_cycle'][k]:.1f})" for k, v in r["graphs_ms_per_cycle"].items()
        )
        print(
            f"| {r['row']} | {r['tokens']} | {r['cycles']} | {r['prefill_ms']:.1f} | {r['decode_ms']:.1f} | "
            f"{r['decode_ms_per_token']:.3f} | {ratio} | {r['cycle_ms']:.3f} | {graphs} | "
            f"{r['outside_graphs_ms_per_cycle']:.3f} |"
        )
    print(json.dumps({"device": str(mm.device), "dtype": args.dtype, "rows": rows}))


if __name__ == "__main__":
    main()
