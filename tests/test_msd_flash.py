"""MSD and FLASH drafts: lossless with random weights, decoupled / compressed visual rows, the dynamic
tree's shape, and training (loss goes down; a draft fitted to the target's answers gets accepted)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mmfast.config import load_recipe
from mmfast.errors import ModelLoadError
from mmfast.pipeline import Session
from mmfast.speculative._eagle_model import (
    _model_dir,
    load_draft,
    save_draft,
    write_random_draft,
)

FLASH_ARCH = {"sar_k": 3, "n_latents": 4}  # the tiny model has 16 image tokens
PARAMS = {
    "msd": {"depth": 3, "top_k": 4, "total_tokens": 16},
    "flash": {"top_k": 4, "total_tokens": 12, "rounds": 2},
}


@pytest.fixture(scope="module")
def drafts(tiny_mm):
    """Random (untrained) weights in the tiny model's directory, where the drafters look by default."""
    d = _model_dir(tiny_mm)
    write_random_draft(tiny_mm, "msd", d / "msd")
    write_random_draft(tiny_mm, "flash", d / "flash", **FLASH_ARCH)
    return d


def _run(mm, images, prompts, spec=None, n=16, decoding=None):
    data = {"decoding": decoding or {"method": "greedy"}}
    if spec:
        data["speculative"] = spec
    with Session(mm, load_recipe(data)) as s:
        return s.generate(images, prompts, max_new_tokens=n)


@pytest.mark.parametrize("name", ["msd", "flash"])
def test_random_draft_lossless_and_sampling(name, drafts, tiny_mm, images, prompts):
    base = _run(tiny_mm, images[:3], prompts[:3])
    spec = _run(tiny_mm, images[:3], prompts[:3], {"method": name, "params": PARAMS[name]})
    assert [r.token_ids for r in spec] == [r.token_ids for r in base]
    st = spec[0].stats["speculative"]
    assert st["cycles"] >= 1 and st["draft_tokens"] > 0
    out = _run(
        tiny_mm,
        images[:2],
        prompts[:2],
        {"method": name, "params": PARAMS[name]},
        n=10,
        decoding={"method": "sample", "seed": 3},
    )
    assert all(len(r.token_ids) > 0 for r in out)


@pytest.mark.parametrize("name", ["msd", "flash"])
def test_a_one_token_answer_runs_no_draft(name, drafts, tiny_mm, images, prompts):
    """A one-token answer (POPE's yes / no) runs no cycle, so the draft model does not run over the prompt (it did,
    for nothing: the drafter's time to first token carried a draft forward over every prompt row)."""
    spec = {"method": name, "params": PARAMS[name]}
    one = _run(tiny_mm, images[:2], prompts[:2], spec, n=1)
    assert [r.token_ids for r in one] == [r.token_ids for r in _run(tiny_mm, images[:2], prompts[:2], n=1)]
    assert [(r.stats["speculative"]["cycles"], r.stats["speculative"]["draft_forwards"]) for r in one] == [(0, 0)] * 2
    two = _run(tiny_mm, images[:1], prompts[:1], spec, n=2)[0].stats["speculative"]
    assert two["cycles"] == 1 and two["draft_forwards"] >= 2  # the prompt's forward, then the tree's


def _begin(mm, images, prompts, name, params, capture=None):
    """A session whose drafter has consumed the first prompt; returns (session, drafter, inputs)."""
    from mmfast.speculative.engine import SpecContext

    s = Session(mm, load_recipe({"speculative": {"method": name, "params": params}}))
    batch = mm.prepare(images[:1], prompts[:1])
    inputs = s.build_inputs(batch, s.encode(batch))
    state, out = s.runner.prefill(inputs, all_hidden=True)
    ctx = SpecContext(s, state, inputs, [int(out.logits[0, -1].argmax())], 0.0, 0, 1.0, torch.Generator(), prefill=out)
    d = s.drafter
    if capture is not None:
        rows = d.model.rows

        def spy(*a, **k):
            x, src = rows(*a, **k)
            capture.append((a, x, src))
            return x, src

        d.model.rows = spy
    d.begin(ctx)
    return s, d, inputs, ctx


