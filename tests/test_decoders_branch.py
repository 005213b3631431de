"""Branch decoders (VCD, M3ID, RITUAL, DAMRO): no-op settings reproduce the baselines exactly and
each method's defining behaviour holds on a tiny model."""

from __future__ import annotations

import math

import pytest
import torch

from mmfast.config import load_recipe
from mmfast.decoding.branches import additive, contrastive, m3id, plausibility_mask
from mmfast.decoding.vcd import ddpm_noise
from mmfast.errors import ConfigError
from mmfast.pipeline import Session

NOOP = {
    "vcd": {"alpha": 0.0, "beta": 0.0},
    "m3id": {"lam": 0.0, "beta": 0.0},
    "ritual": {"alpha": 0.0, "beta": 0.0},
    "damro": {"alpha": 0.0, "beta": 0.0},
}


def _gen(mm, images, prompts, method, params, seed=5, n=8):
    recipe = load_recipe({"decoding": {"method": method, "params": params, "seed": seed}})
    with Session(mm, recipe) as s:
        return [r.token_ids for r in s.generate(images, prompts, max_new_tokens=n)], s


@pytest.mark.parametrize("method", sorted(NOOP))
def test_noop_equals_sampling_baseline(method, tiny_mm, images, prompts):
    base, _ = _gen(tiny_mm, images[:2], prompts[:2], "sample", {})
    got, _ = _gen(tiny_mm, images[:2], prompts[:2], method, NOOP[method])
    assert got == base


@pytest.mark.parametrize("method", sorted(NOOP))
def test_noop_greedy_equals_greedy(method, tiny_mm, images, prompts):
    base, _ = _gen(tiny_mm, images[:2], prompts[:2], "greedy", {})
    got, _ = _gen(tiny_mm, images[:2], prompts[:2], method, {**NOOP[method], "sample": False})
    assert got == base


@pytest.mark.parametrize("method", sorted(NOOP))
def test_active_setting_changes_output_and_batch(method, tiny_mm, images, prompts):
    params = {"sample": False, "beta": 0.0} | ({"alpha": 3.0} if method != "m3id" else {"lam": 0.5})
    batched, _ = _gen(tiny_mm, images[:3], prompts[:3], method, params, n=10)
    single = [_gen(tiny_mm, [im], [p], method, params, n=10)[0][0] for im, p in zip(images[:3], prompts[:3])]
    assert batched == single
    greedy, _ = _gen(tiny_mm, images[:3], prompts[:3], "greedy", {}, n=10)
    assert batched != greedy


def test_fusion_math():
    clean = torch.tensor([[2.0, 1.0, -5.0]])
    aux = torch.tensor([[1.0, 3.0, 0.0]])
    assert torch.equal(contrastive(clean, aux, 1.0), torch.tensor([[3.0, -1.0, -10.0]]))
    assert torch.equal(additive(clean, aux, 3.0), torch.tensor([[5.0, 10.0, -5.0]]))
    assert torch.equal(m3id(clean, aux, 0, 0.02), clean)  # gamma_0 = 1: no contrast at t = 0
    w = (1 - math.exp(-0.2)) / math.exp(-0.2)
    torch.testing.assert_close(m3id(clean, aux, 10, 0.02), clean + w * (clean - aux))
    # plausibility: keep p(y) >= beta * max p  <=>  l_y >= log(beta) + max l
    keep = plausibility_mask(clean, 0.1)
    assert keep.tolist() == [[True, True, False]]
    assert plausibility_mask(clean, 0.0).all()


def test_vcd_noise_is_ddpm_step():
    x = torch.ones(2, 3, 4, 4)
    gen = torch.Generator().manual_seed(0)
    y = ddpm_noise(x, 500, gen)
    eps = torch.randn(x.shape, generator=torch.Generator().manual_seed(0))
    betas = torch.sigmoid(torch.linspace(-6, 6, 1000, dtype=torch.float64)) * (0.5e-2 - 1e-5) + 1e-5
    abar = torch.cumprod(1 - betas, 0)[500]
    torch.testing.assert_close(y, (abar.sqrt() * x + (1 - abar).sqrt() * eps).float())
    assert abs(abar.sqrt().item() - 0.863) < 0.01  # x' ~ 0.863 x + 0.505 eps, as the spec says


