"""Staged in-LLM peers: PyramidDrop and SparseVLM, checked against direct re-computations of the
papers' rules (eager attention computed here, layer by layer, one sample at a time)."""

from __future__ import annotations

import pytest
import torch

import mmfast
from mmfast.config import Recipe, load_recipe
from mmfast.errors import ConfigError
from mmfast.pipeline import Session

PD = {"layer_mapping": "proportional"}  # the tiny model: 4 LLM layers, stages [8, 16, 24] -> [1, 2, 3]


@pytest.fixture(scope="module")
def eager(tiny_dir):
    return mmfast.load(tiny_dir, device="cpu", dtype="float32", attn_implementation="eager")


def _recipe(method, params=None, budget=None):
    stage = {"method": method, "params": params or {}}
    if budget is not None:
        stage["budget"] = budget
    return load_recipe({"pruning": [stage]})


def _prefill(session, images, prompts):
    batch = session.mm.prepare(images, prompts)
    inputs = session.build_inputs(batch, session.encode(batch))
    state, out = session.runner.prefill(inputs)
    return inputs, state, out


def _single_inputs(session, image, prompt):
    batch = session.mm.prepare([image], [prompt])
    return session.build_inputs(batch, session.encode(batch))


def _causal(t: int) -> torch.Tensor:
    return torch.full((t, t), float("-inf")).triu(1)[None, None]  # [1, 1, T, T] additive


def _layer_attention(mm, layer_idx, h, pos):
    """Eager attention probabilities [H, T, T] of layer ``layer_idx`` on hidden ``h`` ([1, T, d])."""
    layer = mm.adapter.layers[layer_idx]
    cos_sin = mm.adapter.language_model.rotary_emb(h, position_ids=pos[None])
    _, w = layer.self_attn(
        hidden_states=layer.input_layernorm(h), position_embeddings=cos_sin, attention_mask=_causal(h.shape[1])
    )
    return w[0]


def _run_layer(mm, layer_idx, h, pos):
    cos_sin = mm.adapter.language_model.rotary_emb(h, position_ids=pos[None])
    out = mm.adapter.layers[layer_idx](h, attention_mask=_causal(h.shape[1]), position_embeddings=cos_sin)
    return out[0] if isinstance(out, tuple) else out


def _logits(mm, h):
    return mm.adapter.lm_head(mm.adapter.language_model.norm(h[:, -1:])).float()[:, 0]


def _kept_sources(state, b):
    """Per layer group after the first: the prefill indices of its valid slots (in slot order)."""
    return [g.source[b][g.key_mask[b]].tolist() for g in state.groups[1:]]


# -- PyramidDrop ------------------------------------------------------------------------------------


def _pdrop_reference(mm, inputs, stages, ratios):
    """PyramidDrop on one unpadded sample: at each stage layer, rank the image tokens by the eager
    head-mean attention of the last token in that layer, keep int(N * r) in order, renumber positions."""
    h = inputs.embeds
    idx = torch.arange(h.shape[1])
    image = inputs.image_mask[0]
    n = int(image.sum())
    kept, pos = [], torch.arange(h.shape[1])
    with torch.no_grad():
        for layer_idx in range(len(mm.adapter.layers)):
            if layer_idx in stages:
                r = ratios[stages.index(layer_idx)]
                score = _layer_attention(mm, layer_idx, h, pos)[:, -1].mean(0)  # [T] last token, head mean
                vis = image[idx]
                vis_slots = vis.nonzero().squeeze(1)
                top = vis_slots[score[vis_slots].topk(int(n * r)).indices]
                keep = ~vis
                keep[top] = True
                h, idx = h[:, keep], idx[keep]
                pos = torch.arange(h.shape[1])
                kept.append(idx.tolist())
            h = _run_layer(mm, layer_idx, h, pos)
        return kept, _logits(mm, h)


