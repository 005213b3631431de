#!/usr/bin/env python
"""The GPU checks of the static KV cache and the captured decode step (issue 27 item 1), in one run.

    python scripts/static_cache_gpu_check.py                       # CUDA, the embedded model in fp16
    python scripts/static_cache_gpu_check.py --device cpu --dtype float32 --recipes greedy,divprune   # CPU smoke

For every recipe of ``--recipes`` (decoders, pruners at their test settings, the trained drafts) on the
embedded model (real weights, real drafts), greedy tokens of a few caption prompts with ``model.compile``
``off`` (dynamic cache), ``static`` (static cache, eager steps) and ``auto`` (static cache, each step one
captured CUDA graph). ``static`` and ``auto`` launch the same kernels on the same shapes, so their tokens must
be identical: a difference means a captured step replays something its capture baked in (the check this
script exists for; ``name@1``: one-token answers, whose prefill is the captured part). ``off`` against ``static`` is
reported too (other key lengths: fp16 may differ in the
last bit). Also each mode's decode ms per token (after one warm-up call) and the capture time. Prints one
JSON object and exits 1 when any static / auto pair differs, or when a recipe of ``CAPTURED`` (the
pruners whose probes act at prefill only) was not captured under ``auto``. ``--fuse-norms``: every recipe with
``model.fuse_norms`` on (what turning it on by default under ``auto`` waits for: the methods' captured steps with
the fused norms, token-identical to their eager twins).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import sys

import torch

import mmfast
from mmfast.config import load_recipe
from mmfast.eval.data import resolve_data
from mmfast.registry import PRUNERS

RECIPES = {
    "greedy": {},
    "fused_norms": {"model": {"fuse_norms": True}},  # Inductor's RMSNorm kernels in both modes, captured under auto
    "beam": {"decoding": {"method": "beam", "params": {"num_beams": 3}}},
    "vcd": {"decoding": {"method": "vcd", "seed": 0}},  # its noised image follows the seed
    "sample": {"decoding": {"method": "sample", "params": {"top_k": 20}, "seed": 3}},
    "flash": {"speculative": {"method": "flash", "params": {"top_k": 4, "total_tokens": 12}}},
    "flash_rounds2": {"speculative": {"method": "flash", "params": {"top_k": 4, "total_tokens": 16, "rounds": 2}}},
    "msd": {"speculative": {"method": "msd", "params": {"depth": 6, "top_k": 4, "total_tokens": 8}}},
    "prompt_lookup": {"speculative": {"method": "prompt_lookup"}},
    # sampled cycles on the device: the point-mass verdict on uniforms drawn before its graph
    "sample_flash": {
        "decoding": {"method": "sample", "params": {"top_k": 20}, "seed": 3},
        "speculative": {"method": "flash", "params": {"top_k": 4, "total_tokens": 12}},
    },
    "sample_msd": {
        "decoding": {"method": "sample", "params": {"top_k": 20}, "seed": 3},
        "speculative": {"method": "msd", "params": {"depth": 6, "top_k": 4, "total_tokens": 8}},
    },
    "vhr": {"decoding": {"method": "vhr"}},  # its head-scaling pre-hooks replay inside the step
    # its beams' step and tree look-ahead captured, the last layer's rows carried out of them (graphs per call: the
    # beams' buffers are the call's own)
    "opera": {"decoding": {"method": "opera", "params": {"num_beams": 3, "num_attn_candidates": 3}}},
    # attention overrides whose static decode steps read slot classes staged before each step
    "pai": {"decoding": {"method": "pai"}},
    "clearsight": {"decoding": {"method": "clearsight"}},
    "only": {"decoding": {"method": "only", "params": {"sample": False}}},
}
PRUNER_RECIPES = (
    "divprune",
    "pyramiddrop",
    "fastv",
    "dart",
    "sparsevlm",
    "mustdrop",
    "tome",
    "visionzip",
    "dynamic_llava",
    "zipvl",
)
#: ``name@1``: one-token calls (a POPE answer, a TTFT), whose prefill is the captured part (ZipVL, Dynamic-LLaVA;
#: MustDrop's, whose KV policy then trims nothing). MustDrop's tower under ``auto`` is captured with a padded merge,
#: equal to the eager tower's (``static``) within fp rounding: a token that differs there says how often that flips a
#: decision in fp16
ONE_TOKEN = ("zipvl@1", "dynamic_llava@1", "mustdrop@1")
#: read LLM attention at prefill only, or act in the step by tensor work only (Dynamic-LLaVA's text rule, VHR,
#: ZipVL's quantised layers and the query its override keeps): their decode steps must be captured graphs under
#: ``auto`` (and the one-token calls' prefills)
CAPTURED = (
    "fastv",
    "dart",
    "sparsevlm",
    "mustdrop",
    "dynamic_llava",
    "vhr",
    "zipvl",
    "pai",
    "clearsight",
    "only",
    *ONE_TOKEN,
)


ONE_TOKEN_PROMPT = "Is there a red object in the image? Answer the question using a single word or phrase."


def recipe_of(name: str, mm, fuse_norms: bool = False) -> dict:
    """``name``'s recipe; ``fuse_norms``: with ``model.fuse_norms`` on (in all three modes)."""
    if name in RECIPES:
        recipe = copy.deepcopy(RECIPES[name])
    else:
        recipe = {"pruning": [{"method": name, "params": PRUNERS.get(name).cls.test_params(mm.adapter)}]}
    if fuse_norms:
        recipe.setdefault("model", {})["fuse_norms"] = True
    return recipe


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--recipes", default=",".join([*RECIPES, *PRUNER_RECIPES, *ONE_TOKEN]))
    ap.add_argument("--fuse-norms", action="store_true", help="every recipe with model.fuse_norms on (all modes)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("mmfast.runtime").setLevel(logging.INFO)  # the fall-back reasons

    mm = mmfast.load("mmfast/tiny-world", device=args.device, dtype=args.dtype)
    image_dir = resolve_data(load_recipe({}).eval, ("pope",)).image_dir  # the world is generated if missing
    images = sorted(p for p in image_dir.iterdir() if p.suffix.lower() in (".png", ".jpg"))[: args.samples]
    prompts = ["Please describe this image in detail."] * len(images)
    out: dict = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "dtype": args.dtype,
        "fuse_norms": args.fuse_norms,
        "recipes": {},
    }
    bad = []
    for name in args.recipes.split(","):
        row: dict = {}
        tokens = {}
        try:
            method, _, count = name.partition("@")
            n_new = int(count) if count else args.tokens
            asked = [ONE_TOKEN_PROMPT] * len(images) if n_new == 1 else prompts
            recipe = load_recipe(recipe_of(method, mm, args.fuse_norms))
            for mode in ("off", "static", "auto"):
                with mmfast.apply(mm, recipe, compile=mode) as s:
                    # warm-up: the first capture (the graphs are kept for the next calls of the session)
                    warm = s.generate(images[:1], asked[:1], max_new_tokens=n_new)
                    res = [s.generate([im], [p], max_new_tokens=n_new)[0] for im, p in zip(images, asked)]
                    graphs = len(s.runner.pool.graphs)
                    norms = [
                        m.forward for m in s.adapter.language_model.modules() if type(m).__name__.endswith("RMSNorm")
                    ]
                n = sum(max(1, len(r.token_ids) - 1) for r in res)
                tokens[mode] = [r.token_ids for r in res]
                row[mode] = {
                    "decode_ms_per_token": round(1e3 * sum(r.timings.decode_s for r in res) / n, 3),
                    "capture_ms_warmup": round(1e3 * (warm[0].stats or {}).get("capture_s", 0.0), 2),
                    # the timed calls: 0 when they replay the warm-up's graphs (new tree sizes capture)
                    "capture_ms": round(1e3 * sum((r.stats or {}).get("capture_s", 0.0) for r in res), 2),
                    "graphs_kept": graphs,
                    # the LM's RMSNorm modules running the compiled kernel (0 without --fuse-norms, or where
                    # compiling failed: the warning says why)
                    "norms_fused": sum(bool(getattr(f, "mmfast_fused_norm", False)) for f in norms),
                }
            row["static_equals_auto"] = tokens["static"] == tokens["auto"]
            row["off_equals_static"] = tokens["off"] == tokens["static"]
            row["auto_captured"] = row["auto"]["graphs_kept"] > 0
            missed = args.device.startswith("cuda") and name in CAPTURED and not row["auto_captured"]
            if not row["static_equals_auto"] or missed:
                bad.append(name)
        except Exception as exc:  # noqa: BLE001  every recipe is reported; a crash is a finding
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            bad.append(name)
        out["recipes"][name] = row
        print(name, json.dumps(row), flush=True)
    out["differ_or_failed"] = bad
    print(json.dumps(out, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