def test_msd_visual_rows_are_the_projected_features(drafts, tiny_mm, images, prompts):
    seen = []
    s, d, inputs, _ = _begin(tiny_mm, images, prompts, "msd", PARAMS["msd"], seen)
    s.close()
    (next_emb, hid, _row_image, _vis), x, _src = seen[0]
    img = inputs.image_mask[0]
    visual_rows = img[1:].nonzero().squeeze(1)  # row j is visual when token j+1 is an image token
    assert visual_rows.numel() == int(img.sum()) == 16
    torch.testing.assert_close(x[visual_rows], inputs.embeds[0, img], rtol=0, atol=0)
    text_rows = (~img[1:]).nonzero().squeeze(1)
    fc = d.model.fc(torch.cat([next_emb[text_rows], hid[text_rows]], -1))
    torch.testing.assert_close(x[text_rows], fc)


def test_flash_compresses_the_image_to_latents(drafts, tiny_mm, images, prompts):
    seen = []
    s, d, inputs, _ = _begin(tiny_mm, images, prompts, "flash", PARAMS["flash"], seen)
    s.close()
    (_next_emb, _hid, row_image, vis_src), x, src = seen[0]
    n_img, c = int(inputs.image_mask.sum()), FLASH_ARCH["n_latents"]
    assert x.shape[0] == inputs.length - n_img + c
    assert int((src < 0).sum()) == c  # C latent rows replace the N visual rows
    lat = x[src < 0]
    feats = vis_src[row_image >= 0]  # the target's hidden states at the image tokens
    want = torch.softmax(d.model.latents @ feats.T, -1) @ feats
    torch.testing.assert_close(lat, want)
    assert d.cache.committed == x.shape[0] and d.model.slots(x[:1]).shape[-2] == FLASH_ARCH["sar_k"]


@pytest.mark.parametrize("name", ["msd", "flash"])
def test_inference_path_matches_training_path(name, drafts, tiny_mm, images, prompts):
    """The fused KV-cache step gives the root row's slots that the batched training forward gives."""
    seen = []
    s, d, *_ = _begin(tiny_mm, images, prompts, name, PARAMS[name], seen)
    s.close()
    (next_emb, hid, row_image, vis_src), _, _ = seen[0]
    r = next_emb.shape[0]
    with torch.no_grad():
        pred, ok = d.model.train_forward(
            [
                {
                    "next_emb": next_emb,
                    "hid": hid,
                    "row_image": row_image,
                    "vis_src": vis_src,
                    "query": torch.tensor([r - 1]),
                }
            ]
        )
    assert bool(ok.all())
    torch.testing.assert_close(pred[0, 0], d.root_slots, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["msd", "flash"])
def test_tree_respects_budget_depth_and_order(name, drafts, tiny_mm, images, prompts):
    s, d, *_ = _begin(tiny_mm, images, prompts, name, PARAMS[name])
    s.close()
    committed = d.cache.committed
    grow = d.eagle2_tree if name == "msd" else d.sar_tree
    steps, max_depth = (3, 4) if name == "msd" else (2, 2 * FLASH_ARCH["sar_k"])
    tree, fwd = grow(steps, 3, 10)
    full, fwd_full = grow(steps, 3, 10, early_stop=False)
    assert fwd <= fwd_full == steps - (name == "flash")  # FLASH: rounds - 1 extra forwards
    assert torch.equal(tree.tokens, full.tokens) and torch.equal(tree.parents, full.parents)  # early stop is exact
    assert tree.n == 9
    par = tree.parents.tolist()
    assert all(0 <= p <= i for i, p in enumerate(par))  # parents before children (node i+1's parent <= i)
    assert int(tree.depth().max()) <= max_depth
    assert d.cache.committed == committed and d.cache.n_app == 0  # expansions rolled back
    big, _ = grow(steps, 3, 1000)
    assert int(big.depth().max()) == max_depth