@pytest.mark.parametrize("params", [{"ratio": 0.5}, {"ratios": (0.75, 0.5, 0.125)}])
def test_pdrop_selects_by_last_token_attention(tiny_mm, eager, images, prompts, params):
    with Session(tiny_mm, _recipe("pyramiddrop", {**PD, **params})) as s:
        inputs, state, out = _prefill(s, images[:3], prompts[:3])
        singles = [_single_inputs(s, im, p) for im, p in zip(images[:3], prompts[:3])]
    ratios = list(params.get("ratios") or [0.5, 0.25, 0.125])
    pad = (~inputs.attention_mask.bool()).sum(1)
    for b, one in enumerate(singles):
        want, want_logits = _pdrop_reference(eager, one, [1, 2, 3], ratios)
        got = [[i - int(pad[b]) for i in g] for g in _kept_sources(state, b)]
        assert got == want
        assert [sum(one.image_mask[0, want_g].tolist()) for want_g in want] == [int(16 * r) for r in ratios]
        torch.testing.assert_close(out.logits[b, 0], want_logits[0], atol=1e-4, rtol=1e-4)
    assert all(g.compact for g in state.groups[1:])


def test_pdrop_noop_is_baseline(tiny_mm, images, prompts):
    with Session(tiny_mm, Recipe()) as base:
        _, st0, want = _prefill(base, images[:2], prompts[:2])
    with Session(tiny_mm, _recipe("pyramiddrop", {**PD, "ratio": 1.0})) as s:
        _, st, got = _prefill(s, images[:2], prompts[:2])
    assert len(st.groups) == 1 and torch.equal(got.logits, want.logits)


@pytest.mark.parametrize("tokens", [12, 8, 6])
def test_pdrop_budget_lands_within_5_percent(tiny_mm, images, prompts, tokens):
    from mmfast.pruning.pyramiddrop import PyramidDrop, layer_average

    out = tiny_mm.generate(
        images[:2], prompts[:2], recipe=_recipe("pyramiddrop", PD, {"tokens": tokens}), max_new_tokens=2
    )
    for r in out:
        assert abs(r.vision_tokens_layer_avg - tokens) <= 0.05 * tokens
    cfg = _recipe("pyramiddrop", PD).pruning[0].params
    lam = PyramidDrop.budget_params(tokens, 16, tiny_mm.adapter, cfg, "b")["ratio"]
    assert out[0].vision_tokens_layer_avg == pytest.approx(layer_average(16, [1, 2, 3], [lam, lam**2, lam**3], 4))
    # the paper's shape: lambda for 192 / 128 / 64 on LLaVA-1.5 (N = 576, 32 layers)
    assert abs(layer_average(576, [8, 16, 24], [0.5, 0.25, 0.125], 32) - 270) < 1e-9
    with pytest.raises(ConfigError, match="smallest feasible budget is 4"):
        PyramidDrop.budget_params(3, 16, tiny_mm.adapter, cfg, "pruning[0].budget")


def test_pdrop_refuses_bad_schedules(tiny_mm):
    with pytest.raises(ConfigError, match="ratios"):
        Session(tiny_mm, _recipe("pyramiddrop", {**PD, "ratios": (0.5, 0.25)}))
    with pytest.raises(ConfigError, match="layers"):
        Session(tiny_mm, _recipe("pyramiddrop", {"layers": (8, 16, 24)}))  # absolute: no layer 8 here
    with pytest.raises(ConfigError, match="distinct"):
        Session(tiny_mm, _recipe("pyramiddrop", {**PD, "layers": (8, 9, 24)}))


def test_pdrop_refuses_ratios_that_grow_between_stages(tiny_mm):
    """``ratios`` are cumulative fractions of N: a later stage cannot keep more than an earlier one left (the
    release's topk fails there; clamping would keep fewer than asked and its budget / stats formulas count more)."""
    with pytest.raises(ConfigError, match="ratios"):
        Session(tiny_mm, _recipe("pyramiddrop", {**PD, "ratios": (0.25, 0.5, 0.125)}))
    Session(tiny_mm, _recipe("pyramiddrop", {**PD, "ratios": (0.5, 0.5, 0.125)})).close()


def test_pdrop_refuses_an_empty_stage_list(tiny_mm):
    """``layers: []`` is PyramidDrop without a stage: nothing would ever be dropped (a silent no-op)."""
    with pytest.raises(ConfigError, match="layers"):
        Session(tiny_mm, _recipe("pyramiddrop", {**PD, "layers": ()}))


