#!/usr/bin/env python
"""HICom diagnostics on the embedded model (issue 21, item 3): on the same POPE inputs, the local
weights of mmfast's blend rule against the release's rule (``local_rule: release``), how the pooled
tokens sit among the real projected tokens, and what the trained global branch emits.

    python scripts/hicom_diagnostics.py [--recipe RECIPE] [--n 24]
"""

import argparse
import json

import torch
import torch.nn.functional as F

import mmfast
from mmfast.bench.common import timing_samples_of
from mmfast.config import load_recipe
from mmfast.pipeline import Session
from mmfast.pruning._grid import group_index
from mmfast.pruning._hicom_guide import guide_text, load_clip_guide, model_dir
from mmfast.pruning._hicom_modules import (
    GLOBAL_WEIGHTS,
    load_global,
    local_compress,
    local_grid,
)

torch.set_num_threads(1)

ap = argparse.ArgumentParser()
ap.add_argument("--recipe", default="configs/world_eval.yaml")
ap.add_argument("--n", type=int, default=24)
args = ap.parse_args()
recipe = load_recipe(args.recipe, overrides=["eval.tasks=[pope]"])
samples = timing_samples_of(recipe, args.n)
mm = mmfast.load("mmfast/tiny-world", device="cpu", dtype="float32")
ad = mm.adapter
clip = load_clip_guide(None, mm.model, mm.tokenizer)
out = {}
with Session(mm, load_recipe({})) as s, torch.no_grad():
    batch = mm.prepare([x.image for x in samples], [x.prompt for x in samples])
    pv = batch.pixel_values.to(ad.vision_tower.dtype)
    hs = ad.vision_tower(pv, output_hidden_states=True).hidden_states
    vision = s.encode(batch)
    feats = torch.stack(vision.features)  # [n, N, Dv] feature-layer patches
    last = hs[-1][:, 1:]  # [n, N, Dv]
    rows, cols = ad.grid
    guides = clip.text_embeds([guide_text(p) for p in batch.prompts])  # [n, P]
    keys_ours = clip.patch_embeds(last)  # visual_projection(post_layernorm(.))
    keys_rel = clip.patch_embeds(last, post_layernorm=False)  # the release: no post-layernorm
    P = keys_rel.shape[-1]
    grid = local_grid(1, rows, cols, 1, 3, 32)  # hicom-64: 32 local tokens requested
    grid64 = local_grid(1, rows, cols, 1, 3, 64)
    proj_real = ad.projector(feats)  # [n, N, d] real tokens after the projector
    stats = {"grid_hicom64": list(grid), "grid_local64": list(grid64)}
    for name, g in (("hicom64_local", grid), ("local64", grid64)):
        idx = group_index((1, rows, cols), g)  # [G, S]
        valid = idx >= 0
        eff_o, eff_r, cos_w, top_agree, maxw_o, maxw_r = [], [], [], [], [], []
        nrm_pool, nrm_real, nn_cos_pool, nn_cos_rand = [], [], [], []
        for i in range(len(samples)):
            v = feats[i].reshape(1, rows, cols, -1)
            ko = keys_ours[i].reshape(1, rows, cols, -1)
            tok_o, w_o, _ = local_compress(v, ko, guides[i], g, 0.5, 20.0)
            # the release's local rule (direct guide, no clip scale): softmax(g . k / sqrt(P)) within each group
            _, w_r, _ = local_compress(
                v, keys_rel[i].reshape(1, rows, cols, -1), guides[i], g, 0.0, 0.0, rule="release"
            )
            eff_o.append((1 / (w_o**2).sum(-1)).mean().item())
            eff_r.append((1 / (w_r**2).sum(-1)).mean().item())
            maxw_o.append(w_o.max(-1).values.mean().item())
            maxw_r.append(w_r.max(-1).values.mean().item())
            cos_w.append(F.cosine_similarity(w_o, w_r, -1).mean().item())
            top_agree.append((w_o.argmax(-1) == w_r.argmax(-1)).float().mean().item())
            p_o = ad.projector(tok_o.float())  # [G, d]
            real = proj_real[i]  # [N, d]
            nrm_pool.append(p_o.norm(dim=-1).mean().item())
            nrm_real.append(real.norm(dim=-1).mean().item())
            nn_cos_pool.append(F.cosine_similarity(p_o[:, None], real[None], -1).max(-1).values.mean().item())
        stats[name] = {
            "groups": int(idx.shape[0]),
            "members_per_group": int(valid.sum(1).float().mean()),
            "effective_members_ours": sum(eff_o) / len(eff_o),
            "effective_members_release": sum(eff_r) / len(eff_r),
            "max_weight_ours": sum(maxw_o) / len(maxw_o),
            "max_weight_release": sum(maxw_r) / len(maxw_r),
            "cos(weights ours, release)": sum(cos_w) / len(cos_w),
            "argmax agreement": sum(top_agree) / len(top_agree),
            "projected norm pooled": sum(nrm_pool) / len(nrm_pool),
            "projected norm real": sum(nrm_real) / len(nrm_real),
            "max cos pooled->real projected token": sum(nn_cos_pool) / len(nn_cos_pool),
        }
    # global branch: how alike are its 32 tokens, and how do they compare with real tokens
    d = model_dir(mm.model)
    glob, meta = load_global(d / GLOBAL_WEIGHTS, model_hint=str(d), expect={})  # the trained (coarse) branch
    pre, tok = glob(feats.reshape(len(samples), 1, rows, cols, -1).float(), guides)
    t = F.normalize(tok, dim=-1)
    sim = t @ t.transpose(1, 2)  # [n, 32, 32]
    off = sim[:, ~torch.eye(sim.shape[1], dtype=torch.bool)]
    stats["global"] = {
        "mode": meta.get("mode", "coarse"),
        "final_loss_ema": meta.get("final_loss_ema"),
        "train_steps": meta.get("train_config", {}).get("steps"),
        "mean pairwise cos between global tokens": off.mean().item(),
        "global token norm": tok.norm(dim=-1).mean().item(),
        "real token norm": proj_real.norm(dim=-1).mean().item(),
        "max cos global->real projected token": F.cosine_similarity(tok[:, :, None], proj_real[:, None], -1)
        .max(-1)
        .values.mean()
        .item(),
        "guide-sensitivity (mean cos of a sample's tokens with another prompt's, same image)": None,
    }
    # same image, two different prompts: does the global branch change with the instruction?
    g2 = guides.roll(1, 0)
    _, tok2 = glob(feats.reshape(len(samples), 1, rows, cols, -1).float(), g2)
    stats["global"]["guide-sensitivity (mean cos of a sample's tokens with another prompt's, same image)"] = (
        F.cosine_similarity(tok, tok2, -1).mean().item()
    )
print(json.dumps(stats, indent=1))
