"""Host-side torch ops per captured decode step, by phase (issue 27's CPU proxy for launch overhead).

Builds the tiny random LLaVA, runs each case once with ``compile: static`` and the CPU emulator of a CUDA
graph (:class:`mmfast.bench.host_ops.ReplayGraph`) so the captured path is taken, and prints the aten ops
dispatched outside the graph per steady-state decode step. Op counts on the CPU, not GPU times.

    OMP_NUM_THREADS=1 PYTHONPATH=. python scripts/host_ops.py
    OMP_NUM_THREADS=1 PYTHONPATH=. python scripts/host_ops.py --embedded --max-new-tokens 40

``--embedded``: greedy and the trained drafters (FLASH, MSD: ops per verify cycle) on the embedded model
with one world image and the caption prompt, instead of the tiny random LLaVA's cases.
"""

from __future__ import annotations

import argparse
import tempfile

import numpy as np
from PIL import Image

import mmfast
from mmfast.bench.host_ops import PHASES, count_step_ops
from mmfast.models.factory import random_llava, save_model
from mmfast.registry import PRUNERS

PROMPTS = ["Describe the image.", "What is in the picture?"]


def cases(mm) -> dict[str, tuple[dict, int]]:
    pdrop = {"method": "pyramiddrop", "params": PRUNERS.get("pyramiddrop").cls.test_params(mm.adapter)}
    return {
        "greedy b1": ({}, 1),
        "greedy b2": ({}, 2),
        "pyramiddrop b1": ({"pruning": [pdrop]}, 1),
        "prompt_lookup b1": ({"speculative": {"method": "prompt_lookup"}}, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--embedded", action="store_true", help="the embedded model's greedy, flash and msd")
    args = ap.parse_args()
    if args.embedded:
        print_rows(embedded_rows(args.max_new_tokens))
        return
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 255, (40, 48, 3), dtype=np.uint8)) for _ in range(2)]
    with tempfile.TemporaryDirectory() as tmp:
        model, processor = random_llava("tiny", init_std=0.2)
        mm = mmfast.load(save_model(model, processor, tmp), device="cpu", dtype="float32")
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
    recipes = {"greedy": {}, "flash": {"speculative": {"method": "flash"}}, "msd": {"speculative": {"method": "msd"}}}
    return [(name, count_step_ops(mm, r, [image], [prompt], max_new_tokens)) for name, r in recipes.items()]


def print_rows(rows: list[tuple[str, dict]]) -> None:
    cols = [*PHASES, "total"]
    print("| case | steps | " + " | ".join(cols) + " |")
    print("|---|---|" + "---|" * len(cols))
    for name, r in rows:
        print(f"| {name} | {r['steps']} | " + " | ".join(f"{r[c]:.1f}" for c in cols) + " |")


if __name__ == "__main__":
    main()