def test_pdrop_decode_positions_continue_from_the_compacted_length(tiny_mm, images, prompts):
    with Session(tiny_mm, _recipe("pyramiddrop", {**PD, "ratio": 0.5})) as s:
        _, state, _ = _prefill(s, images[:1], prompts[:1])
        s.runner.step(state, torch.tensor([[5]]))
    for g in state.groups:
        n = int(g.key_mask[0].sum())
        assert g.positions[0, -1].item() == n - 1  # the new token sits right after the survivors


# -- SparseVLM -------------------------------------------------------------------------------------

SV = {"layers": (0, 1, 2)}  # filters at the output of layers 0, 1, 2 of the 4-layer tiny LLM


def _dpc_reference(x, c):
    """DPC-kNN written out token by token (ties: the earlier token counts as denser)."""
    n, dim = x.shape
    d = [[float((x[i] - x[j]).norm()) / dim**0.5 for j in range(n)] for i in range(n)]
    dens = [torch.tensor(sorted(row)[:c]).pow(2).mean().neg().exp().item() for row in d]
    dmax = max(max(row) for row in d)
    delta = []
    for i in range(n):
        higher = [d[i][j] for j in range(n) if dens[j] > dens[i] or (dens[j] == dens[i] and j < i)]
        delta.append(min(higher) if higher else dmax)
    score = torch.tensor([delta[i] * dens[i] for i in range(n)])
    centres = score.topk(c).indices.tolist()
    members = {k: [] for k in range(c)}
    for i in range(n):
        k = centres.index(i) if i in centres else min(range(c), key=lambda k: d[i][centres[k]])
        members[k].append(i)
    merged = torch.stack([x[members[k]].sum(0) / (len(members[k]) + 1e-6) for k in range(c)])
    return merged, centres


