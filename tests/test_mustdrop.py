"""MustDrop: window merge, key set, dual-attention filter and the output-aware KV policy."""

from __future__ import annotations

import math

import pytest
import torch

import mmfast
from mmfast.config import load_recipe
from mmfast.errors import ConfigError
from mmfast.pipeline import Session
from mmfast.pruning._mustdrop_ops import dual_attention_drop, padded_spatial_merge, spatial_merge, window_similarity
from mmfast.pruning.mustdrop import PRESETS

BASE = {"window": 2, "layer_mapping": "proportional"}  # the tiny model: 4x4 grid, 4 LLM layers


def _recipe(**params):
    return load_recipe({"pruning": [{"method": "mustdrop", "params": {**BASE, **params}}]})


def _prefill(session, images, prompts):
    batch = session.mm.prepare(images, prompts)
    vision = session.encode(batch)
    inputs = session.build_inputs(batch, vision)
    state, out = session.runner.prefill(inputs)
    return vision, inputs, state, out


def _valid_sources(grp, b):
    return set(grp.source[b][grp.key_mask[b]].tolist())


# -- stage 1: window merge ------------------------------------------------------------------------
def _hand_built_patches():
    """[16, 4] patches of a 4x4 grid; 2x2 windows w0 = {0,1,4,5}, w1 = {2,3,6,7}, w2 = {8,9,12,13}, w3 = {10,11,14,15}."""
    e = torch.eye(4)
    x = torch.zeros(16, 4)
    x[[0, 1, 4, 5]] = e[0] * torch.tensor([1.0, 2.0, 3.0, 4.0])[:, None]  # identical directions: similarity 1
    x[[2, 3, 6, 7]] = torch.stack([e[0], e[0], e[1], e[1]])  # similarity 1/3
    x[[8, 9, 12, 13]] = e  # orthogonal: similarity 0
    x[[10, 11, 14, 15]] = torch.stack([e[3], 2 * e[3], e[3], e[3] + 0.5 * e[2]])  # (6 + 6 / sqrt(1.25)) / 12
    return x


def test_window_similarity_hand_built():
    sim = window_similarity(_hand_built_patches()[None], (4, 4), 2)[0]
    want = torch.tensor([1.0, 1 / 3, 0.0, (6 + 6 / math.sqrt(1.25)) / 12])
    torch.testing.assert_close(sim, want)


def test_merge_exactly_the_windows_above_threshold():
    x = _hand_built_patches()
    cls = torch.full((1, 4), 7.0)
    hidden = torch.cat([cls, x])[None]  # [1, 17, 4]
    out, r, ids = spatial_merge(hidden, (4, 4), 2, 0.8)
    assert r == 2  # w0 (1.0) and w3 (0.947); w1 (1/3) and w2 (0) stay
    assert ids[0].tolist() == [-1, -1, 2, 3, 6, 7, 8, 9, 12, 13]  # merged first, then raster order
    assert torch.equal(out[0, 0], cls[0])  # CLS in front, untouched
    torch.testing.assert_close(out[0, 1], x[[0, 1, 4, 5]].mean(0))  # most similar window first
    torch.testing.assert_close(out[0, 2], x[[10, 11, 14, 15]].mean(0))
    assert torch.equal(out[0, 3:], x[[2, 3, 6, 7, 8, 9, 12, 13]])
    # a threshold above 1 merges nothing and returns the input itself
    same, r0, ids0 = spatial_merge(hidden, (4, 4), 2, 1.01)
    assert r0 == 0 and same is hidden and ids0[0].tolist() == list(range(16))


def test_merge_count_is_the_batch_minimum():
    x = _hand_built_patches()
    y = x.clone()
    y[[10, 11, 14, 15]] = torch.eye(4)  # only w0 stays above 0.8 in the second image
    hidden = torch.stack([torch.cat([torch.ones(1, 4), x]), torch.cat([torch.ones(1, 4), y])])
    out, r, ids = spatial_merge(hidden, (4, 4), 2, 0.8)
    assert r == 1 and out.shape == (2, 1 + 1 + 12, 4)
    for b in range(2):  # each image merges its single most similar window (w0)
        torch.testing.assert_close(out[b, 1], hidden[b, 1:][[0, 1, 4, 5]].mean(0))
        assert ids[b].tolist() == [-1, 2, 3, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]


