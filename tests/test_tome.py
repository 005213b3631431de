"""ToMe: bipartite soft matching, size-weighted merges, CLS protection, proportional attention."""

from __future__ import annotations

import pytest
import torch

from mmfast.config import Recipe, load_recipe
from mmfast.errors import ConfigError
from mmfast.pipeline import Session
from mmfast.pruning.tome import bipartite_merge, merge_schedule, proportional_bias


def _recipe(**params):
    return load_recipe({"pruning": [{"method": "tome", "params": params}]})


def _hand_built():
    """7 tokens (CLS + 6): A = {0, 2, 4, 6}, B = {1, 3, 5}. CLS's metric equals token 1's exactly."""
    x = torch.arange(7 * 2, dtype=torch.float32).reshape(1, 7, 2)
    metric = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.99, 0.141], [0.0, 1.0], [0.6, 0.8], [0.8, 0.6], [-1.0, 0.1]])[
        None
    ]
    size = torch.tensor([1.0, 2.0, 3.0, 1.0, 1.0, 1.0, 1.0]).reshape(1, 7, 1)
    ids = torch.tensor([[-1, 10, 11, 12, 13, 14, 15]])
    return x, metric, size, ids


def test_bipartite_merge_size_weighted_hand_built():
    x, metric, size, ids = _hand_built()
    out, new_size, new_ids, r = bipartite_merge(x, metric, size, ids, 2)
    # edges: 2 -> 1 (0.99), 4 -> 5 (0.96), 6 -> 3 (0.1); CLS is excluded; the two best merge
    assert r == 2 and out.shape == (1, 5, 2)
    assert new_ids.tolist() == [[-1, 15, 10, 12, 14]]  # unmerged A (0, 6), then B (1, 3, 5)
    assert new_size[0, :, 0].tolist() == [1.0, 1.0, 5.0, 1.0, 2.0]
    torch.testing.assert_close(out[0, 2], (2 * x[0, 1] + 3 * x[0, 2]) / 5)  # size-weighted average
    torch.testing.assert_close(out[0, 4], (x[0, 5] + x[0, 4]) / 2)
    for i, j in ((0, 0), (1, 6), (3, 3)):
        assert torch.equal(out[0, i], x[0, j])


def test_bipartite_merge_caps_r_and_protects_cls():
    x, metric, size, ids = _hand_built()
    out, new_size, new_ids, r = bipartite_merge(x, metric, size, ids, 10)
    assert r == 3  # at most half of the 6 unprotected tokens
    assert new_ids[0, 0] == -1 and new_size[0, 0, 0] == 1 and torch.equal(out[0, 0], x[0, 0])  # CLS untouched
    assert float(new_size.sum()) == float(size.sum())
    _, _, _, r0 = bipartite_merge(x, metric, size, ids, 0)
    assert r0 == 0


def test_proportional_bias_is_log_size():
    size = torch.tensor([[1.0, 2.0, 5.0]])[..., None]
    torch.testing.assert_close(proportional_bias(size, None, torch.float32), torch.log(size[..., 0])[:, None, None, :])
    mask = torch.tensor([[[[True, False, True]]]])
    got = proportional_bias(size, mask, torch.float32)
    assert got[0, 0, 0, 1] == torch.finfo(torch.float32).min
    torch.testing.assert_close(got[0, 0, 0, [0, 2]], torch.log(torch.tensor([1.0, 5.0])))


def test_schedule_reaches_the_budget_at_the_feature_layer():
    assert merge_schedule(576, 23, 192) == [17] * 16 + [16] * 7
    for budget in (192, 128, 64):
        assert 576 - sum(merge_schedule(576, 23, budget)) == budget
    assert merge_schedule(16, 2, 4) == [8, 4]  # the 50% cap forces the front-loaded plan
    with pytest.raises(ValueError, match="cannot reach"):
        merge_schedule(16, 2, 3)