def test_dpc_knn_matches_token_by_token_reference():
    from mmfast.pruning._dpc_knn import dpc_knn_merge

    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(6, 5, generator=g) * 0.1 + off for off in (0.0, 3.0, -3.0)])  # three blobs
    merged, centres = dpc_knn_merge(x, 3)
    want_merged, want_centres = _dpc_reference(x, 3)
    assert centres.tolist() == want_centres
    assert sorted(c // 6 for c in want_centres) == [0, 1, 2]  # one centre per blob
    torch.testing.assert_close(merged, want_merged)


def test_dpc_knn_distances_in_row_blocks_equal_the_release_s_all_at_once(monkeypatch):
    """The release's [n, n, C] differences at once, against blocks of rows (bounded memory): equal values."""
    from mmfast.pruning import _dpc_knn as dpc

    g = torch.Generator().manual_seed(1)
    x = torch.randn(53, 96, generator=g)
    full = (x[:, None] - x[None]).norm(dim=-1)  # [n, n]
    for chunk in (1, 4 * 96 * 53 * 5, 4 * 96 * 53 * 53):  # 1 row, 5 rows, all rows per block
        assert torch.equal(dpc.pairwise_distance(x, chunk), full)
    want = dpc.dpc_knn_merge(x, 6)
    monkeypatch.setattr(dpc.pairwise_distance, "__defaults__", (4 * 96 * 53 * 2,))  # 2 rows per block
    got = dpc.dpc_knn_merge(x, 6)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _sparsevlm_reference(mm, inputs, filters, keeps, ratio, divisor):
    """SparseVLM v1.x on one unpadded single-image sample, eager attention, layer by layer."""
    h = inputs.embeds
    image = inputs.image_mask[0]
    v_idx = image.nonzero().squeeze(1)
    v_start, n_text = int(v_idx[0]), int(h.shape[1] - v_idx[-1] - 1)
    e = inputs.embeds[0]
    rel = (e[v_idx] @ e[-n_text:].T).softmax(1).mean(0)
    raters = (rel > rel.mean()).nonzero().squeeze(1)
    src = list(range(h.shape[1]))
    n_vis = int(image.sum())
    layouts = []
    with torch.no_grad():
        for layer_idx in range(len(mm.adapter.layers)):
            t = h.shape[1]
            pos = torch.arange(t)
            if layer_idx in filters:
                w = _layer_attention(mm, layer_idx, h, pos)  # [H, T, T]
            h = _run_layer(mm, layer_idx, h, pos)
            if layer_idx not in filters:
                continue
            rows = t - n_text + raters
            score = w.mean(0)[rows].mean(0)[v_start : v_start + n_vis]  # [n_vis] head mean, then rater mean
            k = min(keeps[filters.index(layer_idx)], n_vis)
            ranked = score.argsort(descending=True, stable=True)
            kept, deleted = ranked[:k].sort().values, ranked[k:]
            vis_h, vis_src = h[0, v_start : v_start + n_vis], src[v_start : v_start + n_vis]
            new_h, new_src = [vis_h[kept]], [vis_src[i] for i in kept.tolist()]
            if deleted.numel():
                top = min(deleted.numel(), int(deleted.numel() * ratio) + 1)
                merged, centres = _dpc_reference(vis_h[deleted[:top]], int(top / divisor) + 1)
                new_h.append(merged)
                new_src += [vis_src[int(deleted[:top][c])] for c in centres]
            h = torch.cat([h[:, :v_start], torch.cat(new_h)[None], h[:, v_start + n_vis :]], 1)
            src = src[:v_start] + new_src + src[v_start + n_vis :]
            n_vis = len(new_src)
            layouts.append(list(src))
        return layouts, _logits(mm, h)


@pytest.mark.parametrize(
    "params", [{"keep": (10, 6, 2)}, {"keep": (4, 3, 1), "recycle_ratio": 1.0, "cluster_divisor": 2}]
)
def test_sparsevlm_selects_and_recycles_as_the_paper(tiny_mm, eager, images, prompts, params):
    p = {**SV, **params}
    with Session(tiny_mm, _recipe("sparsevlm", p)) as s:
        inputs, state, out = _prefill(s, images[:3], prompts[:3])
        singles = [_single_inputs(s, im, pr) for im, pr in zip(images[:3], prompts[:3])]
        stats = state.stats["sparsevlm"]
    pad = (~inputs.attention_mask.bool()).sum(1)
    for b, one in enumerate(singles):
        want, want_logits = _sparsevlm_reference(
            eager, one, [0, 1, 2], list(p["keep"]), p.get("recycle_ratio", 0.3), p.get("cluster_divisor", 10)
        )
        got = [[i - int(pad[b]) for i in g] for g in _kept_sources(state, b)]
        assert got == want  # kept tokens in order, then the merged tokens (at their centres' provenance)
        torch.testing.assert_close(out.logits[b, 0], want_logits[0], atol=1e-4, rtol=1e-4)
        assert stats["per_sample_kept"][b] == [sum(one.image_mask[0, g].tolist()) for g in want]
    assert max(max(r) for r in stats["per_sample_recycled"]) >= (2 if "cluster_divisor" in params else 1)


def test_sparsevlm_raters_are_text_above_mean_relevance():
    """The raters of every sample at once equal the rule computed per sample (softmax over the sample's text of
    vision x text^T, mean over its vision tokens, above the mean; every text token when none is): left padding, texts
    of other lengths, one text token, a row without an image."""
    from mmfast.pruning._sparsevlm_ops import text_raters

    def rule(vision: torch.Tensor, text: torch.Tensor) -> list[int]:  # [n_v, d], [n_t, d]
        rel = (vision @ text.T).softmax(1).mean(0)  # [n_t]
        above = rel > rel.mean()
        return (above if above.any() else torch.ones_like(above)).nonzero().squeeze(1).tolist()

    v = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    t = torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 0.0]])  # relevance softmax([2, 0, 1]) per vision row
    emb = torch.cat([v, t])[None]
    vision, text = torch.tensor([[True, True, False, False, False]]), torch.tensor([[False, False, True, True, True]])
    assert text_raters(emb, vision, text).tolist() == [[0]] and rule(v, t) == [0]
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(4, 14, 8, generator=g)
    # (padding, vision, text) per row: the text is each row's tail
    layout = [(0, 6, 8), (3, 5, 6), (5, 8, 1), (2, 0, 12)]
    vision, text = torch.zeros(4, 14, dtype=torch.bool), torch.zeros(4, 14, dtype=torch.bool)
    for b, (pad, n_v, n_t) in enumerate(layout):
        vision[b, pad + 1 : pad + 1 + n_v] = True  # after one text token before the image
        text[b, 14 - n_t :] = True
    got = text_raters(emb, vision, text)
    wants = [rule(emb[b, vision[b]], emb[b, text[b]]) if n_v else [] for b, (_pad, n_v, _n_t) in enumerate(layout)]
    assert got.shape == (4, max(len(w) for w in wants))
    for b, want in enumerate(wants):
        assert got[b].tolist() == want + [-1] * (got.shape[1] - len(want)), b
    assert got[2].tolist()[:2] == [0, -1]  # one text token: it rates


