"""Methods on CLS-less towers with their published substitutes (issue 28, item 5): VisionZip on the
Qwen-VL towers (LightCompress's received-attention rule), CDPruner on Qwen-VL (OpenVINO GenAI's
LLM-embedding relevance). Each selection is compared with a direct computation of the published rule
on the same tensors; batches equal their samples; budgets keep their counts."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image
from test_diversity_peers import _cdpruner_reference

import mmfast
from mmfast.capabilities import ModelFacts, check_model
from mmfast.config import load_recipe
from mmfast.models import ADAPTERS
from mmfast.pipeline import Session
from mmfast.registry import PRUNERS

PROMPTS = ["Describe the image.", "Is there a cat in the image?", "What color is the car? Tell me now please."]


@pytest.fixture(params=["qwen2_5_vl", "qwen3_vl"], scope="module")
def qmm(request, tmp_path_factory):
    from mmfast.models.factory import random_qwen_vl, save_model

    model, processor = random_qwen_vl(request.param, seed=3)
    return mmfast.load(
        save_model(model, processor, tmp_path_factory.mktemp(request.param)), device="cpu", dtype="float32"
    )


@pytest.fixture(scope="module")
def qimages() -> list[Image.Image]:
    rng = np.random.default_rng(1)
    return [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in [(48, 64), (64, 40), (32, 80)]]


def _session(mm, method, **params):
    return Session(mm, load_recipe({"pruning": [{"method": method, "params": params}]}))


def _gen(mm, images, prompts, stage, n=5):
    return mm.generate(images, prompts, recipe={"pruning": stage}, max_new_tokens=n)


# -- VisionZip: LightCompress's Qwen2.5-VL rule ---------------------------------------------------------
def _last_block_inputs(mm, batch):
    """The last tower block's attention inputs (normed hidden states, cu_seqlens, rotary tables) and the
    merged tokens (the merger's output, what the LLM reads), from a plain run."""
    seen = {}
    attn = mm.adapter.vision_layers[-1].attn

    def grab(module, args, kwargs):
        seen["x"] = args[0] if args else kwargs["hidden_states"]
        seen["cu"] = kwargs["cu_seqlens"]
        seen["pe"] = kwargs["position_embeddings"]

    handle = attn.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with Session(mm, load_recipe({})) as s, torch.inference_mode():
            vision = s.encode(batch)
            projected = [p.clone() for p in mm.adapter.project(vision)]
    finally:
        handle.remove()
    return seen, projected, vision.extras["grid_thw"]


def _lightcompress_reference(mm, seen, grids, embeds, d_frac, c_frac):
    """``merger_hook`` and ``prune_qwenv25vl_hook`` of LightCompress's visionzip.py, ported: eager
    attention over the block's cu_seqlens blocks, head mean, column sum, 2x2-unit mean, window order
    -> raster; keys head mean per unit; then per image: top int(d N), stride targets among the rest,
    argmax assignment, contextual = target embedding + mean of its assigned embeddings."""
    import sys

    attn = mm.adapter.vision_layers[-1].attn
    rotary = sys.modules[type(attn).__module__].apply_rotary_pos_emb_vision
    x = seen["x"].double()
    s = x.shape[0]
    qkv = torch.nn.functional.linear(x, attn.qkv.weight.double(), attn.qkv.bias.double())
    q, k, _ = qkv.reshape(s, 3, attn.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
    q, k = rotary(q, k, *(t.double() for t in seen["pe"]))
    mask = torch.full((1, s, s), float("-inf"), dtype=torch.float64)
    cu = seen["cu"].tolist()
    for a, b in zip(cu, cu[1:]):
        mask[..., a:b, a:b] = 0
    q, k = q.transpose(0, 1), k.transpose(0, 1)  # [H, S, D]
    weights = (q @ k.transpose(1, 2) / np.sqrt(q.shape[-1]) + mask).softmax(-1)
    score = weights.mean(0).sum(0).view(s // 4, -1).mean(-1)  # [S / 4]
    key = k.view(k.shape[0], s // 4, 4, -1).mean(2)
    order = None
    tower = mm.adapter.vision_tower
    if hasattr(tower, "window_size"):
        from transformers.vision_utils import get_vision_window_index

        thw = torch.tensor([[t, h * 2, w * 2] for t, h, w in grids])
        order, _ = get_vision_window_index(thw, 2, tower.window_size, tower.patch_size, kwargs={})
        order = torch.argsort(order)
    if order is not None:
        score, key = score[order], key[:, order]
    key = key.mean(0)
    out, start = [], 0
    for emb in embeds:
        n = emb.shape[0]
        logits, metric = score[start : start + n], key[start : start + n]
        start += n
        dominant, contextual = int(d_frac * n), max(int(c_frac * n), 1)
        top = torch.topk(logits, dominant).indices
        chosen = torch.zeros(n, dtype=torch.bool)
        chosen[top] = True
        rest = (~chosen).nonzero(as_tuple=True)[0]
        m = metric[rest] / metric[rest].norm(dim=-1, keepdim=True)
        step = max(1, m.shape[0] // contextual)
        tgt = torch.arange(0, m.shape[0], step)[:contextual]
        others = ~torch.isin(torch.arange(m.shape[0]), tgt)
        assign = torch.zeros(int(others.sum()), contextual, dtype=torch.float64)
        assign.scatter_(1, (m[others] @ m[tgt].T).argmax(1, keepdim=True), 1)
        counts = assign.sum(0).clamp(min=1)[:, None]
        hidden = emb.double()[rest]
        ctx = hidden[tgt] + (assign.T @ hidden[others]) / counts
        chosen[rest[tgt]] = True
        new = emb.double().clone()
        new[rest[tgt]] = ctx
        out.append((chosen.nonzero(as_tuple=True)[0].tolist(), new[chosen]))
    return out


def test_visionzip_on_qwen_is_lightcompress_rule(qmm, qimages):
    batch = qmm.prepare(qimages, PROMPTS)
    seen, full, grids = _last_block_inputs(qmm, batch)
    tokens = 288
    from mmfast.pruning.visionzip import split_budget

    d, c = split_budget(tokens)
    want = _lightcompress_reference(qmm, seen, grids, full, d / 576, c / 576)
    with _session(qmm, "visionzip", tokens=tokens) as s, torch.inference_mode():
        vision = s.encode(batch)
    for i, (ids, rows) in enumerate(want):
        assert vision.patch_ids[i].tolist() == ids  # kept units, raster order; targets in their own slots
        torch.testing.assert_close(vision.projected[i].double(), rows, atol=1e-5, rtol=1e-5)
        n = full[i].shape[0]
        assert len(ids) == int(n * d / 576) + max(int(n * c / 576), 1) < n
    assert len({x.shape[0] for x in full}) > 1  # mixed sizes


def test_visionzip_on_qwen_batch_noop_positions_and_budget(qmm, qimages):
    cls = PRUNERS.get("visionzip").cls
    base = qmm.generate(qimages, PROMPTS, max_new_tokens=5)
    noop = _gen(qmm, qimages, PROMPTS, [{"method": "visionzip", "params": cls.noop_params(qmm.adapter)}])
    assert [r.token_ids for r in noop] == [r.token_ids for r in base]
    stage = [{"method": "visionzip", "params": {"tokens": 192}}]
    batched = _gen(qmm, qimages, PROMPTS, stage)
    single = [_gen(qmm, [im], [p], stage)[0] for im, p in zip(qimages, PROMPTS)]
    assert [r.token_ids for r in batched] == [r.token_ids for r in single]
    # params: the release's fractions, 192 = 162 + 30 of 576: int(162 N / 576) + max(int(30 N / 576), 1)
    assert [r.n_vision_tokens for r in batched] == [
        int(b.n_vision_tokens * 162 / 576) + max(int(b.n_vision_tokens * 30 / 576), 1) for b in base
    ]
    # a budget keeps its target of every image: tokens B = B, ratio r = round(r N_i)
    for budget, want in (({"tokens": 20}, lambda n: 20), ({"ratio": 0.5}, lambda n: round(0.5 * n))):
        got = _gen(qmm, qimages, PROMPTS, [{"method": "visionzip", "budget": budget}])
        assert [r.n_vision_tokens for r in got] == [want(b.n_vision_tokens) for b in base]
    batch = qmm.prepare(qimages[:1], PROMPTS[:1])
    with _session(qmm, "visionzip", tokens=288) as s, torch.inference_mode():
        vision = s.encode(batch)
        inputs = s.build_inputs(batch, vision)
    with Session(qmm, load_recipe({})) as s, torch.inference_mode():
        full = s.build_inputs(batch, s.encode(batch))
    kept = vision.patch_ids[0]  # every kept unit (a contextual one: its target's) keeps its (t, h, w) ids
    img = full.position_ids[0][full.image_mask[0]]
    assert torch.equal(inputs.position_ids[0][inputs.image_mask[0]], img[kept])
    assert torch.equal(inputs.position_ids[0][-1], full.position_ids[0][-1])  # the text keeps its place


def test_visionzip_on_qwen_stats_report_the_split_each_image_got(qmm, qimages):
    """The stats report what was applied: under a budget each image's own target split 27:5 (``tokens: 20``:
    17 dominant + 3 contextual per image), never the params' fractions of 576 the budget replaced; under
    params, the fractions and each sample's dominant + contextual counts (their sum is the tokens kept)."""
    from mmfast.pruning.visionzip import split_budget

    d, c = split_budget(20)
    got = _gen(qmm, qimages, PROMPTS, [{"method": "visionzip", "budget": {"tokens": 20}}], n=1)
    for r in got:
        stats = r.stats["visionzip"]
        assert (stats["dominant"], stats["contextual"]) == (d, c) and "dominant_fraction" not in stats
    got = _gen(qmm, qimages, PROMPTS, [{"method": "visionzip", "params": {"tokens": 192}}], n=1)
    for r in got:
        stats = r.stats["visionzip"]
        assert stats["dominant_fraction"] == 162 / 576 and stats["contextual_fraction"] == 30 / 576
        assert stats["dominant"] + stats["contextual"] == r.n_vision_tokens and stats["contextual"] >= 1


def test_cdpruner_clip_model_is_refused_on_qwen():
    from mmfast.errors import ConfigError

    rec = load_recipe({"pruning": [{"method": "cdpruner", "params": {"clip_model": "/some/clip"}}]})
    with pytest.raises(ConfigError, match="clip_model"):
        check_model(rec, ModelFacts("qwen2_5_vl", 4, 4, (24, 24), ADAPTERS["qwen2_5_vl"].features))


def test_visionzip_family_decisions():
    def facts(fam, cls):
        return ModelFacts(fam, 4, 4, (24, 24), replace(ADAPTERS[fam].features, cls_token=cls))

    rec = load_recipe({"pruning": [{"method": "visionzip"}]})
    for fam in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"):
        assert check_model(rec, facts(fam, False)) is None
    assert "needs a CLS token" in check_model(rec, facts("llava_onevision", False))
    assert "needs a CLS token" in check_model(rec, facts("llava", False))  # a CLIP-less LLaVA: no substitute


# -- CDPruner: OpenVINO GenAI's Qwen relevance (LLM input embeddings) -----------------------------------
def test_cdpruner_on_qwen_is_the_conditional_dpp_of_each_image(qmm, qimages):
    batch = qmm.prepare(qimages, PROMPTS)
    with Session(qmm, load_recipe({})) as s, torch.inference_mode():
        full = [p.clone() for p in qmm.adapter.project(s.encode(batch))]
    ratio = 0.4
    with _session(qmm, "cdpruner", ratio=ratio) as s, torch.inference_mode():
        vision = s.encode(batch)
    with torch.inference_mode():
        for i, x in enumerate(full):
            ids = qmm.tokenizer(PROMPTS[i], add_special_tokens=False)["input_ids"]
            text = qmm.adapter.embed_tokens(torch.tensor(ids)).mean(0, keepdim=True)
            want = _cdpruner_reference(x, text, round(ratio * x.shape[0]))  # relevance not negated
            assert vision.patch_ids[i].tolist() == want
            torch.testing.assert_close(vision.projected[i], x[want], atol=0, rtol=0)
            if "deepstack" in vision.tags:
                assert vision.tags["deepstack"][i].shape[0] == len(want)


def test_cdpruner_on_qwen_noop_batch_and_budget(qmm, qimages):
    cls = PRUNERS.get("cdpruner").cls
    base = qmm.generate(qimages, PROMPTS, max_new_tokens=5)
    noop = _gen(qmm, qimages, PROMPTS, [{"method": "cdpruner", "params": cls.noop_params(qmm.adapter)}])
    assert [r.token_ids for r in noop] == [r.token_ids for r in base]
    assert cls.budget_params(20, None, qmm.adapter, cls.Config(), "budget") == {"keep": 20}
    stage = [{"method": "cdpruner", "params": {"ratio": 192 / 576}}]
    batched = _gen(qmm, qimages, PROMPTS, stage)
    single = [_gen(qmm, [im], [p], stage)[0] for im, p in zip(qimages, PROMPTS)]
    assert [r.token_ids for r in batched] == [r.token_ids for r in single]
    assert [r.n_vision_tokens for r in batched] == [round(b.n_vision_tokens * 192 / 576) for b in base]
    got = _gen(qmm, qimages, PROMPTS, [{"method": "cdpruner", "budget": {"tokens": 20}}])
    assert [r.n_vision_tokens for r in got] == [20] * len(base)  # a budget: B of every image
