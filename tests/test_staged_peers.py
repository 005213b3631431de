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
    _, w = layer.self_attn(hidden_states=layer.input_layernorm(h), position_embeddings=cos_sin,
                           attention_mask=_causal(h.shape[1]))
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

    out = tiny_mm.generate(images[:2], prompts[:2], recipe=_recipe("pyramiddrop", PD, {"tokens": tokens}), max_new_tokens=2)
    for r in out:
        assert abs(r.vision_tokens_layer_avg - tokens) <= 0.05 * tokens
    cfg = _recipe("pyramiddrop", PD).pruning[0].params
    lam = PyramidDrop.budget_params(tokens, tiny_mm.adapter, cfg, "b")["ratio"]
    assert out[0].vision_tokens_layer_avg == pytest.approx(layer_average(16, [1, 2, 3], [lam, lam**2, lam**3], 4))
    # the paper's shape: lambda for 192 / 128 / 64 on LLaVA-1.5 (N = 576, 32 layers)
    assert abs(layer_average(576, [8, 16, 24], [0.5, 0.25, 0.125], 32) - 270) < 1e-9
    with pytest.raises(ConfigError, match="smallest feasible budget is 4"):
        PyramidDrop.budget_params(3, tiny_mm.adapter, cfg, "pruning[0].budget")


def test_pdrop_refuses_bad_schedules(tiny_mm):
    with pytest.raises(ConfigError, match="ratios"):
        Session(tiny_mm, _recipe("pyramiddrop", {**PD, "ratios": (0.5, 0.25)}))
    with pytest.raises(ConfigError, match="layers"):
        Session(tiny_mm, _recipe("pyramiddrop", {"layers": (8, 16, 24)}))  # absolute: no layer 8 here
    with pytest.raises(ConfigError, match="distinct"):
        Session(tiny_mm, _recipe("pyramiddrop", {**PD, "layers": (8, 9, 24)}))


def test_pdrop_decode_positions_continue_from_the_compacted_length(tiny_mm, images, prompts):
    with Session(tiny_mm, _recipe("pyramiddrop", {**PD, "ratio": 0.5})) as s:
        _, state, _ = _prefill(s, images[:1], prompts[:1])
        s.runner.step(state, torch.tensor([[5]]))
    for g in state.groups:
        n = int(g.key_mask[0].sum())
        assert g.positions[0, -1].item() == n - 1  # the new token sits right after the survivors
