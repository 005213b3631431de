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
import logging

from mmfast.train.common import add_config_args, config_from_args, run_or_exit_2
from mmfast.train.dynamic_llava import DynamicTrainConfig, train_dynamic_llava


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="mmfast/tiny-world", help="embedded model name or local LLaVA directory")
    p.add_argument("--out", default=None, help="predictor directory (default: <model dir>/dynamic_llava)")
    p.add_argument("--work", default=".mmfast_cache/train-dynamic-llava", help="checkpoints and feature cache")
    p.add_argument("--model-out", default=None, help="where the tuned model goes when --llm-lr > 0")
    add_config_args(p, DynamicTrainConfig)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = config_from_args(p, args, DynamicTrainConfig)
    run_or_exit_2(
        "train_dynamic_llava", train_dynamic_llava, args.model, args.out, args.work, cfg, model_out=args.model_out
    )


if __name__ == "__main__":
    main()