@pytest.mark.parametrize("threshold", [0.8, 0.3, -1.0, 1.01])
def test_the_padded_merge_is_each_images_own_merge_then_padding(threshold):
    """The captured tower's merge (fixed shapes, a device threshold): row b's valid slots are exactly what
    :func:`spatial_merge` gives image b alone (values, ids and count), then zeros, ids -1 and invalid."""
    g = torch.Generator().manual_seed(0)
    x = _hand_built_patches()
    rows = [torch.cat([torch.full((1, 4), 7.0), x])]
    for _ in range(3):  # windows of random similarity: some merge, some do not
        y = torch.randn(16, 4, generator=g)
        y[[0, 1, 4, 5]] = y[0] + 0.2 * torch.randn(4, 4, generator=g)
        rows.append(torch.cat([torch.randn(1, 4, generator=g), y]))
    hidden = torch.stack(rows)  # [4, 17, 4]
    out, valid, ids = padded_spatial_merge(hidden, (4, 4), 2, torch.tensor(threshold))
    assert out.shape == hidden.shape and valid.shape == (4, 17) and ids.shape == (4, 16)
    counts = set()
    for b in range(4):
        want, r, want_ids = spatial_merge(hidden[b : b + 1], (4, 4), 2, threshold)
        n = want.shape[1]
        counts.add(r)
        assert valid[b].tolist() == [True] * n + [False] * (17 - n)
        assert torch.equal(out[b, :n], want[0]) and not out[b, n:].any()
        assert ids[b].tolist() == want_ids[0].tolist() + [-1] * (17 - n)
    assert len(counts) > 1 or threshold in (-1.0, 1.01)  # the rows merge different counts


# -- stage 2: dual-attention filter ---------------------------------------------------------------
def test_dual_filter_drops_exactly_below_both_thresholds():
    # slots: 0 text, 1-4 vision (4 is a key token), 5 text; two text rows (a third, all-zero row is padding)
    attn = torch.tensor([[[0.10, 0.30, 0.01, 0.000, 0.0, 0.590], [0.20, 0.20, 0.05, 0.002, 0.0, 0.548], [0.0] * 6]])
    vision = torch.tensor([[False, True, True, True, True, False]])
    key = torch.tensor([[False, False, False, False, True, False]])
    # g = [.5, .06, .002, 0] over the vision slots, sum .562 -> global threshold .281; individual .04
    drop = dual_attention_drop(attn, vision, key, 0.5, 0.04)
    # slot 1: high g; slot 2: low g but max .05 >= .04 (kept by its individual attention);
    # slot 3: both low -> dropped; slot 4: both low but in the key set
    assert drop.tolist() == [[False, False, False, True, False, False]]
    assert not dual_attention_drop(attn, vision, key, 0.0, 0.0).any()  # the no-op setting


def test_presets_and_explicit_thresholds(tiny_mm):
    for name, want in PRESETS.items():
        with Session(tiny_mm, _recipe(preset=name)) as s:
            assert s.pruners[0].thresholds() == want
    assert PRESETS == {"192": (0.001, 0.001), "128": (0.0012, 0.001), "64": (0.011, 0.01)}
    with Session(tiny_mm, _recipe(preset="192", lambda_g=0.3)) as s:
        assert s.pruners[0].thresholds() == (0.3, 0.001)


def test_rejects_a_window_that_does_not_divide_the_grid(tiny_mm):
    with pytest.raises(ConfigError, match="does not divide"):
        Session(tiny_mm, _recipe(window=3))
    # the paper's layers on a shallow model: a recipe error naming the parameter (issue 18), not a crash
    with pytest.raises(ConfigError, match=r"pruning\[0\]\.params\.layers: layer \d+ does not exist .*layer_mapping"):
        Session(tiny_mm, load_recipe({"pruning": [{"method": "mustdrop", "params": {"window": 2}}]}))


