"""VisionZip: dominant = CLS + top-(D-1) CLS-attended patches of the feature layer, contextual merge
as the official code (target + mean of assigned), paper budgets."""

from __future__ import annotations

import pytest
import torch

import mmfast
from mmfast.config import load_recipe
from mmfast.errors import ConfigError
from mmfast.pipeline import Session
from mmfast.pruning.visionzip import contextual_merge, split_budget


def _session(mm, **params):
    return Session(mm, load_recipe({"pruning": [{"method": "visionzip", "params": params}]}))


@pytest.fixture(scope="module")
def reference(tiny_dir, tiny_mm, images, prompts):
    """Eager attentions, hidden states and hand-computed keys of the feature layer."""
    eager = mmfast.load(tiny_dir, device="cpu", attn_implementation="eager")
    batch = tiny_mm.prepare(images[:3], prompts[:3])
    layer = eager.adapter.vision_feature_layer_index()
    with torch.no_grad():
        out = eager.adapter.vision_tower(batch.pixel_values, output_attentions=True, output_hidden_states=True)
        block = eager.adapter.vision_layers[layer]
        x = block.layer_norm1(out.hidden_states[layer])  # input of the feature layer's attention
        heads = block.self_attn.num_heads
        keys = block.self_attn.k_proj(x).view(x.shape[0], x.shape[1], heads, -1).mean(2)  # [n, 1+N, hd]
    return {
        "batch": batch,
        "cls_attn": out.attentions[layer][:, :, 0, 1:].sum(1),  # [n, N]
        "hidden": out.hidden_states[layer + 1],  # feature layer output [n, 1+N, Dv]
        "keys": keys,
    }


def _hand_contextual(hidden, metric, c):
    """Loop version of the official contextual merge."""
    r = hidden.shape[0]
    m = [v / v.norm() for v in metric.float()]
    step = max(1, r // c)
    targets = list(range(0, r, step))[:c]
    groups = {t: [] for t in targets}
    for j in range(r):
        if j in targets:
            continue
        sims = [float(m[j] @ m[t]) for t in targets]
        groups[targets[sims.index(max(sims))]].append(j)
    out = []
    for t in targets:
        agg = torch.stack([hidden[j] for j in groups[t]]).mean(0) if groups[t] else torch.zeros_like(hidden[t])
        out.append(hidden[t] + agg)
    return torch.stack(out)


def test_dominant_and_contextual_match_hand_computation(tiny_mm, reference):
    d, c = 5, 3
    with _session(tiny_mm, dominant=d, contextual=c) as s:
        vision = s.encode(reference["batch"])
    n = reference["cls_attn"].shape[1]
    for i in range(3):
        top = reference["cls_attn"][i].topk(d - 1).indices.sort().values
        hid = reference["hidden"][i]
        feats = vision.features[i]
        assert feats.shape[0] == d + c
        assert torch.equal(vision.patch_ids[i][1:d], top)
        assert vision.patch_ids[i][0] == -1 and torch.all(vision.patch_ids[i][d:] == -1)
        torch.testing.assert_close(feats[0], hid[0], atol=1e-5, rtol=1e-5)  # CLS goes to the projector
        torch.testing.assert_close(feats[1:d], hid[1 + top], atol=1e-5, rtol=1e-5)
        rest = torch.ones(n, dtype=torch.bool)
        rest[top] = False
        want = _hand_contextual(hid[1:][rest], reference["keys"][i, 1:][rest], c)
        torch.testing.assert_close(feats[d:], want, atol=1e-4, rtol=1e-4)


def test_contextual_merge_small_example():
    hidden = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 0.0], [0.0, 3.0], [4.0, 4.0]])
    metric = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.1], [0.1, 1.0], [0.0, 2.0]])
    # R=5, C=2: step 2, targets 0 and 2; token 1 -> 2 (cos 0.0995 > 0), 3 -> 2, 4 -> 2; nothing joins 0
    got = contextual_merge(hidden, metric, 2)
    want = torch.tensor([[1.0, 0.0], [2.0 + 4.0 / 3, 0.0 + 8.0 / 3]])
    torch.testing.assert_close(got, want)


def test_paper_budgets_and_counts(tiny_mm, images, prompts):
    assert split_budget(64) == (54, 10) and split_budget(128) == (108, 20) and split_budget(192) == (162, 30)
    assert sum(split_budget(100)) == 100
    with _session(tiny_mm, tokens=8) as s:
        res = s.generate(images[:2], prompts[:2], max_new_tokens=2)
    assert [r.n_vision_tokens for r in res] == [8, 8]
    assert res[0].stats["visionzip"]["dominant"] + res[0].stats["visionzip"]["contextual"] == 8


def test_budget_validation(tiny_mm):
    with pytest.raises(ConfigError):
        load_recipe({"pruning": [{"method": "visionzip", "params": {"dominant": 5}}]})
    with pytest.raises(ConfigError, match="exceeds"):
        _session(tiny_mm, dominant=10, contextual=8)
