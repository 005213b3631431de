#!/usr/bin/env python
"""Train Dynamic-LLaVA's predictors for a LLaVA model on the world data (CPU, resumable).

    python scripts/train_dynamic_llava.py          # embedded model -> mmfast/assets/tiny-world/dynamic_llava
    python scripts/train_dynamic_llava.py --model /tmp/tw --out /tmp/tw-dl --work /tmp/tw-dl-work \
        --n-train 16 --batch 2 --epochs 0.25 --workers 1              # smoke run

Rerunning the same command after an interruption resumes from the last checkpoint in --work. The LLM is
frozen unless --llm-lr > 0, which also needs --model-out (the tuned model is written there).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from mmfast.errors import MMFastError
from mmfast.train.dynamic_llava import DynamicTrainConfig, train_dynamic_llava


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="mmfast/tiny-world", help="embedded model name or local LLaVA directory")
    p.add_argument("--out", default=None, help="predictor directory (default: <model dir>/dynamic_llava)")
    p.add_argument("--work", default=".mmfast_cache/train-dynamic-llava", help="checkpoints and feature cache")
    p.add_argument("--model-out", default=None, help="where the tuned model goes when --llm-lr > 0")
    for f in dataclasses.fields(DynamicTrainConfig):
        kind = int if f.type == "bool" else type(f.default)
        p.add_argument("--" + f.name.replace("_", "-"), type=kind, default=f.default)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = DynamicTrainConfig(
            **{
                f.name: (bool(getattr(args, f.name)) if f.type == "bool" else getattr(args, f.name))
                for f in dataclasses.fields(DynamicTrainConfig)
            }
        )
    except ValueError as exc:  # a config value out of range
        p.error(str(exc))
    try:
        train_dynamic_llava(args.model, args.out, args.work, cfg, model_out=args.model_out)
    except MMFastError as exc:  # a user error (missing model, a work dir of another run, ...): exit 2
        logging.getLogger("train_dynamic_llava").error("%s", exc)
        sys.exit(2)


if __name__ == "__main__":
    main()
