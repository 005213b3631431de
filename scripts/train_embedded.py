#!/usr/bin/env python
"""Train the embedded world model shipped as ``mmfast/tiny-world`` (CPU, 2 cores, resumable).

    python scripts/train_embedded.py                      # full run, writes mmfast/assets/tiny-world
    python scripts/train_embedded.py --n-train 64 --stage0-epochs 0.2 --stage2-epochs 0.2 \
        --out /tmp/tw --work /tmp/tw-work                 # smoke run

Rerunning the same command after an interruption resumes from the last checkpoint in --work.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging

from mmfast.train.embedded import TrainConfig, train_embedded


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="mmfast/assets/tiny-world")
    p.add_argument("--work", default=".mmfast_cache/train-embedded")
    p.add_argument("--device", default="cpu", help="where the steps run (cpu, cuda); the recipe is the same")
    for f in dataclasses.fields(TrainConfig):
        if isinstance(f.default, tuple):
            item = type(f.default[0]) if f.default else int
            kind = lambda s, item=item: tuple(item(x) for x in s.split(",") if x)  # noqa: E731  e.g. --grounding-layers 1,2
        else:
            kind = int if f.type == "bool" else type(f.default)
        p.add_argument("--" + f.name.replace("_", "-"), type=kind, default=f.default)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = TrainConfig(
        **{
            f.name: (bool(getattr(args, f.name)) if f.type == "bool" else getattr(args, f.name))
            for f in dataclasses.fields(TrainConfig)
        }
    )
    train_embedded(args.out, args.work, cfg, device=args.device)


if __name__ == "__main__":
    main()
