#!/usr/bin/env python
"""How well a stage-0 vision checkpoint sees the world: its training-only dense head on val images.

    python scripts/probe_stage0.py .mmfast_cache/train-embedded/refine_stage0_final --n 300

Reports patch accuracy (all / foreground / background patches), the mean per-category AUC of object
presence scored as the max over patches of the dense head's probability, and recall at probability 0.5
by visible object area. Val images are rendered here; the train split is never touched.
"""

from __future__ import annotations

import argparse
import logging

import numpy as np
import torch
import torch.nn.functional as F

from mmfast.models.factory import SHAPES
from mmfast.train.common import load_checkpoint
from mmfast.train.embedded import TrainConfig, new_stage0
from mmfast.train.world_data import N_CATS, render_split, to_pixel_values

logger = logging.getLogger("probe_stage0")


def auc(y: np.ndarray, s: np.ndarray) -> float:
    """ROC AUC by the rank-sum formula (ties broken by order)."""
    r = np.empty(len(s))
    r[np.argsort(s)] = np.arange(1, len(s) + 1)
    npos = y.sum()
    return float((r[y == 1].sum() - npos * (npos + 1) / 2) / (npos * (len(y) - npos)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="a stage-0 checkpoint directory (stage0_final, refine_stage0_final, ...)")
    p.add_argument("--n", type=int, default=300, help="val images")
    p.add_argument("--tokenizer", default="mmfast/assets/tiny-world", help="any directory with the world tokenizer")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from transformers import AutoTokenizer

    shape = SHAPES["world"]
    val = render_split(0, "val", args.n, shape.patch_size)
    model = new_stage0(shape, AutoTokenizer.from_pretrained(args.tokenizer), TrainConfig())
    load_checkpoint(args.checkpoint, {"m": model})
    model.eval()
    probs = []
    with torch.inference_mode():
        for i in range(0, len(val), 50):
            out = model.clip.vision_model(
                pixel_values=to_pixel_values(val.pixels[i : i + 50]), output_hidden_states=True
            )
            probs.append(F.softmax(model.dense(out.hidden_states[-2][:, 1:]), -1).numpy())  # [b, P, labels]
    prob = np.concatenate(probs)
    hist = val.patch_hist.astype(np.float64)  # [N, P, labels] pixel counts
    target, pred = hist.argmax(-1), prob.argmax(-1)  # [N, P]
    fg = target > 0
    logger.info(
        "patch accuracy: all %.3f, foreground %.3f, background %.3f",
        (pred == target).mean(),
        (pred[fg] == target[fg]).mean(),
        (pred[~fg] == target[~fg]).mean(),
    )
    present = val.present.astype(int)  # [N, C]
    score = prob[:, :, 1 : 1 + N_CATS].max(1)  # [N, C] label = category index + 1
    aucs = [auc(present[:, c], score[:, c]) for c in range(N_CATS) if 0 < present[:, c].sum() < len(present)]
    logger.info("presence: mean per-category AUC %.3f over %d categories", np.mean(aucs), len(aucs))
    area = hist[:, :, 1 : 1 + N_CATS].sum(1)[present == 1]  # visible pixels of each present category
    hit = (score > 0.5)[present == 1]
    logger.info("false-positive rate at 0.5: %.3f", (score > 0.5)[present == 0].mean())
    for lo, hi in [(0, 64), (64, 256), (256, 1024), (1024, 4096), (4096, None)]:
        sel = (area >= lo) & (area < (hi or np.inf))
        logger.info(
            "visible area %5d-%-5s px: n=%4d  recall@0.5 %.2f",
            lo,
            hi or "",
            sel.sum(),
            hit[sel].mean() if sel.any() else float("nan"),
        )


if __name__ == "__main__":
    main()