def test_merges_r_per_block_and_tracks_patches(tiny_mm, images, prompts):
    layers = tiny_mm.adapter.vision_layers
    assert tiny_mm.adapter.vision_feature_layer_index() == 1
    for params, want_r in (({"budget": 8}, [4, 4]), ({"r": 3}, [3, 3])):
        lengths = []
        handles = [
            lay.register_forward_hook(lambda m, a, o: lengths.append((a[0].shape[1], o.shape[1]))) for lay in layers
        ]
        try:
            with Session(tiny_mm, _recipe(**params)) as s:
                batch = s.mm.prepare(images[:2], prompts[:2])
                vision = s.encode(batch)
                s.pruners[0]
                merge = vision.extras["tome.merge"]
                final_ids, final_size = merge.ids, merge.size
        finally:
            for h in handles:
                h.remove()
        assert vision.stats["tome"]["r"] == want_r
        assert lengths == [(17, 17 - want_r[0]), (17 - want_r[0], 17 - sum(want_r)), (17 - sum(want_r),) * 2]
        assert vision.counts() == [16 - sum(want_r)] * 2
        assert (final_ids[:, 0] == -1).all() and (final_size[:, 0, 0] == 1).all()  # CLS never merged
        for i in range(2):
            pid, size = vision.patch_ids[i], vision.extras["tome.size"][i]
            assert float(size.sum()) == 16  # every patch lands in exactly one token
            assert torch.equal(pid >= 0, size == 1)  # -1 exactly for merged tokens
            kept = pid[pid >= 0].tolist()
            assert len(set(kept)) == len(kept)


def test_proportional_attention_end_to_end(tiny_mm, images, prompts):
    """Block 1 recomputed by hand (eager softmax + log(size) of block 0's merges) equals the hooked block."""
    layers = tiny_mm.adapter.vision_layers
    seen = {}
    with Session(tiny_mm, _recipe(budget=8)) as s:
        tome = s.pruners[0]

        def after0(m, a, o):
            seen.update(x=o.clone(), size=tome._size.clone(), ids=tome._ids.clone())

        handles = [
            layers[0].register_forward_hook(after0),
            layers[1].register_forward_hook(lambda m, a, o: seen.update(out=o.clone())),
        ]
        try:
            s.encode(s.mm.prepare(images[:2], prompts[:2]))
        finally:
            for h in handles:
                h.remove()
    layer, x, size = layers[1], seen["x"], seen["size"]
    assert size.max() > 1
    attn = layer.self_attn
    bsz, t, d = x.shape

    def heads(proj, h):
        return proj(h).view(bsz, t, attn.num_heads, attn.head_dim).transpose(1, 2)

    def block(with_bias: bool):
        with torch.no_grad():
            h = layer.layer_norm1(x)
            q, k, v = heads(attn.q_proj, h), heads(attn.k_proj, h), heads(attn.v_proj, h)
            logits = q @ k.transpose(-1, -2) * attn.scale
            if with_bias:
                logits = logits + size.log()[:, None, None, :, 0]
            o = (logits.softmax(-1) @ v).transpose(1, 2).reshape(bsz, t, d)
            h = x + attn.out_proj(o)
            merged, _, _, _ = bipartite_merge(h, k.mean(1), size, seen["ids"], 4)
            return merged + layer.mlp(layer.layer_norm2(merged))

    torch.testing.assert_close(seen["out"], block(True), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(seen["out"], block(False), atol=1e-5, rtol=1e-5)


def test_llm_gets_budget_tokens_and_rejects_unreachable(tiny_mm, images, prompts):
    with Session(tiny_mm, Recipe()) as base:
        want = base.generate(images[:2], prompts[:2], max_new_tokens=2)
    with Session(tiny_mm, _recipe(budget=6)) as s:
        res = s.generate(images[:2], prompts[:2], max_new_tokens=2)
    assert [r.n_vision_tokens for r in res] == [6, 6]
    layers = tiny_mm.adapter.vision_layers  # closing restored every layer and attention module
    assert not any("forward" in lay.__dict__ or "_mmfast_attn" in lay.self_attn.__dict__ for lay in layers)
    with Session(tiny_mm, Recipe()) as base:
        again = base.generate(images[:2], prompts[:2], max_new_tokens=2)
    assert [r.token_ids for r in again] == [r.token_ids for r in want]
    with pytest.raises(ConfigError, match="cannot reach"):
        Session(tiny_mm, _recipe(budget=3))


@pytest.mark.parametrize("budget, path", [({"tokens": 3}, "pruning[0].budget.tokens"), ({"budget": 3}, None)])
def test_an_unreachable_budget_is_refused_at_the_key_the_recipe_set(tiny_mm, budget, path):
    """``budget: {tokens: 3}`` (16 patches, 2 blocks: at least 4 tokens) is refused at ``pruning[0].budget.tokens``,
    not at ``pruning[0].params.budget``, a knob the recipe did not set; ``params.budget`` at that knob."""
    stage = {"method": "tome", "budget": budget} if path else {"method": "tome", "params": budget}
    with pytest.raises(ConfigError, match="cannot reach 3 tokens.*i.e. 4 tokens") as exc:
        Session(tiny_mm, load_recipe({"pruning": [stage]}))
    assert exc.value.path == (path or "pruning[0].params.budget")