def test_sparsevlm_noop_and_no_recycle(tiny_mm, images, prompts):
    with Session(tiny_mm, Recipe()) as base:
        _, _, want = _prefill(base, images[:2], prompts[:2])
    with Session(tiny_mm, _recipe("sparsevlm", {**SV, "keep": (16, 16, 16)})) as s:
        _, st, got = _prefill(s, images[:2], prompts[:2])
    assert len(st.groups) == 1 and torch.equal(got.logits, want.logits)
    with Session(tiny_mm, _recipe("sparsevlm", {**SV, "keep": (10, 6, 2), "recycle": False})) as s:
        _, st, _ = _prefill(s, images[:2], prompts[:2])
    assert [int(st.vision_slots(g).sum(1).max()) for g in range(1, 4)] == [10, 6, 2]


@pytest.mark.parametrize("tokens", [12, 8, 6])
def test_sparsevlm_budget_lands_within_5_percent(tiny_mm, images, prompts, tokens):
    from mmfast.pruning.sparsevlm import SparseVLM, simulate

    out = tiny_mm.generate(
        images[:2], prompts[:2], recipe=_recipe("sparsevlm", SV, {"tokens": tokens}), max_new_tokens=2
    )
    for r in out:
        assert abs(r.vision_tokens_layer_avg - tokens) <= 0.05 * tokens
    # the release's "192" on LLaVA-1.5: nominal 191, real (input counts) ~204 without and more with recycling
    counts, real = simulate(576, [300, 200, 110], [3, 7, 16], 32, None)
    assert counts == [576, 300, 200, 110] and real == pytest.approx((3 * 576 + 4 * 300 + 9 * 200 + 16 * 110) / 32)
    assert simulate(576, [300, 200, 110], [3, 7, 16], 32, (0.3, 10))[1] > real
    cfg = load_recipe({"pruning": [{"method": "sparsevlm", "params": SV}]}).pruning[0].params
    with pytest.raises(ConfigError, match="smallest feasible budget is 5"):
        SparseVLM.budget_params(4, 16, tiny_mm.adapter, cfg, "pruning[0].budget")


def test_sparsevlm_refuses_bad_layers(tiny_mm):
    with pytest.raises(ConfigError, match="layers"):
        Session(tiny_mm, _recipe("sparsevlm", {}))  # the paper's layers on a 4-layer LLM
    with pytest.raises(ConfigError, match="keep"):
        Session(tiny_mm, _recipe("sparsevlm", {**SV, "keep": (4, 2)}))


# -- LLaVA-NeXT: the packed span, row separators included, is what both rank ------------------------


@pytest.fixture(scope="module")
def next_mm(tmp_path_factory):
    from mmfast.models.factory import random_llava_next, save_model

    model, processor = random_llava_next("tiny")
    return mmfast.load(
        save_model(model, processor, tmp_path_factory.mktemp("next_staged")), device="cpu", dtype="float32"
    )