def _block_rows_by_tracing(par: list[int], beam: list[int], roots: list[int], root_rows, row_vis, start: int):
    """FLASH's feed of a block, built node by node on the host: each path traced up to the block's first level, a node
    on several paths once, rows in id order, a row seeing its parent's row and what it sees (a first-level node: its
    block root's), and itself."""
    level, root_of = {}, {}
    for c, fr in zip(beam, roots):
        chain = []
        while c >= start:
            chain.append(c)
            c = par[c]
        for lvl, node in enumerate(reversed(chain)):
            level[node], root_of[node] = lvl, fr
    order, n_prev = sorted(level), row_vis.shape[0]
    vis = torch.zeros(n_prev + len(order), n_prev + len(order), dtype=torch.bool)
    vis[:n_prev, :n_prev] = row_vis
    row_of = {}
    for i, c in enumerate(order):
        prow = row_of.get(par[c], None if root_rows is None or level[c] else root_rows[root_of[c]])
        if prow is not None:
            vis[n_prev + i] = vis[prow]
        vis[n_prev + i, n_prev + i] = True
        row_of[c] = n_prev + i
    return order, [level[c] for c in order], [root_of[c] for c in order], vis, [row_of[c] - n_prev for c in beam]


@pytest.mark.parametrize("seed", range(40))
def test_flash_block_rows_are_the_paths_distinct_nodes(seed):
    """FLASH's block feed in fixed shapes (``_block_rows``: what a captured proposal runs) equals the feed traced node by
    node: the k best paths' distinct nodes in id order with their levels and block roots, each row seeing its
    ancestors' rows and its block root's; the repeated nodes' rows come last and no row sees them; the query rows
    are the paths' last nodes."""
    from mmfast.speculative.flash import _block_rows

    g = torch.Generator().manual_seed(seed)
    k, big_k = int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(1, 5, (1,), generator=g))
    n_f = k if seed % 2 else 1  # a later block (k block roots, rows appended before) or the first one
    n_prev = 0 if n_f == 1 else int(torch.randint(n_f, 3 * n_f + 1, (1,), generator=g))
    row_vis = torch.rand(n_prev, n_prev, generator=g) < 0.4
    row_vis |= torch.eye(n_prev, dtype=torch.bool)
    root_rows = None if n_f == 1 else torch.randperm(n_prev, generator=g)[:n_f]
    start = int(torch.randint(0, 30, (1,), generator=g))  # the block's first candidate id
    par, level_parents, offsets = [-1] * start, [], []
    beam = torch.arange(n_f) - 1 if n_f == 1 else torch.arange(n_f) + start - 3 * n_f  # level -1: the roots
    b_root = torch.zeros(1, dtype=torch.long) if n_f == 1 else torch.arange(n_f)
    for _ in range(big_k):  # each beam node expands into k candidates; k of them, at random, continue
        cand = beam.repeat_interleave(k)
        offsets.append(len(par))
        level_parents.append(cand)
        par += cand.tolist()
        sel = torch.randperm(cand.numel(), generator=g)[: min(k, cand.numel())]
        b_root = b_root.repeat_interleave(k)[sel]
        beam = sel + offsets[-1]
    got = _block_rows(level_parents, offsets, beam, b_root, root_rows, row_vis, len(par))
    rows = None if root_rows is None else root_rows.tolist()
    order, levels, roots, vis, query = _block_rows_by_tracing(par, beam.tolist(), b_root.tolist(), rows, row_vis, start)
    q, r = len(order), k * big_k
    assert got.ids[:q].tolist() == order and got.level[:q].tolist() == levels and got.root[:q].tolist() == roots
    assert torch.equal(got.vis[:q, : n_prev + q], vis[n_prev:]) and not got.vis[:, n_prev + q :].any()
    assert got.query.tolist() == query and got.vis.shape == (r, n_prev + r)
    assert torch.equal(got.row_vis, torch.cat([torch.cat([row_vis, row_vis.new_zeros(n_prev, r)], 1), got.vis]))
    assert set(got.ids[q:].tolist()) <= set(order)  # the repeats: nodes already fed


