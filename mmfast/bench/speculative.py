"""``mmfast bench`` for speculative decoding: tau and wall-clock speedup vs plain autoregressive decoding.

Part 1, the embedded model: for each workload (detailed-description captions, short answers) and each
temperature (0 and 1), plain decoding and every drafter answer the same prompts about the same images
in one process; reported: tau (tokens per target verification forward, bonus included), acceptance by
depth, draft/target forward counts, wall-clock speedup (median of ``repeats``, prefill included, and
decode only), and at T = 0 whether the output is token-identical to plain greedy decoding.

Part 2, a LLaVA-1.5-shaped random model (``bench.shape``, the real CLIP-L/336 and decoder layers at
the 7B width): measured per-forward costs (one decode step, one decoder layer, the LM head, a tree
verification of N tokens, each drafter's proposal) and the speedup they imply for the real 32-layer
LLaVA-1.5-7B with the tau measured in part 1: ``tau / (1 + c + v)``, ``c`` = draft cost per cycle and
``v`` = extra cost of verifying the tree, both relative to one 7B decode step (the slice's per-layer
time scaled to 32 layers).
"""

from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from ..config import load_recipe
from ..model import MMModel
from ..pipeline import apply
from .common import dump, median_time, timing_samples_of, variants, write_markdown
from .render import speculative_plots

logger = logging.getLogger(__name__)

DEFAULT_WORKLOADS = [
    {"name": "caption", "prompt": "Please describe this image in detail.", "max_new_tokens": 256},
    {
        "name": "short",
        "prompt": "What kind of place is this?\nAnswer the question using a single word or phrase.",
        "max_new_tokens": 16,
    },
]


def check_decoding_unread(vs) -> None:
    """Refuse a decoding section the bench would not read: each workload is decoded greedily and by sampling at
    ``bench.params.temperatures`` (:func:`_with_decoding`), so a decoder other than the baseline's greedy one (a
    compare item's ``decoding``, the recipe's ``decoding.method``) was silently replaced by them."""
    from ..errors import ConfigError

    base = vs[0].recipe.decoding
    if base.method != "greedy":
        raise ConfigError(
            "decoding.method",
            f"{base.method!r} is not read by the speculative bench (it decodes greedily and by sampling at "
            "bench.params.temperatures); set greedy, and the temperatures in bench.params.temperatures",
        )
    for v in vs[1:]:
        if v.recipe.decoding != base:
            raise ConfigError(
                f"bench variant {v.name!r}: decoding",
                "a speculative bench variant's decoding section is not read (every variant decodes greedily and by "
                "sampling at bench.params.temperatures, as the baseline); remove it, or set the temperatures in "
                "bench.params.temperatures",
            )


def _with_decoding(v, temperature: float, seed: int):
    data = v.recipe.to_dict()
    data["decoding"] = (
        {"method": "greedy"}
        if temperature == 0
        else {"method": "sample", "params": {"temperature": temperature}, "seed": seed}
    )
    data["decoding"]["max_new_tokens"] = v.recipe.decoding.max_new_tokens
    return load_recipe(data)


def _run_workload(mm: MMModel, recipe, images, wl: dict, repeats: int, warmup: int = 1) -> dict[str, Any]:
    """Plain or speculative decoding of ``wl`` on ``images``: ``warmup`` untimed short runs (``bench.warmup``;
    the first settles what a drafter calibrates), then ``repeats`` timed passes in fresh sessions."""
    batches = [mm.prepare([im], [wl["prompt"]]) for im in images]
    if warmup:
        with apply(mm, recipe) as session:
            for _ in range(warmup):
                session.run(batches[0], max_new_tokens=8)
            recipe = _settled(recipe, session.drafter)
    walls, decodes, outs = [], [], []
    for _ in range(repeats):
        # a fresh session per repeat: a drafter that learns across requests (prompt lookup's trigram
        # table) must not have seen these very answers in an earlier repeat or in the warm-up
        with apply(mm, recipe) as session:
            t0 = time.perf_counter()
            res = [session.run(b, max_new_tokens=wl["max_new_tokens"])[0] for b in batches]
            walls.append(time.perf_counter() - t0)
        decodes.append(sum(r.timings.decode_s for r in res))
        outs = res
    spec = [r.stats.get("speculative") for r in outs if r.stats.get("speculative")]
    agg: dict[str, Any] = {}
    if spec:
        cycles = sum(s["cycles"] for s in spec)
        agg = {
            "tau": sum(s["committed"] for s in spec) / cycles if cycles else 0.0,
            "cycles": cycles,
            "draft_forwards": sum(s["draft_forwards"] for s in spec),
            "target_forwards": sum(s["target_forwards"] for s in spec),
            "draft_forwards_per_cycle": sum(s["draft_forwards"] for s in spec) / cycles if cycles else 0.0,
            **_pool_depths(spec),
        }
    return {
        "wall_s": statistics.median(walls),
        "decode_s": statistics.median(decodes),
        "tokens": [r.token_ids for r in outs],
        "n_new_tokens": sum(len(r.token_ids) for r in outs),
        **agg,
    }