def test_vcd_branches_share_one_forward(tiny_mm, images, prompts):
    with Session(tiny_mm, load_recipe({"decoding": {"method": "vcd", "seed": 5}})) as s:
        r = s.generate(images[:2], prompts[:2], max_new_tokens=4)
    assert r[0].stats["branches"] == ["clean", "noised"] and r[0].stats["forwards_per_step"] == 1


def test_m3id_branch_has_no_image(tiny_mm, images, prompts):
    with Session(tiny_mm, load_recipe({"decoding": {"method": "m3id"}})) as s:
        batch = tiny_mm.prepare(images[:2], prompts[:2])
        inputs = s.text_only_inputs(batch)
        assert inputs.image_mask.sum() == 0
        assert (inputs.input_ids == tiny_mm.adapter.image_token_id).sum() == 0
        r = s.run(batch, max_new_tokens=3)
        assert r[0].stats["forwards_per_step"] == 2  # different lengths: separate caches


def _record_prefills(session) -> list:
    """The LMInputs of every prefill ``session``'s runner does from now on (appended as they run)."""
    seen = []
    orig = session.runner.prefill

    def spy(inputs):
        seen.append(inputs)
        return orig(inputs)

    session.runner.prefill = spy
    return seen


def test_m3id_image_free_prompt_keeps_the_newline(tiny_mm, images, prompts):
    """RITUAL's M3ID deletes only the image placeholder id: the newline after it stays."""
    tok = tiny_mm.processor.tokenizer
    batch = tiny_mm.prepare(images[:2], prompts[:2])
    recipe = load_recipe({"decoding": {"method": "m3id", "params": {"sample": False, "beta": 0.0, "lam": 0.5}}})
    with Session(tiny_mm, recipe) as s:
        seen = _record_prefills(s)
        s.run(batch, max_new_tokens=2)
    branch = next(x for x in seen if x.image_mask.sum() == 0)
    for b, prompt in enumerate(prompts[:2]):
        row = branch.input_ids[b][branch.attention_mask[b].bool()].tolist()
        text = tiny_mm.chat_text(prompt, 1)
        assert "<image>\n" in text
        expect = tok(text.replace("<image>", ""), add_special_tokens=True)["input_ids"]
        assert row == expect and tok.decode(row).count("\n") == 1
        assert row != tok(tiny_mm.chat_text(prompt, 0), add_special_tokens=True)["input_ids"]


def _damro_direct_outliers(mm, batch, k):
    """DAMRO's release rule, computed here from the tower alone: one-head CLS attention of the layer that
    produces the selected features (``encoder.layers[vision_feature_layer]``), top-k in descending order."""
    tower = mm.adapter.vision_tower
    with torch.no_grad():
        hs = tower(batch.pixel_values.float(), output_hidden_states=True).hidden_states
        feat_idx = mm.adapter.vision_feature_layer_index()  # hs[feat_idx + 1] is the feature layer's output
        layer = mm.adapter.vision_layers[feat_idx]
        h = layer.layer_norm1(hs[feat_idx])  # [n, 1 + N, C] the feature layer's input
        q, kk = layer.self_attn.q_proj(h)[:, 0], layer.self_attn.k_proj(h)  # [n, C], [n, 1 + N, C]
        attn = torch.softmax(torch.einsum("nc,nmc->nm", q, kk) / q.shape[-1] ** 0.5, dim=-1)[:, 1:]
        order = attn.argsort(dim=-1, descending=True)[:, :k]  # [n, k] descending attention
        feats = hs[feat_idx + 1][:, 1:]  # [n, N, C]
        expect = torch.stack([mm.adapter.projector(feats[i, order[i]]) for i in range(len(order))])
    return order, expect