# -- end to end -----------------------------------------------------------------------------------
def test_key_set_is_cls_top_k_and_never_dropped(tiny_dir, tiny_mm, images, prompts):
    # thresholds so high that every non-key vision token is dropped at the first filter
    with Session(tiny_mm, _recipe(sim_threshold=1.5, key_ratio=0.25, lambda_g=100.0, lambda_i=2.0)) as s:
        vision, inputs, state, _ = _prefill(s, images[:3], prompts[:3])
        rows = s.probe["mustdrop.llm.1"].rows
        first = s.pruners[0].first_layer
    # the key set: top ceil(0.25 * 16) patches by head-mean CLS attention of the last CLIP layer (eager reference)
    eager = mmfast.load(tiny_dir, device="cpu", attn_implementation="eager")
    with torch.no_grad():
        att = eager.adapter.vision_tower(
            s.mm.prepare(images[:3], prompts[:3]).pixel_values, output_attentions=True
        ).attentions[-1]
    want = att[:, :, 0, 1:].mean(1).topk(math.ceil(0.25 * 16), dim=1).indices.sort(1).values
    keys = [t.nonzero().squeeze(1) for t in vision.tags["mustdrop.key"]]  # the key set travels as a tag
    assert [k.tolist() for k in keys] == want.tolist()
    assert torch.equal(
        inputs.tags["mustdrop.key"].nonzero(),
        torch.cat(
            [
                torch.stack([torch.full_like(k, b), inputs.image_mask[b].nonzero().squeeze(1)[k]], 1)
                for b, k in enumerate(keys)
            ]
        ),
    )
    text_after = inputs.text_after_image
    for b in range(3):
        pos = inputs.image_mask[b].nonzero().squeeze(1)
        key_pos = set(pos[keys[b]].tolist())
        assert set(rows[b][rows[b] >= 0].tolist()) == set(text_after[b].nonzero().squeeze(1).tolist())  # probe rows
        for g, grp in enumerate(state.groups):
            vis_src = set(grp.source[b][state.vision_slots(g)[b]].tolist())
            assert vis_src == (key_pos if grp.start >= first else set(pos.tolist()))


def test_key_set_survives_merge_and_filter(tiny_mm, images, prompts):
    with Session(tiny_mm, _recipe(sim_threshold=-1.0, lambda_g=100.0, lambda_i=2.0, key_ratio=0.5)) as s:
        vision, inputs, state, _ = _prefill(s, images[:2], prompts[:2])
        stats = {**vision.stats["mustdrop"], **state.stats["mustdrop"]}
    assert stats["per_sample_merged_windows"] == [[4], [4]] and vision.counts() == [4, 4]
    assert all((p == -1).all() for p in vision.patch_ids)  # merged tokens have no patch id
    assert stats["per_sample_key_set"] == [2, 2] and stats["per_sample_kept"] == [[4, 2, 2], [4, 2, 2]]
    final = state.groups[-1]
    for b in range(2):
        pos = inputs.image_mask[b].nonzero().squeeze(1)
        assert set(final.source[b][state.vision_slots(len(state.groups) - 1)[b]].tolist()) == set(
            pos[vision.tags["mustdrop.key"][b]].tolist()
        )


def test_kv_policy_keeps_only_final_survivors(tiny_mm, images, prompts):
    params = {"sim_threshold": 1.5, "lambda_g": 0.05, "lambda_i": 1.0}
    with Session(tiny_mm, _recipe(**params, kv_policy=False)) as s:
        _, _, plain, out_plain = _prefill(s, images[:3], prompts[:3])
    with Session(tiny_mm, _recipe(**params)) as s:
        _, inputs, state, out = _prefill(s, images[:3], prompts[:3])
        kept = state.stats["mustdrop"]["per_sample_kept"]
        first = s.pruners[0].first_layer
        gen = s.generate(images[:3], prompts[:3], max_new_tokens=4)
    assert all(k[0] > k[1] > k[2] for k in kept)  # both filter stages dropped tokens in every sample
    stats = state.stats["mustdrop"]  # filters at the output of layers 1 and 2 (prune at 2 and 3)
    assert stats["per_sample_prefill_tokens_layer_avg"] == [(2 * k[0] + k[1] + k[2]) / 4 for k in kept]
    assert stats["per_sample_equivalent_tokens"] == [(k[0] + k[1] + 2 * k[2]) / 4 for k in kept]
    assert torch.equal(out.logits, out_plain.logits)  # the policy acts after prefill
    assert [g.start for g in plain.groups] == [0, 2, 3] and [g.start for g in state.groups] == [0, first, 2, 3]
    final = state.groups[-1]
    for b in range(3):
        survivors = _valid_sources(final, b)
        assert _valid_sources(state.groups[0], b) == _valid_sources(plain.groups[0], b)  # layers < first: full cache
        for layer in range(state.n_layers):
            grp, ref = state.groups[state.group_of(layer)], plain.groups[plain.group_of(layer)]
            assert state.cache.layers[layer].keys.shape[2] == grp.length
            if layer < first:
                assert torch.equal(state.cache.layers[layer].keys, plain.cache.layers[layer].keys)
                continue
            assert _valid_sources(grp, b) == survivors
            # the cached keys/values are the ones prefill computed for those tokens
            src, ref_src = grp.source[b], ref.source[b].tolist()
            slots = [ref_src.index(t) for t in src[grp.key_mask[b]].tolist()]
            for name in ("keys", "values"):
                got = getattr(state.cache.layers[layer], name)[b, :, grp.key_mask[b]]
                want = getattr(plain.cache.layers[layer], name)[b, :, slots]
                assert torch.equal(got, want)
            # decode positions continue from the layer's own cache length (the code's rule)
            assert int(grp.next_positions()[b]) == len(survivors)
        assert int(state.groups[0].next_positions()[b]) == int(inputs.attention_mask[b].sum())
    assert all(len(r.token_ids) > 0 for r in gen)
    assert all(r.vision_tokens_layer_avg < r.n_vision_tokens for r in gen)
    assert "forward" not in tiny_mm.adapter.vision_layers[0].__dict__  # the merge is gone after close