def _settled(recipe, drafter):
    """``recipe`` with what its drafter settled in the warm-up fixed, so that no timed repeat redoes it: layer skip's
    calibrated skip set (``skip: null`` calibrates on a session's first sample, the warm-up's and every timed
    repeat's ``batches[0]``: the same set)."""
    spec = recipe.speculative
    if spec is None or spec.method != "layer_skip" or spec.params.skip is not None:
        return recipe
    data = recipe.to_dict()
    data["speculative"]["params"] = {**(data["speculative"].get("params") or {}), "skip": sorted(drafter.skip)}
    return load_recipe(data)


def _pool_depths(spec: list[dict]) -> dict[str, dict[str, Any]]:
    """Acceptance at each draft depth over all samples: their counts pooled (the rate is per cycle that tried that
    depth), not their rates averaged (a sample of two cycles would weigh as much as one of two hundred)."""
    tried: dict[int, int] = {}
    accepted: dict[int, int] = {}
    for s in spec:
        for d, n in s["tried_by_depth"].items():
            tried[int(d)] = tried.get(int(d), 0) + n
            accepted[int(d)] = accepted.get(int(d), 0) + s["accepted_by_depth"][d]
    depths = sorted(tried)
    return {
        "acceptance_by_depth": {str(d): accepted[d] / tried[d] for d in depths},
        "tried_by_depth": {str(d): tried[d] for d in depths},
        "accepted_by_depth": {str(d): accepted[d] for d in depths},
    }


def run_speculative_bench(recipe, mm: MMModel, out: Path, limit: int | None) -> dict[str, Any]:
    cfg = recipe.bench
    vs = variants(recipe)
    images = [s.image for s in timing_samples_of(recipe, limit or cfg.n_samples, tasks=("chair",))]
    workloads = cfg.params.get("workloads", DEFAULT_WORKLOADS)
    temps = cfg.params.get("temperatures", [0.0, 1.0])
    rows, results = [], {}
    for temp in temps:
        for wl in workloads:
            key = f"{wl['name']}@T{temp:g}"
            base = None
            for v in vs:
                logger.info("bench %s %s", key, v.name)
                r = _run_workload(
                    mm, _with_decoding(v, temp, recipe.decoding.seed), images, wl, cfg.repeats, cfg.warmup
                )
                if base is None:
                    base = r
                # tokens per second (at T = 1 the variants sample different, equally distributed, answers)
                r["speedup"] = (r["n_new_tokens"] / r["wall_s"]) / (base["n_new_tokens"] / base["wall_s"])
                r["decode_speedup"] = (r["n_new_tokens"] / r["decode_s"]) / (base["n_new_tokens"] / base["decode_s"])
                r["lossless"] = (r["tokens"] == base["tokens"]) if temp == 0 else None
                results.setdefault(key, {})[v.name] = {k: val for k, val in r.items() if k != "tokens"}
                rows.append(
                    [
                        key,
                        v.name,
                        r.get("tau"),
                        r.get("draft_forwards_per_cycle"),
                        r["n_new_tokens"],
                        r["wall_s"],
                        r["speedup"],
                        r["decode_speedup"],
                        r["lossless"],
                    ]
                )
    header = [
        "workload",
        "variant",
        "tau",
        "draft fwd/cycle",
        "new tokens",
        "wall s",
        "speedup",
        "decode speedup",
        "identical to greedy",
    ]
    # the slice runs where the benchmarked model runs, so a GPU run measures GPU costs
    shaped = _shaped_costs(recipe, vs, results, mm.device) if cfg.shape else None
    return {"header": header, "rows": rows, "results": results, "shaped": shaped}