def test_damro_branch_feeds_topk_in_descending_attention_order(tiny_mm, images, prompts):
    recipe = load_recipe({"decoding": {"method": "damro", "params": {"k": 3}}})
    with Session(tiny_mm, recipe) as s:
        seen = _record_prefills(s)
        res = s.generate(images[:2], prompts[:2], max_new_tokens=3)
        assert sorted(x.image_mask.sum(1).tolist() for x in seen) == sorted([[16, 16], [3, 3]])
    order, expect = _damro_direct_outliers(tiny_mm, tiny_mm.prepare(images[:2], prompts[:2]), 3)
    assert [r.stats["outliers"] for r in res] == [[t] for t in order.tolist()]
    assert any(order[i].tolist() != sorted(order[i].tolist()) for i in range(len(order)))  # order matters here
    branch = next(x for x in seen if x.image_mask.sum(1).tolist() == [3, 3])
    got = torch.stack([branch.embeds[b][branch.image_mask[b]] for b in range(2)])  # [2, k, D] in sequence order
    torch.testing.assert_close(got, expect)


def test_damro_outliers_on_full_feature_strategy(images, prompts):
    """With ``vision_feature_select_strategy: full`` the features lead with the CLS row (patch id -1): the
    outlier branch still feeds the top-k *patches* (CLS attention over the patches), not the rows one before."""
    import mmfast
    from mmfast.models.factory import random_llava

    model, processor = random_llava("tiny", init_std=0.2)
    model.config.vision_feature_select_strategy = "full"
    mm = mmfast.load(model, processor)
    recipe = load_recipe({"decoding": {"method": "damro", "params": {"k": 16}}})  # every patch, CLS excluded
    with Session(mm, recipe) as s:
        seen = _record_prefills(s)
        res = s.generate(images[:2], prompts[:2], max_new_tokens=2)
    order, expect = _damro_direct_outliers(mm, mm.prepare(images[:2], prompts[:2]), 16)
    assert [r.stats["outliers"] for r in res] == [[t] for t in order.tolist()]
    branch = next(x for x in seen if x.image_mask.sum(1).tolist() == [16, 16])
    got = torch.stack([branch.embeds[b][branch.image_mask[b]] for b in range(2)])  # [2, k, D] in sequence order
    torch.testing.assert_close(got, expect)


def test_ritual_transform_pool(tiny_mm, images, prompts):
    from mmfast.decoding.ritual import POOL, query_rng, transform

    for kind in POOL:
        out = transform(images[0], kind, query_rng(0, "p", images[0]), 32)
        assert out.mode == "RGB"
        if kind != "resized_crop":
            assert out.size == images[0].size
    recipe = load_recipe({"decoding": {"method": "ritual", "params": {"transforms": ["vflip"]}}})
    with Session(tiny_mm, recipe) as s:
        r = s.generate(images[:2], prompts[:2], max_new_tokens=2)
        assert [x.stats["transform"] for x in r] == ["vflip", "vflip"]
    recipe = load_recipe({"decoding": {"method": "ritual", "params": {"alpha_neg": 1.0}}})
    with Session(tiny_mm, recipe) as s:
        r = s.generate(images[:1], prompts[:1], max_new_tokens=2)
        assert r[0].stats["branches"] == ["clean", "transformed", "noised"] and r[0].stats["forwards_per_step"] == 1


@pytest.mark.parametrize("key, value", [("temperature", 0.5), ("top_k", 1), ("top_p", 0.5)])
def test_damro_takes_no_warpers(key, value):
    """DAMRO's release samples straight from the softmax of the fused logits: a warper key is refused, not
    accepted and dropped (VCD, RITUAL and LQCD take them)."""
    with pytest.raises(ConfigError, match="unknown key") as exc:
        load_recipe({"decoding": {"method": "damro", "params": {key: value}}})
    assert exc.value.path == f"decoding.params.{key}"
    assert load_recipe({"decoding": {"method": "vcd", "params": {key: value}}})


