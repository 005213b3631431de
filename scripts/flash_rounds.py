"""FLASH's acceptance on the embedded model by tree shape: tau (tokens a verify cycle) and draft forwards a cycle for
``rounds`` (semi-AR blocks of K levels) and ``total_tokens``, greedy captions of the world's first images.

    OMP_NUM_THREADS=2 PYTHONPATH=. python scripts/flash_rounds.py --images 6 --max-new-tokens 128

What a deeper tree buys in accepted tokens; its cost is the cycle's (``scripts/host_ops.py --embedded``,
``scripts/cycle_time.py`` on a GPU). The default ``model.compile`` (eager on a CPU): the proposal may stop a round
early where no deeper candidate could enter the tree (the same tree).
"""

from __future__ import annotations

import argparse
import logging

from PIL import Image

import mmfast
from mmfast.config import load_recipe
from mmfast.eval.data import resolve_data

SHAPES = ((1, 26), (2, 26), (2, 40), (3, 40))  # (rounds, total_tokens), top_k 10


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    mm = mmfast.load("mmfast/tiny-world", device="cpu", dtype="float32")
    image_dir = resolve_data(load_recipe({}).eval, ("pope",)).image_dir  # the world is generated if missing
    paths = sorted(p for p in image_dir.iterdir() if p.suffix.lower() in (".png", ".jpg"))[: args.images]
    images = [Image.open(p).convert("RGB") for p in paths]
    prompts = ["Please describe this image in detail."] * len(images)
    print(f"| rounds | total_tokens | tau | draft forwards a cycle | cycles ({len(images)} captions) |")
    print("|---|---|---|---|---|")
    for rounds, total in SHAPES:
        params = {"rounds": rounds, "total_tokens": total, "top_k": 10}
        with mmfast.apply(mm, load_recipe({"speculative": {"method": "flash", "params": params}})) as s:
            res = s.generate(images, prompts, max_new_tokens=args.max_new_tokens, seed=0)
        spec = [r.stats["speculative"] for r in res]  # each caption's own
        cycles = sum(st["cycles"] for st in spec)
        tau = sum(st["committed"] for st in spec) / cycles
        per_cycle = (sum(st["draft_forwards"] for st in spec) - len(images)) / cycles  # less each prompt pass
        print(f"| {rounds} | {total} | {tau:.2f} | {per_cycle:.2f} | {cycles} |", flush=True)


if __name__ == "__main__":
    main()