@torch.inference_mode()
def _shaped_costs(recipe, vs, results, device: torch.device) -> dict[str, Any]:
    """Per-forward costs on the shaped random model and the implied 7B speedups."""
    import tempfile

    import numpy as np
    from PIL import Image

    from ..models.factory import random_llava
    from ..speculative._eagle_model import write_random_draft
    from ..speculative.engine import SpecContext

    cfg = recipe.bench
    model, processor = random_llava(cfg.shape, dtype=torch.float32)
    mm = MMModel(model.to(device), processor, cfg.shape)
    size = model.config.vision_config.image_size
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (size, size, 3), dtype=np.uint8))
    batch = mm.prepare([image], ["Please describe this image in detail."])
    n_layers = len(mm.adapter.layers)
    out: dict[str, Any] = {"shape": cfg.shape, "drafters": {}}
    with apply(mm, load_recipe({})) as session:
        inputs = session.build_inputs(batch, session.encode(batch))
        state, _ = session.runner.prefill(inputs)
        tok = torch.tensor([[5]], device=device)
        cp = state.checkpoint()

        def step(n: int = 1):
            session.runner.step(state, tok.expand(1, n).contiguous())
            state.rollback(cp)

        t_step = median_time(step, 0, 5)
        h = torch.randn(1, 1, model.config.text_config.hidden_size, device=device)
        t_head = median_time(lambda: mm.adapter.lm_head(h), 0, 5)
        t_layer = max(1e-9, (t_step - t_head) / n_layers)
        t_step_7b = t_step + (32 - n_layers) * t_layer
        out.update(
            {
                "t_step_s": t_step,
                "t_layer_s": t_layer,
                "t_head_s": t_head,
                "t_step_7b_est_s": t_step_7b,
                "n_layers": n_layers,
            }
        )
        verify_cache: dict[int, float] = {}

        def verify_7b(n: int) -> float:
            if n not in verify_cache:
                t_n = median_time(lambda: step(n), 0, 5)
                t_head_n = median_time(lambda: mm.adapter.lm_head(h.expand(1, n, -1)), 0, 5)
                verify_cache[n] = (t_n - t_head_n) / n_layers * 32 + t_head_n
            return verify_cache[n]

        caption_t0 = results.get("caption@T0", {})  # exactly T = 0: "caption@T0.7" starts so too
    for v in vs:
        if v.recipe.speculative is None:
            continue
        spec = v.recipe.speculative
        with tempfile.TemporaryDirectory() as tmp:
            params = dict(spec._to_recipe()["params"])
            if spec.method in ("msd", "flash"):
                params["weights"] = str(write_random_draft(mm, spec.method, Path(tmp) / spec.method))
            vr = load_recipe({"speculative": {"method": spec.method, "params": params}})
            with apply(mm, vr) as dsession:
                dinputs = dsession.build_inputs(batch, dsession.encode(batch))
                dstate, pre = dsession.runner.prefill(
                    dinputs, all_hidden=getattr(dsession.drafter, "needs_hidden", False)
                )
                ctx = SpecContext(
                    dsession, dstate, dinputs, [5], 0.0, 0, 1.0, torch.Generator().manual_seed(0), prefill=pre
                )
                dsession.drafter.begin(ctx)
                trees = []

                def propose():
                    trees.append(dsession.drafter.propose(ctx, 5))

                t_prop = median_time(propose, 0, 5)
                n_nodes = max(1, trees[-1].n)
        # a layer-skip draft runs the target itself: scale its forwards to 32 layers
        if spec.method == "layer_skip":
            frac = (  # skip: null calibrates skip_fraction of the layers; a given set (even empty) is what runs
                1 - float(params.get("skip_fraction", 0.5))
                if params.get("skip") is None
                else 1 - len(params["skip"]) / n_layers
            )
            gamma = caption_t0.get(v.name, {}).get("draft_forwards_per_cycle", 1.0) or 1.0
            t_prop = gamma * (t_head + frac * 32 * t_layer)
        c = t_prop / t_step_7b
        vv = verify_7b(n_nodes + 1) / t_step_7b - 1
        tau = caption_t0.get(v.name, {}).get("tau")
        out["drafters"][v.name] = {
            "propose_s": t_prop,
            "tree_tokens": n_nodes + 1,
            "c": c,
            "v": vv,
            "tau_embedded_caption_T0": tau,
            "projected_speedup_7b": (tau / (1 + c + vv)) if tau else None,
        }

    return out


