"""Host-side torch ops per captured decode step, by phase (issue 27's CPU proxy for launch overhead).

Builds the tiny random LLaVA, runs each case once with ``compile: static`` and the CPU emulator of a CUDA
graph (:class:`mmfast.bench.host_ops.ReplayGraph`) so the captured path is taken, and prints the aten ops
dispatched outside the graph per steady-state decode step, and the host transfers (reads of tensor data and
tensors made from host data: on a GPU each of a device tensor waits for the stream; host-only tensors count too,
an upper bound), and the ops the captured graphs replayed (``replayed``: what the device runs, one kernel each at
most; views are not replayed). Op counts on the CPU, not GPU times.

    OMP_NUM_THREADS=1 PYTHONPATH=. python scripts/host_ops.py
    OMP_NUM_THREADS=1 PYTHONPATH=. python scripts/host_ops.py --layers 32  # the decode rows on 32 LLM layers
    OMP_NUM_THREADS=1 PYTHONPATH=. python scripts/host_ops.py --embedded --max-new-tokens 40

``--embedded``: greedy and the trained drafters (FLASH, one and two rounds, MSD: ops per verify cycle) on the embedded model
with one world image and the caption prompt, instead of the tiny random LLaVA's cases; the same sampled (temperature
1, seed 3).

``--prefill``: the ops a one-token call (a TTFT; batch 1, or ``--batch N``) dispatches outside graph replays, by
stage (tower, pruning, building the inputs, LLM prefill, the rest), and its host transfers, eagerly (``compile:
static`` without graphs) and with its graphs captured (the tower, the prefill's segments), for the unpruned model, a
pre-LLM pruner and the in-LLM pruners at their defaults (a second call of the same inputs: the first captured), on
the tiny LLaVA with LLaVA-1.5-7B's depths (24 tower and 32 LLM layers, where the methods' default layers lie).

    OMP_NUM_THREADS=1 PYTHONPATH=. python scripts/host_ops.py --prefill
    OMP_NUM_THREADS=1 PYTHONPATH=. python scripts/host_ops.py --prefill --grid 24 --methods sparsevlm --batch 8
    OMP_NUM_THREADS=1 PYTHONPATH=. python scripts/host_ops.py --prefill --grid 24 --methods cdpruner,tome --tokens 64
    OMP_NUM_THREADS=1 PYTHONPATH=. python scripts/host_ops.py --prefill --grid 24 --methods '' --decoders pai,only

``--video``: ops per generated token of the unpruned model and DyCoke (its DP in every decode step) on a tiny random
Qwen2.5-VL with a random 8-frame video, on the dynamic cache, eager static steps and captured ones.

    OMP_NUM_THREADS=1 PYTHONPATH=. python scripts/host_ops.py --video

``--per-token``: decoders (OPERA with 5 beams, 5 candidates and no rollback; PAI, ClearSight and ONLY (argmax) at
their defaults)
per generated token on the dynamic cache, on the static cache with eager steps, and with their steps captured: host
ops and replayed ops (a 20-token call less a 4-token one).

    OMP_NUM_THREADS=1 PYTHONPATH=. python scripts/host_ops.py --per-token opera,pai,clearsight --layers 32
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile

import numpy as np
from PIL import Image

import mmfast
from mmfast.bench.host_ops import PHASES, STAGES, count_call_ops, count_step_ops, count_token_ops
from mmfast.models.factory import SHAPES, random_llava, save_model
from mmfast.registry import PRUNERS

PROMPTS = ["Describe the image.", "What is in the picture?"]


def cases(mm) -> dict[str, tuple[dict, int]]:
    pdrop = {"method": "pyramiddrop", "params": PRUNERS.get("pyramiddrop").cls.test_params(mm.adapter)}
    return {
        "greedy b1": ({}, 1),
        "greedy b2": ({}, 2),
        "beam b1": ({"decoding": {"method": "beam", "params": {"num_beams": 2}}}, 1),
        "pyramiddrop b1": ({"pruning": [pdrop]}, 1),
        "prompt_lookup b1": ({"speculative": {"method": "prompt_lookup"}}, 1),
        "dynamic_llava b1": ({"pruning": [{"method": "dynamic_llava", "params": {"predictors": "random"}}]}, 1),
        "vhr b1": ({"decoding": {"method": "vhr"}}, 1),
        "zipvl b1": ({"pruning": [{"method": "zipvl", "params": {"tau": 0.9}}]}, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument(
        "--embedded", action="store_true", help="the embedded model's greedy, flash and msd, greedy and sampled"
    )
    ap.add_argument("--prefill", action="store_true", help="ops of a one-token call's prefill, eager and captured")
    ap.add_argument("--batch", type=int, default=1, help="--prefill: batch size (the two images and prompts, cycled)")
    ap.add_argument(
        "--per-token", default="", help="comma-separated decoders: ops per token, dynamic / static / captured"
    )
    ap.add_argument("--methods", default=",".join(PREFILL_METHODS), help="--prefill: comma-separated pruners")
    ap.add_argument("--decoders", default="", help="--prefill: comma-separated decoders, each after the pruners")
    ap.add_argument(
        "--tokens", type=int, default=None, help="--prefill: budget {tokens: N} (default: papers' defaults)"
    )
    ap.add_argument("--grid", type=int, default=None, help="--prefill: patch grid side (24: LLaVA-1.5's 576 tokens)")
    ap.add_argument(
        "--layers", type=int, default=None, help="the decode rows: LLM layers of the tiny LLaVA (default 4)"
    )
    ap.add_argument("--video", action="store_true", help="DyCoke per token on a tiny random Qwen2.5-VL's video")
    args = ap.parse_args()
    if args.embedded:
        print_rows(embedded_rows(args.max_new_tokens))
        return
    if args.video:
        print_video_rows()
        return
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 255, (40, 48, 3), dtype=np.uint8)) for _ in range(2)]
    with tempfile.TemporaryDirectory() as tmp:
        # --prefill: LLaVA-1.5-7B's 32 LLM layers (the methods' default layers) and CLIP-L's 24 tower layers, tiny widths
        shape = dataclasses.replace(SHAPES["tiny"], text_layers=32, vision_layers=24) if args.prefill else "tiny"
        if args.layers and not args.prefill:
            shape = dataclasses.replace(SHAPES["tiny"], text_layers=args.layers)
        if args.prefill and args.grid:  # e.g. 24: LLaVA-1.5's 24 x 24 = 576 vision tokens
            shape = dataclasses.replace(shape, image_size=args.grid * shape.patch_size)
        model, processor = random_llava(shape, init_std=0.2)
        mm = mmfast.load(save_model(model, processor, tmp), device="cpu", dtype="float32")
        if args.prefill:
            decoders = tuple(d for d in args.decoders.split(",") if d)
            batch = [images[i % 2] for i in range(args.batch)], [PROMPTS[i % 2] for i in range(args.batch)]
            print_prefill_rows(mm, *batch, args.methods.split(","), args.tokens, decoders)
            return
        if args.per_token:
            print_token_rows(mm, images[:1], PROMPTS[:1], args.per_token.split(","))
            return
        rows = []
        for name, (recipe, bsz) in cases(mm).items():
            rows.append((name, count_step_ops(mm, recipe, images[:bsz], PROMPTS[:bsz], args.max_new_tokens)))
    print_rows(rows)


def embedded_rows(max_new_tokens: int) -> list[tuple[str, dict]]:
    from mmfast.config import load_recipe
    from mmfast.eval.data import resolve_data

    mm = mmfast.load("mmfast/tiny-world", device="cpu", dtype="float32")
    image_dir = resolve_data(load_recipe({}).eval, ("pope",)).image_dir  # the world is generated if missing
    path = sorted(p for p in image_dir.iterdir() if p.suffix.lower() in (".png", ".jpg"))[0]
    image, prompt = Image.open(path).convert("RGB"), "Please describe this image in detail."
    sampled = {"decoding": {"method": "sample", "params": {"temperature": 1.0}, "seed": 3}}
    recipes = {"greedy": {}, "flash": {"speculative": {"method": "flash"}}, "msd": {"speculative": {"method": "msd"}}}
    recipes |= {"sample": sampled, **{f"{d}, sampled": {**sampled, **recipes[d]} for d in ("flash", "msd")}}
    recipes["flash, 2 rounds"] = {"speculative": {"method": "flash", "params": {"rounds": 2}}}
    return [(name, count_step_ops(mm, r, [image], [prompt], max_new_tokens)) for name, r in recipes.items()]


PREFILL_METHODS = ("divprune", "fastv", "dart", "pyramiddrop", "sparsevlm")


def prefill_stage(method: str, tokens: int | None) -> dict:
    """A pruning stage: the paper's defaults, or ``budget: {tokens: N}``; trained parts (HICom's global branch,
    Dynamic-LLaVA's predictors) as the GPU bench's seeded random stand-ins."""
    stage = {"method": method, "params": PRUNERS.get(method).cls.random_shape_params() or {}}
    if tokens is not None:
        stage["budget"] = {"tokens": tokens}
    return stage


def print_prefill_rows(
    mm, images, prompts, methods=PREFILL_METHODS, tokens: int | None = None, decoders: tuple[str, ...] = ()
) -> None:
    recipes = {"unpruned": {}}
    recipes.update({m: {"pruning": [prefill_stage(m, tokens)]} for m in methods if m})
    recipes.update({d: {"decoding": {"method": d}} for d in decoders})
    layers = f"{len(mm.adapter.vision_layers)} tower and {len(mm.adapter.layers)} LLM layers"
    print(f"| case (batch {len(images)}, {layers}) | graphs | " + " | ".join(STAGES) + " | total | transfers |")
    print("|---|---|" + "---|" * (len(STAGES) + 2))
    for name, recipe in recipes.items():
        for captured in (False, True):
            ops, transfers = count_call_ops(mm, recipe, images, prompts, captured=captured)
            cells = " | ".join(str(ops[st]) for st in STAGES)
            graphs = "captured" if captured else "none (eager)"
            print(f"| {name} | {graphs} | {cells} | {sum(ops.values())} | {transfers} |")


#: ``--per-token``: decoders whose steps a per-step count does not fit (OPERA: two step graphs a token) or that fell
#: back to the dynamic cache before (OPERA, PAI, ClearSight, ONLY)
PER_TOKEN = {
    "opera": {"num_beams": 5, "num_attn_candidates": 5, "threshold": 10**6},  # no rollback: the steady state
    "pai": {},
    "clearsight": {},
    "only": {"sample": False},  # argmax: a call runs to its length
}


def print_token_rows(mm, images, prompts, methods: list[str]) -> None:
    print(f"| batch 1, {len(mm.adapter.layers)} LLM layers, per token | host ops | replayed |")
    print("|---|---|---|")
    for method in methods:
        recipe = {"decoding": {"method": method, "params": PER_TOKEN.get(method, {})}}
        for name, compile, captured in [
            ("dynamic cache (`off`)", "off", False),
            ("static cache, eager steps", "static", False),
            ("static cache, captured steps", "static", True),
        ]:
            host, replayed = count_token_ops(mm, recipe, images, prompts, compile, captured=captured)
            print(f"| {method}: {name} | {host:.1f} | {replayed:.1f} |")


def print_video_rows() -> None:
    """``--video``: ops per generated token of the unpruned model and of DyCoke (DP at every step; threshold 0.5, so
    its steps are of both kinds) on a tiny random Qwen2.5-VL (seed 1) with an 8-frame random video."""
    from mmfast.models.factory import random_qwen_vl

    model, processor = random_qwen_vl("qwen2_5_vl", seed=1)
    mm = mmfast.load(model, processor)
    video = [np.random.default_rng(0).integers(0, 255, (8, 28, 28, 3), dtype=np.uint8)]
    recipes = {"unpruned": {}, "dycoke": {"pruning": [{"method": "dycoke", "params": {"l": 2, "threshold": 0.5}}]}}
    print(f"| batch 1, one video, {len(mm.adapter.layers)} LLM layers, per token | host ops | replayed |")
    print("|---|---|---|")
    for name, recipe in recipes.items():
        for mode, compile, captured in [
            ("dynamic cache (`off`)", "off", False),
            ("static cache, eager steps", "static", False),
            ("static cache, captured steps", "static", True),
        ]:
            host, replayed = count_token_ops(
                mm, recipe, None, ["What?"], compile, captured=captured, tokens=(4, 12), videos=video
            )
            print(f"| {name}: {mode} | {host:.1f} | {replayed:.1f} |")


def print_rows(rows: list[tuple[str, dict]]) -> None:
    cols = [*PHASES, "total", "transfers", "replayed"]
    print("| case | steps | " + " | ".join(cols) + " |")
    print("|---|---|" + "---|" * len(cols))
    for name, r in rows:
        print(f"| {name} | {r['steps']} | " + " | ".join(f"{r[c]:.1f}" for c in cols) + " |")


if __name__ == "__main__":
    main()