def test_missing_weights_name_the_training_command(tiny_mm, tmp_path):
    with pytest.raises(ModelLoadError, match="scripts/train_drafts.py --draft msd"):
        load_draft(tmp_path / "nope", tiny_mm, "msd")
    write_random_draft(tiny_mm, "msd", tmp_path / "m")
    with pytest.raises(ModelLoadError, match="not 'flash'"):
        load_draft(tmp_path / "m", tiny_mm, "flash")


def test_draft_with_missing_tensors_names_the_file_and_the_fix(tiny_mm, tmp_path):
    from safetensors.torch import load_file, save_file

    d = write_random_draft(tiny_mm, "msd", tmp_path / "m")
    tensors = load_file(str(d / "model.safetensors"))
    del tensors["fc.bias"]
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"m/model\.safetensors .*missing \['fc\.bias'\].*train_drafts\.py"):
        load_draft(d, tiny_mm, "msd")


@pytest.fixture(scope="module")
def distilled(tiny_mm, images, prompts):
    """Self-distilled samples of the tiny target (its greedy answers + hidden states)."""
    from mmfast.train.drafts import Sample, _generate_shard

    with Session(tiny_mm, load_recipe({})) as s:
        shard = _generate_shard(s, images, prompts, True, 16)
    off, voff = shard["off"].tolist(), shard["voff"].tolist()
    # the cached top-1 at every answer position is the greedy answer itself (teacher forcing == decoding)
    top1, t0 = shard["topk_ids"][:, 0].long(), 0
    for b in range(len(off) - 1):
        ids, plen = shard["ids"][off[b] : off[b + 1]].long(), int(shard["plen"][b])
        n = ids.numel() - plen + 1
        assert torch.equal(top1[t0 : t0 + n - 1], ids[plen:])
        t0 += n
    return [
        Sample(
            shard["ids"][off[b] : off[b + 1]].long(),
            shard["hid"][off[b] : off[b + 1]],
            shard["vis"][voff[b] : voff[b + 1]],
            int(shard["plen"][b]),
            bool(shard["eos"][b]),
        )
        for b in range(len(off) - 1)
    ]


@pytest.mark.parametrize("name", ["msd", "flash"])
def test_training_fits_the_target_and_gets_accepted(name, tiny_mm, distilled, images, prompts, tmp_path):
    from mmfast.speculative._eagle_model import build_draft
    from mmfast.train.drafts import DraftTrainConfig, draft_loss

    cfg = dataclasses.replace(
        DraftTrainConfig(), noise=0.0, sar_k=FLASH_ARCH["sar_k"], n_latents=FLASH_ARCH["n_latents"]
    )
    torch.manual_seed(0)
    model = build_draft(tiny_mm, name, **(FLASH_ARCH if name == "flash" else {}))
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    image_id = tiny_mm.adapter.image_token_id
    losses = []
    for _ in range(120):
        loss, st = draft_loss(model, distilled, image_id, cfg)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    assert st["acc"][0] > 0.8
    save_draft(model.eval(), tmp_path / name)
    params = dict(PARAMS[name], weights=str(tmp_path / name))
    base = _run(tiny_mm, images, prompts)
    spec = _run(tiny_mm, images, prompts, {"method": name, "params": params})
    assert [r.token_ids for r in spec] == [r.token_ids for r in base]
    tau = spec[0].stats["speculative"]["tau"]
    assert tau > 1.5
