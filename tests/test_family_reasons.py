"""Family decisions (issue 20, item 3; issue 28, item 4): every need a method declares comes with its
reason, and a refusal quotes the unmet need, the family and the reason (from the config alone and on a loaded model). The
single-pass attention-editing decoders (PAI, ONLY, ClearSight) on the Qwen-VL families: no-op settings
are greedy exactly, batch with mixed image sizes equals per sample."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from test_diversity_peers import _divprune_reference

import mmfast
from mmfast.capabilities import ModelFacts, caps_of, check_model, unmet_need
from mmfast.config import load_recipe
from mmfast.errors import IncompatibleRecipeError
from mmfast.models import ADAPTERS
from mmfast.pipeline import Session
from mmfast.registry import DECODERS, DRAFTERS, PRUNERS

QWEN = ["qwen2_5_vl", "qwen2_vl", "qwen3_vl"]


@pytest.mark.parametrize("registry", [PRUNERS, DECODERS, DRAFTERS], ids=lambda r: r.kind)
def test_every_need_has_a_reason(registry):
    """Each need a method declares comes with its own sentence on why (quoted in every refusal)."""
    missing = []
    for e in registry.entries():
        caps = caps_of(e.cls, None)
        for need in sorted(caps.needs, key=lambda n: n.name):
            if len(caps.why.get(need, "")) < 20:  # a sentence, not a placeholder
                missing.append(f"{e.name}: {need.name}")
        assert not set(caps.why) - caps.needs, f"{e.name} explains a need it does not declare"
    assert not missing, "needs without a reason: " + ", ".join(missing)


def _facts(family):
    return ModelFacts(family, 4, 4, (24, 24), ADAPTERS[family].features)


@pytest.mark.parametrize(
    "recipe, family, reason",
    [
        ({"pruning": [{"method": "hicom"}]}, "qwen2_5_vl", "hicom"),
        ({"pruning": [{"method": "tome"}]}, "llava_next", "tome"),
        ({"pruning": [{"method": "dynamic_llava", "params": {"predictors": "random"}}]}, "qwen3_vl", "dynamic_llava"),
        ({"speculative": {"method": "msd"}}, "qwen2_vl", "msd"),
    ],
    ids=["hicom-qwen2_5_vl", "tome-llava_next", "dynamic_llava-qwen3_vl", "msd-qwen2_vl"],
)
def test_config_refusal_quotes_the_reason(recipe, family, reason):
    from mmfast.registry import DRAFTERS as D
    from mmfast.registry import PRUNERS as P

    name = reason
    entry = P.get(name) if name in P.names() else D.get(name)
    caps = caps_of(entry.cls, None)
    need = unmet_need(caps, ADAPTERS[family].features)
    msg = check_model(load_recipe(recipe), _facts(family))
    assert need is not None and msg is not None
    assert f"({name}) needs {need.value}, which this model ({family}) does not have" in msg
    assert f": {caps.why[need]}; " in msg
    assert "methods that run there:" in msg


# -- loaded Qwen models -----------------------------------------------------------------------------
@pytest.fixture(params=QWEN, scope="module")
def qdir(request, tmp_path_factory):
    from mmfast.models.factory import random_qwen_vl, save_model

    model, processor = random_qwen_vl(request.param, seed=1)
    return save_model(model, processor, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def qmm(qdir):
    return mmfast.load(qdir, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def qimages() -> list[Image.Image]:
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in [(40, 48), (64, 32), (24, 56)]]


PROMPTS = ["Describe the image.", "Is there a cat in the image?", "What color is the car? Tell me now please."]


def test_loaded_refusal_quotes_the_reason(qmm):
    caps = caps_of(PRUNERS.get("hicom").cls, None)
    need = unmet_need(caps, qmm.adapter.features)
    with pytest.raises(IncompatibleRecipeError, match="hicom") as exc:
        Session(qmm, load_recipe({"pruning": [{"method": "hicom"}]}))
    assert f"needs {need.value}, which this model ({qmm.adapter.family}) does not have" in str(exc.value)
    assert f": {caps.why[need]}; " in str(exc.value)


def _tokens(mm, images, prompts, decoding, n=6):
    with Session(mm, load_recipe({"decoding": decoding})) as s:
        return [r.token_ids for r in s.generate(images, prompts, max_new_tokens=n, seed=0)]  # one stream for every call


NOOP = {
    "pai": {"alpha": 0.0, "gamma": 1.0},
    "only": {"alpha_pos": 0.0, "alpha_neg": 0.0, "beta": 0.0, "sample": False},
    "clearsight": {"enhance": 1.0, "suppress": 1.0},
}
ACTIVE = {
    "pai": {"alpha": 1.0, "gamma": 1.5},
    "only": {"gamma": 1.5},  # sampling (official), per-sample generators
    "clearsight": {"enhance": 2.0, "suppress": 0.5, "layers": [0, 1]},
}


@pytest.mark.parametrize("name", sorted(NOOP))
def test_attention_editors_on_qwen(name, qmm, qimages):
    assert unmet_need(caps_of(DECODERS.get(name).cls, None), qmm.adapter.features) is None
    base = _tokens(qmm, qimages, PROMPTS, {"method": "greedy"})
    assert _tokens(qmm, qimages, PROMPTS, {"method": name, "params": NOOP[name]}) == base
    dec = {"method": name, "params": ACTIVE[name]}
    batched = _tokens(qmm, qimages, PROMPTS, dec)
    single = [_tokens(qmm, [im], [p], dec)[0] for im, p in zip(qimages, PROMPTS)]
    assert batched == single
    if name != "only":  # ONLY samples: a different draw, not an edit, could differ too
        assert batched != base


# -- DART on the Qwen-VL families (the release has Qwen2-VL / Qwen2.5-VL code) ----------------------
def _gen(mm, images, prompts, pruning, n=6):
    return mm.generate(images, prompts, recipe={"pruning": pruning}, max_new_tokens=n)


def test_dart_noop_equals_baseline_on_qwen(qmm, qimages):
    assert unmet_need(caps_of(PRUNERS.get("dart").cls, None), qmm.adapter.features) is None
    base = qmm.generate(qimages, PROMPTS, max_new_tokens=6)
    noop = _gen(qmm, qimages, PROMPTS, [{"method": "dart", "params": PRUNERS.get("dart").cls.noop_params(qmm.adapter)}])
    assert [r.token_ids for r in noop] == [r.token_ids for r in base]


def test_dart_batch_equals_single_on_qwen(qmm, qimages):
    """Mixed image sizes: each image keeps pivot_image + t (pivot_image + pivot_text) tokens with
    t = min(M, N_i - pivot_image) // pivots, whatever batch it is in."""
    params = {"k": 1, "pivot_image": 2, "pivot_text": 2, "truncation": 4}
    stage = [{"method": "dart", "params": params}]
    batched = _gen(qmm, qimages, PROMPTS, stage)
    single = [_gen(qmm, [im], [p], stage)[0] for im, p in zip(qimages, PROMPTS)]
    assert [r.token_ids for r in batched] == [r.token_ids for r in single]
    base = qmm.generate(qimages, PROMPTS, max_new_tokens=1)
    for r, b in zip(batched, base):
        n = b.n_vision_tokens
        assert r.stats["dart"]["kept"] == 2 + min(4, n - 2) // 4 * 4


