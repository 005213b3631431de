#!/usr/bin/env python
"""Train an MSD or FLASH speculative draft for a LLaVA target by self-distillation, on CPU (resumable).

    OMP_NUM_THREADS=2 nice -n 10 python scripts/train_drafts.py --draft msd     # -> mmfast/assets/tiny-world/msd/
    OMP_NUM_THREADS=2 nice -n 10 python scripts/train_drafts.py --draft flash   # reuses msd's cached answers
    python scripts/train_drafts.py --draft msd --model /tmp/tw --work /tmp/tw-drafts --out /tmp/tw-msd \
        --n-images 16 --n-text 8 --gen-batch 8 --steps 6 --batch 2 --checkpoint-every 3   # smoke run

Stage 1 generates the target's greedy answers and final hidden states on the world's train images
(shared by both drafts: same --work); stage 2 trains the draft (progress bar with the time left).
Measured on the 2-core machine under shared load, one thread, 256-wide target: ~0.3 s per visual
sample and ~0.05 s per text-only sample (defaults: 2000 + 800, ~11 min, once), then ~0.25 s per MSD
step (half of them text-only and cheaper) and ~0.35 s per FLASH step (defaults: 2000 steps: MSD ~9 min,
FLASH ~12 min). The first shard and the first 10 steps log measured estimates.
Rerunning the same command after an interruption resumes from the last shard / checkpoint in --work.
"""

from __future__ import annotations

import argparse
import logging

from mmfast.train.common import add_config_args, config_from_args, run_or_exit_2
from mmfast.train.drafts import DraftTrainConfig, train_draft

logger = logging.getLogger("train_drafts")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--draft", required=True, choices=["msd", "flash"])
    p.add_argument("--model", default="mmfast/tiny-world", help="embedded name or model directory")
    p.add_argument("--out", default=None, help="output directory (default <model dir>/<draft>)")
    p.add_argument("--work", default=".mmfast_cache/train-drafts", help="data shards and checkpoints")
    add_config_args(p, DraftTrainConfig)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = config_from_args(p, args, DraftTrainConfig)
    n_vis = cfg.n_images
    n_txt = cfg.n_text if args.draft == "msd" else 0
    logger.info(
        "plan: %d visual + %d text-only target answers (cached in %s, shared by msd and flash), then %d steps x %d "
        "sequences; the first shard and the first 10 steps print measured time estimates",
        n_vis,
        n_txt,
        args.work,
        cfg.steps,
        cfg.batch,
    )
    run_or_exit_2("train_drafts", train_draft, args.model, args.draft, args.out, args.work, cfg)


if __name__ == "__main__":
    main()