@pytest.mark.parametrize(
    "method, params", [("pyramiddrop", {**PD, "ratio": 0.5}), ("sparsevlm", {**SV, "keep": (40, 20, 10)})]
)
def test_llava_next_counts_the_whole_packed_span(next_mm, images, prompts, method, params):
    with Session(next_mm, _recipe(method, params)) as s:
        inputs, state, _ = _prefill(s, images[:2], prompts[:2])
        single = [_prefill(s, [im], [p]) for im, p in zip(images[:2], prompts[:2])]
    n = inputs.image_mask.sum(1)  # packed tokens per image, image_newline included
    mosaic = inputs.image_mask & (inputs.patch_ids < 0)
    assert bool(mosaic.any())  # beyond the base grid: the mosaic tokens and its row separators are vision slots
    first = state.vision_slots(1).sum(1)
    if method == "pyramiddrop":
        assert first.tolist() == [int(x * 0.5) for x in n.tolist()]
    else:
        assert state.stats["sparsevlm"]["per_sample_kept"][0][0] == int(first[0])
    for b, (_, st1, _) in enumerate(single):  # the batch decides each sample as alone
        assert [int(st1.vision_slots(g).sum()) for g in range(len(st1.groups))] == [
            int(state.vision_slots(g)[b].sum()) for g in range(len(state.groups))
        ]


def test_pdrop_grouped_query_attention_matches_eager(tiny_gqa_dir, images, prompts):
    """The recomputed attention row repeats the KV heads as the model does (4 heads, 2 KV heads)."""
    mm = mmfast.load(tiny_gqa_dir, device="cpu", dtype="float32")
    ref = mmfast.load(tiny_gqa_dir, device="cpu", dtype="float32", attn_implementation="eager")
    with Session(mm, _recipe("pyramiddrop", {**PD, "ratio": 0.5})) as s:
        inputs, state, _ = _prefill(s, images[:2], prompts[:2])
        singles = [_single_inputs(s, im, p) for im, p in zip(images[:2], prompts[:2])]
    pad = (~inputs.attention_mask.bool()).sum(1)
    for b, one in enumerate(singles):
        want, _ = _pdrop_reference(ref, one, [1, 2, 3], [0.5, 0.25, 0.125])
        assert [[i - int(pad[b]) for i in g] for g in _kept_sources(state, b)] == want


@pytest.mark.parametrize("method, params", [("pyramiddrop", PD), ("sparsevlm", SV)])
def test_flops_budget_runs_through_the_token_mapping(tiny_mm, images, prompts, method, params):
    from mmfast.flops import LMShape, tokens_for_flops_ratio

    tokens = tokens_for_flops_ratio(0.9, LMShape.of(tiny_mm.adapter.text_config), 16)
    assert tokens == 9  # the tiny model's prompt dominates its FLOPs
    out = tiny_mm.generate(images[:2], prompts[:2], recipe=_recipe(method, params, {"flops": 0.9}), max_new_tokens=2)
    for r in out:
        assert abs(r.vision_tokens_layer_avg - tokens) <= 0.05 * tokens


def test_pdrop_stats_do_not_report_the_default_lambda_under_a_per_image_budget(next_mm, images, prompts):
    """LLaVA-NeXT maps a budget's lambda per image count: the stats said ``ratios`` [0.5, 0.25, 0.125] (the
    unused default lambda) beside counts kept with another lambda; they say the ratios are per image."""
    out = next_mm.generate(images[:1], prompts[:1], recipe=_recipe("pyramiddrop", PD, {"tokens": 30}))[0]
    st = out.stats["pyramiddrop"]
    n = out.n_vision_tokens
    assert st["kept"] != [int(n * r) for r in (0.5, 0.25, 0.125)]  # not the default lambda's counts
    assert st["ratios"] == "per image"


def test_sparsevlm_stats_do_not_report_the_576_token_preset_on_images_of_their_own_counts(next_mm, images, prompts):
    """On LLaVA-NeXT a preset's counts scale by each image's N_i / 576: the stats said ``keep`` [300, 200, 110]
    (the preset for 576 tokens) beside an image that kept a few dozen; they say the counts are per image."""
    out = next_mm.generate(images[:1], prompts[:1], recipe=_recipe("sparsevlm", {**SV, "preset": "192"}))[0]
    st = out.stats["sparsevlm"]
    assert max(st["kept"]) <= out.n_vision_tokens < 300
    assert st["keep"] == "per image"
    given = next_mm.generate(images[:1], prompts[:1], recipe=_recipe("sparsevlm", {**SV, "keep": (20, 10, 5)}))[0]
    assert given.stats["sparsevlm"]["keep"] == [20, 10, 5]  # given counts are kept as they are