@pytest.mark.parametrize(
    "method, params, path",
    [
        ("ritual", {"transforms": []}, "decoding.params.transforms"),
        ("lqcd", {"yes_no_templates": []}, "decoding.params.yes_no_templates"),
        ("lqcd", {"open_templates": []}, "decoding.params.open_templates"),
    ],
)
def test_empty_pools_are_refused_with_their_key(method, params, path):
    with pytest.raises(ConfigError, match="needs at least 1 item, got 0") as exc:
        load_recipe({"decoding": {"method": method, "params": params}})
    assert exc.value.path == path


def test_an_lqcd_template_that_does_not_format_with_q_is_refused():
    with pytest.raises(ConfigError, match=r"open_templates\[0\] '\{question\} now' does not format with \{q\}"):
        load_recipe({"decoding": {"method": "lqcd", "params": {"open_templates": ["{question} now"]}}})
    assert load_recipe({"decoding": {"method": "lqcd", "params": {"open_templates": ["{q} {{literal}}"]}}})


def test_ritual_resized_crop_falls_back_to_torchvisions_central_crop():
    """A 400 x 40 panorama: every one of the ten draws misses (the crop is taller than the image), and
    torchvision's fallback is the central crop with the aspect ratio clamped to 4/3 (53 x 40), not the
    whole image squashed."""
    import random

    import numpy as np
    from PIL import Image

    from mmfast.decoding.ritual import _resized_crop

    im = Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 400, 3), dtype=np.uint8))
    rng = random.Random(0)
    draws = random.Random(0)
    misses = 0
    for _ in range(10):  # the same draws as the transform: each misses
        target, ratio = 16000 * draws.uniform(0.08, 1.0), math.exp(draws.uniform(math.log(3 / 4), math.log(4 / 3)))
        misses += not (round(math.sqrt(target * ratio)) <= 400 and round(math.sqrt(target / ratio)) <= 40)
    assert misses == 10
    got = _resized_crop(im, 32, rng)
    w = round(40 * 4 / 3)  # 53
    want = im.resize((32, 32), Image.BILINEAR, box=((400 - w) // 2, 0, (400 - w) // 2 + w, 40))
    assert np.array_equal(np.asarray(got), np.asarray(want))
    assert not np.array_equal(np.asarray(got), np.asarray(im.resize((32, 32), Image.BILINEAR)))


@pytest.mark.parametrize(
    "method, params",
    [("m3id", {"lam": 0.5, "beta": 0.0}), ("pai", {"alpha": 0.5, "gamma": 1.5, "beta": 0.0})],
)
def test_branch_decoders_with_warper_keys_sample_through_them(method, params, tiny_mm, images, prompts):
    """M3ID (RITUAL's code) and PAI (generate's CFG logits processor) apply the warpers to the fused logits before
    sampling, like VCD: the temperature / top-k / top-p keys their configs accept are used, not dropped (top-k 1 =
    the argmax of the fused, masked logits)."""
    argmax, _ = _gen(tiny_mm, images[:3], prompts[:3], method, {**params, "sample": False})
    top1, _ = _gen(tiny_mm, images[:3], prompts[:3], method, {**params, "sample": True, "top_k": 1})
    assert top1 == argmax


def test_m3id_long_answers_stay_finite(tiny_mm, images, prompts):
    """M3ID's weight (1 - g_t) / g_t grows as e^(lambda t): on settings the config accepts (lambda up to 10, answers
    up to 8192 tokens) it reaches the formula's limit -- the contrast l - l_u orders the tokens -- instead of
    dividing by zero (g_t underflows) or overflowing the fused logits to inf (NaN in the sampler)."""
    clean = torch.tensor([[2.0, 1.0, -5.0, 0.5]])
    uncond = torch.tensor([[1.0, 3.0, -9.0, 0.0]])
    for t, lam in [(75, 10.0), (9, 10.0), (6000, 0.02)]:
        fused = m3id(clean, uncond, t, lam)
        assert torch.isfinite(fused).all()
        assert int(fused.argmax()) == int((clean - uncond).argmax()) == 2
    _gen(tiny_mm, images[:2], prompts[:2], "m3id", {"lam": 10.0, "sample": True}, n=30)  # no NaN in the sampler