def test_dart_budget_is_mapped_on_each_images_own_count_on_qwen(qmm):
    """A budget B is B layer-averaged tokens of every image, whatever its count (not B / 576 of it)."""
    from mmfast.pruning._budget import in_llm_keep

    cls = PRUNERS.get("dart").cls
    cfg = cls.Config(k=1)
    for n in (40, 90):
        keep = in_llm_keep(30, n, 1, len(qmm.adapter.layers), "budget")
        pivots = cfg.pivot_image + cfg.pivot_text
        want = max(0, round((keep - cfg.pivot_image) / pivots)) * pivots
        assert cls.budget_params(30, n, qmm.adapter, cfg, "budget") == {"truncation": want}


def _qwen_dart_reference(mm, inputs, layer, n_img_piv, n_txt_piv, per_pivot):
    """DART's rule for one sample from the plain HF language model: keys of layer K-1 (k_proj, the
    layer's k_norm where it has one, M-RoPE at the prompt's 3-D ids), final norm of the state entering K."""
    import sys

    lm, adapter = mm.adapter.language_model, mm.adapter
    pos = adapter.lm_position_ids(inputs.position_ids)  # [3, 1, T]
    with torch.inference_mode():
        out = lm(inputs_embeds=inputs.embeds, position_ids=pos, output_hidden_states=True)
        attn = adapter.layers[layer - 1].self_attn
        x = adapter.layers[layer - 1].input_layernorm(out.hidden_states[layer - 1])
        hd = attn.head_dim
        k = attn.k_proj(x).view(1, x.shape[1], -1, hd)
        q = attn.q_proj(x).view(1, x.shape[1], -1, hd)
        if hasattr(attn, "k_norm"):
            k, q = attn.k_norm(k), attn.q_norm(q)
        cos, sin = lm.rotary_emb(x, position_ids=pos)
        _, k = sys.modules[type(attn).__module__].apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        k = k.repeat_interleave(q.shape[2] // k.shape[1], dim=1)  # repeat_kv, as the release's keys
        key_l1 = k[0].permute(1, 0, 2).reshape(x.shape[1], -1).abs().sum(-1)  # [T]
        feats = lm.norm(out.hidden_states[layer])[0]  # [T, d]
    image = inputs.image_mask[0].nonzero().squeeze(1).tolist()
    text = list(range(image[-1] + 1, inputs.length))
    img_piv = sorted(image, key=lambda t: -float(key_l1[t]))[:n_img_piv]
    txt_piv = sorted(text, key=lambda t: -float(key_l1[t]))[:n_txt_piv]
    valid = [t for t in image if t not in img_piv]
    kept = set(img_piv)
    for p in sorted(img_piv + txt_piv):
        sims = {
            t: float(torch.nn.functional.cosine_similarity(feats[p].double(), feats[t].double(), dim=0)) for t in valid
        }
        picked = sorted(valid, key=lambda t: sims[t])[:per_pivot]  # least similar to the pivot
        kept.update(picked)
        valid = [t for t in valid if t not in picked]
    return sorted(kept)


def test_dart_decisions_equal_a_direct_computation_on_qwen(qmm, qimages):
    if qmm.adapter.family == "qwen3_vl":
        pytest.skip("the plain LM forward has no deepstack features, which the runtime adds after layers 0..n-1")
    layer, pi, pt, m = 2, 2, 2, 8  # t = 8 // 4 = 2 -> 2 + 2 x 4 = 10 image tokens kept
    for b in range(2):
        batch = qmm.prepare(qimages[b : b + 1], PROMPTS[b : b + 1])
        params = {"k": layer, "pivot_image": pi, "pivot_text": pt, "truncation": m}
        with Session(qmm, load_recipe({"pruning": [{"method": "dart", "params": params}]})) as s:
            inputs = s.build_inputs(batch, s.encode(batch))
            state, _ = s.runner.prefill(inputs)
        want = _qwen_dart_reference(qmm, inputs, layer, pi, pt, 2)
        grp = state.groups[-1]
        src = grp.source[0][grp.key_mask[0]]
        assert src[inputs.image_mask[0][src]].tolist() == want and len(want) == 10
        assert torch.equal(grp.positions[0][grp.key_mask[0]], inputs.position_ids[0][src])  # original (t, h, w) ids


# -- DivPrune on the Qwen-VL families (merged tokens; budget a fraction of each image) ------------------
def test_divprune_on_qwen_selects_the_max_min_subset_of_each_image(qmm, qimages):
    batch = qmm.prepare(qimages, PROMPTS)
    with Session(qmm, load_recipe({})) as base, torch.inference_mode():
        full = [p.clone() for p in qmm.adapter.project(base.encode(batch))]
    ratio = 0.3
    with Session(qmm, load_recipe({"pruning": [{"method": "divprune", "params": {"ratio": ratio}}]})) as s:
        vision = s.encode(batch)
    for i, x in enumerate(full):
        want = _divprune_reference(x, round(ratio * x.shape[0]))
        torch.testing.assert_close(vision.projected[i], x[want], atol=0, rtol=0)
        assert vision.patch_ids[i].tolist() == want  # merged-token ids: their grid cells' 3-D positions
    assert len({x.shape[0] for x in full}) > 1  # mixed sizes: a fraction of each image, not one count


def test_divprune_on_qwen_noop_batch_and_budget(qmm, qimages):
    """``tokens: N`` keeps exactly N of every image (mixed sizes), ``ratio: r`` round(r N_i) of each."""
    cls = PRUNERS.get("divprune").cls
    base = qmm.generate(qimages, PROMPTS, max_new_tokens=6)
    noop = _gen(qmm, qimages, PROMPTS, [{"method": "divprune", "params": cls.noop_params(qmm.adapter)}])
    assert [r.token_ids for r in noop] == [r.token_ids for r in base]
    n = [b.n_vision_tokens for b in base]
    assert len(set(n)) > 1 and cls.budget_params(7, 999, qmm.adapter, cls.Config(), "budget") == {"keep": 7}
    for budget, want in (
        ({"tokens": min(n) - 1}, [min(n) - 1] * len(n)),
        ({"ratio": 0.4}, [round(0.4 * x) for x in n]),
    ):
        stage = [{"method": "divprune", "budget": budget}]
        batched = _gen(qmm, qimages, PROMPTS, stage)
        single = [_gen(qmm, [im], [p], stage)[0] for im, p in zip(qimages, PROMPTS)]
        assert [r.token_ids for r in batched] == [r.token_ids for r in single]
        assert [r.n_vision_tokens for r in batched] == want


# -- PyramidDrop on the Qwen-VL families (M-RoPE scoring, original ids kept) ---------------------------
def _noop_and_batch(qmm, qimages, method):
    """``method``'s no-op setting reproduces the baseline and its test setting decides a batch as its
    samples alone; returns (params, batched results, baseline results)."""
    cls = PRUNERS.get(method).cls
    base = qmm.generate(qimages, PROMPTS, max_new_tokens=6)
    noop = _gen(qmm, qimages, PROMPTS, [{"method": method, "params": cls.noop_params(qmm.adapter)}])
    assert [r.token_ids for r in noop] == [r.token_ids for r in base]
    params = cls.test_params(qmm.adapter)
    stage = [{"method": method, "params": params}]
    batched = _gen(qmm, qimages, PROMPTS, stage)
    single = [_gen(qmm, [im], [p], stage)[0] for im, p in zip(qimages, PROMPTS)]
    assert [r.token_ids for r in batched] == [r.token_ids for r in single]
    return params, batched, base


def test_pyramiddrop_on_qwen_noop_counts_and_batch(qmm, qimages):
    params, batched, base = _noop_and_batch(qmm, qimages, "pyramiddrop")
    for r, b in zip(batched, base):  # int(N_i lambda^s) of each image's own tokens
        kept = r.stats["pyramiddrop"]["kept"]
        assert kept == [int(b.n_vision_tokens * params["ratio"] ** (s + 1)) for s in range(len(kept))]


def test_pyramiddrop_first_stage_ranks_by_the_eager_last_token_attention_on_qwen(qdir, qmm, qimages):
    """The first stage (original 3-D ids, nothing dropped before it): kept image tokens = the top
    int(N r_1) by the head-mean attention of the last token in that layer, from HF's eager attention."""
    if qmm.adapter.family == "qwen3_vl":
        pytest.skip("the plain LM forward has no deepstack features, which the runtime adds after layers 0..n-1")
    cls = PRUNERS.get("pyramiddrop").cls
    params = cls.test_params(qmm.adapter)
    eager = mmfast.load(qdir, device="cpu", dtype="float32", attn_implementation="eager")
    for b in range(2):
        batch = qmm.prepare(qimages[b : b + 1], PROMPTS[b : b + 1])
        with Session(qmm, load_recipe({"pruning": [{"method": "pyramiddrop", "params": params}]})) as s:
            inputs = s.build_inputs(batch, s.encode(batch))
            state, _ = s.runner.prefill(inputs)
        layer = state.groups[1].start
        with torch.no_grad():
            att = eager.adapter.language_model(
                inputs_embeds=inputs.embeds,
                output_attentions=True,
                position_ids=qmm.adapter.lm_position_ids(inputs.position_ids),
            ).attentions
        score = att[layer][0, :, -1].mean(0)  # [T] last token, head mean
        image = inputs.image_mask[0].nonzero().squeeze(1)
        k = int(image.numel() * params["ratio"])
        want = sorted(image[score[image].topk(k).indices].tolist())
        grp = state.groups[1]
        src = grp.source[0][grp.key_mask[0]]
        assert src[inputs.image_mask[0][src]].tolist() == want
        assert not grp.compact  # M-RoPE: original ids (LightCompress's Qwen2.5-VL rule)


@pytest.mark.parametrize("method", ["pyramiddrop", "sparsevlm"])
def test_in_llm_drops_keep_the_original_mrope_ids_on_qwen(method, qmm, qimages):
    """After every drop (and SparseVLM's recycling) each slot keeps the (t, h, w) ids of its prefill
    token (a merged token: its cluster centre's), as LightCompress's Qwen2.5-VL SparseVLM; the text
    after the image keeps its place, and decode continues at the largest prompt id + 1."""
    params = PRUNERS.get(method).cls.test_params(qmm.adapter)
    batch = qmm.prepare(qimages[:2], PROMPTS[:2])
    with Session(qmm, load_recipe({"pruning": [{"method": method, "params": params}]})) as s:
        inputs = s.build_inputs(batch, s.encode(batch))
        state, _ = s.runner.prefill(inputs)
    assert len(state.groups) > 1
    for grp in state.groups[1:]:
        assert not grp.compact
        for b in range(2):
            valid = grp.key_mask[b]
            src = grp.source[b][valid]
            assert bool(inputs.image_mask[b][src].sum() < inputs.image_mask[b].sum())  # something dropped
            assert torch.equal(grp.positions[b][valid], inputs.position_ids[b][src])
        full_next = inputs.position_ids.amax(-1).masked_fill(~inputs.attention_mask.bool(), -1).max(1).values + 1
        assert torch.equal(grp.next_positions(), full_next)


# -- SparseVLM on the Qwen-VL families (given counts per image, original ids kept) ----------------------
def test_sparsevlm_on_qwen_noop_counts_and_batch(qmm, qimages):
    params, batched, base = _noop_and_batch(qmm, qimages, "sparsevlm")
    for r, b in zip(batched, base):  # first filter: the given k_1 kept (capped at N_i), plus the recycled clusters
        st, n = r.stats["sparsevlm"], b.n_vision_tokens
        assert st["kept"][0] - st["recycled"][0] == min(n, params["keep"][0])


@pytest.mark.parametrize("family", QWEN)
def test_dart_default_m_on_qwen_is_the_releases_reduction_ratio(family):
    """The release's Qwen2-VL / Qwen2.5-VL code never reads max_num_trunction: TOKEN_TOPK =
    int(N (1 - reduction_ratio) / (pivots)), reduction_ratio 0.778 in its lmms-eval wrappers, so an image's
    M is a fraction of its own N (not 128 whatever N)."""
    from types import SimpleNamespace

    cls = PRUNERS.get("dart").cls
    dart = cls(cls.Config(), SimpleNamespace(adapter=SimpleNamespace(features=ADAPTERS[family].features)))
    for n in (64, 576, 1200, 3000):
        assert dart.per_pivot(n) == int(n * (1 - 0.778) / 8), n
