#!/usr/bin/env python
"""The GPU checks of the static KV cache and captured decode step (issue 27 item 1), in one run.

    python scripts/static_cache_gpu_check.py                          # CUDA, fp16, LLaVA-1.5-7B-width slice
    python scripts/static_cache_gpu_check.py --device cpu --dtype float32 --shape tiny   # a CPU smoke run

On a random-weight model of ``--shape`` (no download), greedy decoding of one prompt with
``model.compile`` off, static and auto: the tokens of each, the decode time per token (after one
warm-up call per mode), the capture time ``auto`` reports; and transformers' own
``generate(cache_implementation="static")`` greedy on the same inputs (tokens and time per token, its
first call, which compiles on CUDA, timed apart). Prints one JSON object; asserts nothing, so every figure of
a run is seen.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time

import numpy as np
import torch
from PIL import Image

import mmfast
from mmfast.models.factory import random_llava, save_model


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llava-1.5-7b-slice")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt", default="Describe the image in detail.")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    model, processor = random_llava(args.shape)
    path = save_model(model, processor, tempfile.mkdtemp(prefix="static_check_"))
    del model
    mm = mmfast.load(path, device=args.device, dtype=args.dtype)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (336, 336, 3), dtype=np.uint8))
    out: dict = {
        "shape": args.shape,
        "device": str(mm.device),
        "dtype": args.dtype,
        "tokens": args.tokens,
        "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
    }

    # a random model may say EOS early: the per-token times divide by the tokens each run made
    for mode in ("off", "static", "auto"):
        with mmfast.apply(mm, {"decoding": {"method": "greedy"}}, compile=mode) as s:
            s.generate([image], [args.prompt], max_new_tokens=args.tokens)  # warm-up (and first capture)
            r = s.generate([image], [args.prompt], max_new_tokens=args.tokens)[0]
        n = max(1, len(r.token_ids) - 1)  # the first token comes from the prefill
        out[mode] = {
            "token_ids": r.token_ids,
            "decode_ms_per_token": 1e3 * r.timings.decode_s / n,
            "capture_s": (r.stats or {}).get("capture_s", 0.0),
        }

    inputs = mm.processor(images=image, text=mm.chat_text(args.prompt), return_tensors="pt").to(mm.device)
    inputs["pixel_values"] = inputs["pixel_values"].to(mm.dtype)
    hf = {}
    for run in ("first", "timed"):
        _sync(args.device)
        t0 = time.perf_counter()
        ids = mm.model.generate(
            **inputs,
            do_sample=False,
            max_new_tokens=args.tokens,
            cache_implementation="static",
            pad_token_id=mm.pad_token_id,
        )
        _sync(args.device)
        hf[f"{run}_s"] = time.perf_counter() - t0
    new = ids[0, inputs["input_ids"].shape[1] :].tolist()
    hf["token_ids"] = new
    hf["ms_per_token_incl_prefill"] = 1e3 * hf["timed_s"] / max(1, len(new))
    out["hf_static"] = hf
    stop = set(mm.eos_token_ids)
    hf_cut = next((new[:i] for i, t in enumerate(new) if t in stop), new)
    out["equal"] = {
        "static_vs_off": out["static"]["token_ids"] == out["off"]["token_ids"],
        "auto_vs_off": out["auto"]["token_ids"] == out["off"]["token_ids"],
        "auto_vs_hf_static": out["auto"]["token_ids"] == hf_cut,
        "off_vs_hf_static": out["off"]["token_ids"] == hf_cut,
    }
    for mode in ("off", "static", "auto"):
        out[mode].pop("token_ids")
    out["hf_static"].pop("token_ids")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
