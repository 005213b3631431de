#!/usr/bin/env python
"""Train HICom's global branch (32 instruction-conditioned queries) for a LLaVA model, on CPU.

    python scripts/train_hicom.py                                   # embedded model, full run
    python scripts/train_hicom.py --model /tmp/tw --work /tmp/tw-hicom --n-train 32 --steps 4 \
        --batch 2 --checkpoint-every 2                              # smoke run

Vision tower, projector, LLM and the CLIP guide stay frozen. Writes ``<model>/hicom_global.safetensors``
and ``hicom_global.json`` (or ``--out``), which the ``hicom`` pruning method loads by default.
Rerunning the same command after an interruption resumes from the last checkpoint in --work.
"""

from __future__ import annotations

import argparse
import logging

from mmfast.train.common import add_config_args, config_from_args, run_or_exit_2
from mmfast.train.hicom import HIComTrainConfig, train_hicom_global


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", default="mmfast/tiny-world", help="embedded name or model directory (needs clip/ or --clip-model)"
    )
    p.add_argument("--out", default=None, help="weights file (default <model dir>/hicom_global.safetensors)")
    p.add_argument("--work", default=".mmfast_cache/train-hicom")
    p.add_argument("--clip-model", default=None, help="guide CLIP (default <model dir>/clip)")
    add_config_args(p, HIComTrainConfig)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = config_from_args(p, args, HIComTrainConfig)
    run_or_exit_2("train_hicom", train_hicom_global, args.model, args.out, args.work, cfg, clip_model=args.clip_model)


if __name__ == "__main__":
    main()
