"""Torch ops per decoded token of a recipe whose steps are not captured, by call difference (issue 27's CPU proxy
for launch overhead where ``scripts/host_ops.py`` has no replay to count from).

Builds the tiny random LLaVA, runs ``compile: static`` with the CPU stand-in graph (the captured path where the
recipe allows it) and prints (ops of an N-token call - ops of a 2-token call) / (their token difference), every op
counted (a replay's re-run ops too: meaningful for eager steps only). Each length runs once before it is counted
(graphs captured, buffers kept). Also prints the ops each captured graph recorded and its replays. Op counts on
the CPU, not GPU times.

    OMP_NUM_THREADS=1 PYTHONPATH=. python scripts/call_diff_ops.py \\
        --recipe '{"pruning": [{"method": "zipvl", "params": {"tau": 0.9}}]}'
"""

from __future__ import annotations

import argparse
import json
import tempfile

import numpy as np
from PIL import Image
from torch.utils._python_dispatch import TorchDispatchMode

import mmfast
from mmfast.bench.host_ops import ReplayGraph
from mmfast.models.factory import random_llava, save_model
from mmfast.pipeline import Session


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", required=True, help="the recipe as JSON")
    ap.add_argument("--tokens", type=int, default=18, help="the longer call's max_new_tokens")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 255, (40, 48, 3), dtype=np.uint8))
    Session._capture_factory = lambda self: ReplayGraph  # this process only counts
    ReplayGraph.made = []
    with tempfile.TemporaryDirectory() as tmp:
        model, processor = random_llava("tiny", init_std=0.2)
        mm = mmfast.load(save_model(model, processor, tmp), device="cpu", dtype="float32")
        got = {}
        with mmfast.apply(mm, json.loads(args.recipe), compile="static") as s:
            for n in (2, args.tokens):
                s.generate([image], ["Describe the image."], max_new_tokens=n)  # captures, keeps buffers
                with _Count() as count:
                    out = s.generate([image], ["Describe the image."], max_new_tokens=n)
                got[n] = (count.n, len(out[0].token_ids))
    (short, n_short), (long, n_long) = got[2], got[args.tokens]
    print(
        f"{long} ops ({n_long} tokens) - {short} ops ({n_short} tokens): {(long - short) / (n_long - n_short):.1f} per token"
    )
    # what each captured graph recorded (a decode step's graph: the kernels a replay launches), and its replays
    print("graphs (recorded ops, replays):", [(len(g.ops), g.replays) for g in ReplayGraph.made])


if __name__ == "__main__":
    main()
