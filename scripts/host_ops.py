"""Host-side torch ops per captured decode step, by phase (issue 27's CPU proxy for launch overhead).

Builds the tiny random LLaVA, runs each case once with ``compile: static`` and the CPU emulator of a CUDA
graph (:class:`mmfast.bench.host_ops.ReplayGraph`) so the captured path is taken, and prints the aten ops
dispatched outside the graph per steady-state decode step. Op counts on the CPU, not GPU times.

    OMP_NUM_THREADS=1 PYTHONPATH=. python scripts/host_ops.py
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
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 255, (40, 48, 3), dtype=np.uint8)) for _ in range(2)]
    with tempfile.TemporaryDirectory() as tmp:
        model, processor = random_llava("tiny", init_std=0.2)
        mm = mmfast.load(save_model(model, processor, tmp), device="cpu", dtype="float32")
        rows = []
        for name, (recipe, bsz) in cases(mm).items():
            rows.append((name, count_step_ops(mm, recipe, images[:bsz], PROMPTS[:bsz], args.max_new_tokens)))
    cols = [*PHASES, "total"]
    print("| case | steps | " + " | ".join(cols) + " |")
    print("|---|---|" + "---|" * len(cols))
    for name, r in rows:
        print(f"| {name} | {r['steps']} | " + " | ".join(f"{r[c]:.1f}" for c in cols) + " |")


if __name__ == "__main__":
    main()