@pytest.mark.parametrize("decoder", ["greedy", "vcd", "ritual", "vhr", "beam"])
def test_key_set_travels_into_every_branch(tiny_mm, images, prompts, decoder):
    """Filters that drop every non-key token leave exactly the key set, whatever the decoder builds
    around the clean batch (noised / transformed branches re-encode, VHR stacks a text stream, beams
    repeat rows): the key set travels with the tokens as a tag."""
    recipe = load_recipe(
        {
            "pruning": [
                {
                    "method": "mustdrop",
                    "params": {**BASE, "sim_threshold": 1.5, "key_ratio": 0.25, "lambda_g": 100.0, "lambda_i": 2.0},
                }
            ],
            "decoding": {"method": decoder, **({"params": {"num_beams": 2}} if decoder == "beam" else {})},
        }
    )
    with Session(tiny_mm, recipe) as s:
        out = s.generate(images[:2], prompts[:2], max_new_tokens=2)
    for r in out:
        st = r.stats["mustdrop"]
        assert st["key_set"] == 4 and st["kept"][-1] == st["key_set"], st


def test_right_aligned_keeps_each_rows_slots_in_order():
    """The KV policy's slot index, built without a read per row: each row's kept slots in order, right-aligned
    (what the per-row loop built: ``index[b, T' - n_b:] = keep[b].nonzero()``), 0 and invalid before them."""
    from mmfast.pruning._mustdrop_ops import right_aligned

    g = torch.Generator().manual_seed(0)
    keep = torch.rand(5, 12, generator=g) > 0.5
    keep[3] = False  # a row that keeps nothing
    index, valid = right_aligned(keep)
    width = int(keep.sum(1).max())
    assert index.shape == valid.shape == (5, width)
    for b in range(5):
        idx = keep[b].nonzero().squeeze(1)
        n = idx.numel()
        assert index[b, width - n :].tolist() == idx.tolist() and not index[b, : width - n].any()
        assert valid[b].tolist() == [False] * (width - n) + [True] * n


def test_a_one_token_call_publishes_the_trimmed_caches_bytes(tiny_mm, images, prompts, monkeypatch):
    """A one-token answer never reads its cache after the prefill: on the static cache the KV policy trims nothing
    and publishes the bytes the trimmed caches would hold, equal to the trimmed caches' (the dynamic cache, which
    trims: every call there, and a decoding call's prefill on the static cache)."""
    import mmfast.pruning._mustdrop_ops as ops

    trims = []
    original = ops.apply_kv_policy
    monkeypatch.setattr(ops, "apply_kv_policy", lambda *a, **k: trims.append(1) or original(*a, **k))
    params = {**BASE, "sim_threshold": 1.5, "lambda_g": 0.05, "lambda_i": 1.0}
    recipe = {"pruning": [{"method": "mustdrop", "params": params}]}

    def run(compile: str, n: int) -> list:
        with mmfast.apply(tiny_mm, load_recipe(recipe), compile=compile) as s:
            out = s.generate(images[:3], prompts[:3], max_new_tokens=n, seed=0)
        return [(r.kv_bytes_prefill, r.stats["mustdrop"]["kept"]) for r in out]

    trimmed = run("off", 1)
    assert trims == [1]
    assert run("static", 1) == trimmed and trims == [1]  # not trimmed
    assert run("static", 2) == trimmed and trims == [1, 1]  # a decoding call trims
    with mmfast.apply(tiny_mm, load_recipe({}), compile="off") as s:
        plain = [r.kv_bytes_prefill for r in s.generate(images[:3], prompts[:3], max_new_tokens=1)]
    assert all(t < p for (t, _), p in zip(trimmed, plain))  # the policy saved bytes
