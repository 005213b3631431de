#!/usr/bin/env python
"""Time a Qwen-VL vision tower with transformers' per-chunk attention loop and with mmfast's fused
tower attention (mmfast/models/qwen_tower.py), on one image.

    OMP_NUM_THREADS=1 python scripts/time_qwen_tower.py                      # Qwen2.5-VL-7B tower, 1024 x 768
    OMP_NUM_THREADS=1 python scripts/time_qwen_tower.py --blocks 8 --repeats 3

Builds only the tower of ``--shape`` (``mmfast.models.factory.QWEN_SHAPES``; random weights: timing
does not depend on them), feeds the patches of one ``--image`` (W x H) image resized as the Qwen
processor does, and reports the median over ``--repeats`` runs after one warm-up, wall time and
process CPU time, the two variants alternating so that load changes hit both. It also prints the
largest difference between the two outputs. ``--blocks`` keeps the first N blocks (with their
full-attention indexes) for a quicker run.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import statistics
import time
from types import SimpleNamespace

import torch

from mmfast.hooks import HookSession
from mmfast.models.factory import QWEN_SHAPES, qwen_config
from mmfast.models.qwen_tower import install_fused_tower

logger = logging.getLogger("time_qwen_tower")

_TOWERS = {
    "qwen2_vl": "transformers.models.qwen2_vl.modeling_qwen2_vl:Qwen2VisionTransformerPretrainedModel",
    "qwen2_5_vl": "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl:Qwen2_5_VisionTransformerPretrainedModel",
    "qwen3_vl": "transformers.models.qwen3_vl.modeling_qwen3_vl:Qwen3VLVisionModel",
}


def build_tower(family: str, shape_name: str, blocks: int | None, dtype: torch.dtype):
    import importlib

    shape = QWEN_SHAPES[shape_name]
    if blocks is not None:
        full = tuple(i for i in (shape.fullatt_blocks or (shape.vision_layers - 1,)) if i < blocks) or (blocks - 1,)
        shape = dataclasses.replace(shape, vision_layers=blocks, fullatt_blocks=full)
    vcfg = qwen_config(family, shape, vocab_size=shape.vocab_size).vision_config
    vcfg._attn_implementation = "sdpa"
    module, name = _TOWERS[family].split(":")
    cls = getattr(importlib.import_module(module), name)
    torch.manual_seed(0)
    return cls._from_config(vcfg).to(dtype).eval(), shape


def image_patches(shape, width: int, height: int, dtype: torch.dtype):
    """Random pixels of the patch grid the Qwen processor makes of a ``width`` x ``height`` image."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    factor = shape.patch_size * 2
    h, w = smart_resize(height, width, factor=factor, min_pixels=shape.min_pixels, max_pixels=shape.max_pixels)
    grid = torch.tensor([[1, h // shape.patch_size, w // shape.patch_size]])
    dim = 3 * 2 * shape.patch_size**2
    return torch.randn(int(grid.prod()), dim, dtype=dtype), grid, (w, h)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default="qwen2_5_vl", choices=sorted(_TOWERS))
    ap.add_argument("--shape", default="qwen2.5-vl-7b-slice", choices=sorted(QWEN_SHAPES))
    ap.add_argument("--image", default="1024x768", help="W x H of the image")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--blocks", type=int, default=None, help="keep the first N tower blocks")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dtype = getattr(torch, args.dtype)
    width, height = (int(x) for x in args.image.lower().split("x"))
    device = torch.device(args.device)
    tower, shape = build_tower(args.family, args.shape, args.blocks, dtype)
    tower = tower.to(device)
    pixels, grid, resized = image_patches(shape, width, height, dtype)
    pixels, grid = pixels.to(device), grid.to(device)
    logger.info(
        "%s tower of %s: %d blocks, image %s -> %s, grid %s = %d patches, %s, %d threads, %s",
        args.family,
        args.shape,
        len(tower.blocks),
        args.image,
        "x".join(map(str, resized)),
        grid.tolist()[0],
        pixels.shape[0],
        device,
        torch.get_num_threads(),
        args.dtype,
    )
    adapter = SimpleNamespace(family=args.family, vision_tower=tower)
    hooks = HookSession(tower)
    logger.info("fused attention on %d of %d blocks", install_fused_tower(adapter, hooks), len(tower.blocks))
    variants = {"fused": None, "transformers": None}
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in variants}

    def run(name: str):
        nonlocal hooks
        if name == "transformers":
            hooks.close()
        t0, c0 = time.perf_counter(), time.process_time()
        with torch.inference_mode():
            out = tower(pixels, grid_thw=grid).last_hidden_state
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        took = (time.perf_counter() - t0, time.process_time() - c0)
        if name == "transformers":  # reinstall for the next fused run
            hooks = HookSession(tower)
            install_fused_tower(adapter, hooks)
        return out, took

    for name in variants:  # warm-up
        variants[name], _ = run(name)
    diff = (variants["fused"].float() - variants["transformers"].float()).abs().max().item()
    for i in range(args.repeats):
        for name in variants:
            _, took = run(name)
            times[name].append(took)
            logger.info("repeat %d %s: wall %.3f s, cpu %.3f s", i, name, *took)
    hooks.close()
    med = {k: (statistics.median(t[0] for t in v), statistics.median(t[1] for t in v)) for k, v in times.items()}
    for k, (wall, cpu) in med.items():
        logger.info("median %-12s wall %.3f s  cpu %.3f s", k, wall, cpu)
    logger.info(
        "ratio transformers / fused: wall %.3f, cpu %.3f; max |fused - transformers| = %.3g",
        med["transformers"][0] / med["fused"][0],
        med["transformers"][1] / med["fused"][1],
        diff,
    )


if __name__ == "__main__":
    main()