FLASH_NOTE = (
    "flash: mmfast's drafter is the paper's (latent compression + semi-autoregressive head, K = 5 per forward, "
    "tree per docs/methods.md). FLASH's released LLaVA-1.5 evaluation (ZihuaEvan/FlashSD, gen_ee_answer_llava1.5.py, "
    "the README's command) runs an EAGLE-1 autoregressive draft over the fixed mc_sim_7b_63 tree (25 drafts under the root) instead "
    "(one draft forward per tree level, temperature 1.0 by default); its semi-autoregressive head is evaluated only by "
    "later, separate scripts that draft one chain. The release's tau is therefore not like for like with this tau."
)


def speculative_notes(result: dict[str, Any]) -> list[str]:
    """The notes under the bench table (the FLASH note when a flash variant ran)."""
    notes = [
        "tau = tokens committed per target verification forward, bonus token included (FLASH's convention; MSD's acclen = tau - 1).",
        "speedup = generated tokens per second relative to plain decoding, same prompts and images, prefill included (decode speedup: excluded);"
        " at T = 0 the tokens are identical, so it is the wall-time ratio.",
        "identical to greedy: token-for-token equality with plain greedy decoding (T = 0, fp32).",
    ]
    if any("flash" in str(row[1]) for row in result.get("rows", [])):
        notes.append(FLASH_NOTE)
    return notes


def write_speculative_report(result: dict[str, Any], out: Path, command: str) -> None:
    notes = speculative_notes(result)
    write_markdown(
        out / "results.md",
        "Speculative decoding on the embedded world",
        command,
        result["header"],
        result["rows"],
        notes,
        model=result.get("model"),
    )
    shaped = result.get("shaped")
    if shaped:
        rows = [
            [
                n,
                d["tree_tokens"],
                d["propose_s"] * 1000,
                d["c"],
                d["v"],
                d["tau_embedded_caption_T0"],
                d["projected_speedup_7b"],
            ]
            for n, d in shaped["drafters"].items()
        ]
        write_markdown(
            out / "projected_7b.md",
            f"Per-forward costs on {shaped['shape']} and projected LLaVA-1.5-7B speedup",
            command,
            [
                "drafter",
                "tree tokens",
                "propose ms",
                "c (draft / 7B step)",
                "v (verify overhead)",
                "tau (embedded, captions, T=0)",
                "projected 7B speedup",
            ],
            rows,
            [
                f"Measured on the slice ({shaped['n_layers']} decoder layers at the 7B width): decode step {shaped['t_step_s'] * 1000:.1f} ms, "
                f"one decoder layer {shaped['t_layer_s'] * 1000:.1f} ms, LM head {shaped['t_head_s'] * 1000:.1f} ms; a 32-layer step is estimated as "
                f"step + (32 - {shaped['n_layers']}) x layer = {shaped['t_step_7b_est_s'] * 1000:.1f} ms.",
                "projected speedup = tau / (1 + c + v); drafts use random weights here (only their cost is measured), tau comes from the embedded model.",
                "layer_skip's draft cost is its measured forwards per cycle x (LM head + unskipped fraction of 32 layers).",
            ],
        )
    result["kind"] = "speculative"
    speculative_plots(result, out, out.name)
    dump(out / "summary.json", {k: v for k, v in result.items()})
