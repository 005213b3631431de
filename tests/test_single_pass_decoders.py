"""Single-pass anti-hallucination peers (PAI, ONLY, ClearSight): no-op settings are greedy exactly, the
attention / logit edits match a direct eager computation of each paper's rule, batch == per sample."""

from __future__ import annotations

import math

import pytest
import torch

from mmfast import compat
from mmfast.config import load_recipe
from mmfast.errors import IncompatibleRecipeError
from mmfast.pipeline import Session


def _tokens(mm, images, prompts, decoding, n=6, pruning=None):
    data = {"decoding": decoding}
    if pruning:
        data["pruning"] = pruning
    with Session(mm, load_recipe(data)) as s:
        out = s.generate(images, prompts, max_new_tokens=n, seed=0)  # sampling decoders: one stream for every call
        return [r.token_ids for r in out], out


def _state(s, mm, images, prompts):
    """A real prefill state of ``images``/``prompts`` in session ``s`` (its layout: slots and vision mask)."""
    batch = mm.prepare(images, prompts)
    inputs = s.ctx.build_inputs(batch, s.encode(batch))
    state, _ = s.runner.prefill(inputs)
    return state


def _qkv(mm, bsz, q_len, k_len, seed=0):
    cfg = mm.adapter.text_config
    g = torch.Generator().manual_seed(seed)
    h, d = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
    q = torch.randn(bsz, h, q_len, d, generator=g)
    k = torch.randn(bsz, h, k_len, d, generator=g)
    v = torch.randn(bsz, h, k_len, d, generator=g)
    return q, k, v, d**-0.5


def _causal_mask(valid: torch.Tensor, q_len: int) -> torch.Tensor:
    """[B, 1, Q, K] bool: the last q_len slots see valid earlier slots (and themselves)."""
    k_len = valid.shape[1]
    rows = torch.arange(k_len - q_len, k_len)[:, None]
    causal = torch.arange(k_len)[None, :] <= rows  # [Q, K]
    return (causal[None] & valid[:, None, :])[:, None]


# -- PAI --------------------------------------------------------------------------------------------
def test_pai_noop_is_greedy(tiny_mm, images, prompts):
    base, _ = _tokens(tiny_mm, images[:3], prompts[:3], {"method": "greedy"})
    got, out = _tokens(tiny_mm, images[:3], prompts[:3], {"method": "pai", "params": {"alpha": 0.0, "gamma": 1.0}})
    assert got == base
    assert out[0].stats["forwards_per_step"] == 1


def test_pai_amplifies_the_last_row_on_image_keys(tiny_mm, images, prompts):
    """The override equals eager attention with w + alpha|w| on the last row's image keys (pre-softmax)."""
    alpha = 0.7
    recipe = load_recipe({"decoding": {"method": "pai", "params": {"alpha": alpha, "gamma": 1.0}}})
    with Session(tiny_mm, recipe) as s:
        state = _state(s, tiny_mm, images[:2], prompts[:2])
        valid, image = state.groups[0].key_mask, state.inputs.image_mask  # [B, T]
        bsz, t = valid.shape
        for q_len in (t, 1):  # prefill (every row) and a decode-like call (one new row)
            q, k, v, scale = _qkv(tiny_mm, bsz, q_len, t)
            mask = _causal_mask(valid, q_len)
            module = tiny_mm.adapter.layers[2].self_attn
            with s.runner._activate(state, "decode"):
                got = s.decoder._override(2)(module, q, k, v, mask, scale, compat.eager_attention)
            # the paper's rule, computed directly (eager, the official code's order: scale, mask, edit, softmax)
            w = q @ k.transpose(-1, -2) * scale
            w = w.masked_fill(~mask, torch.finfo(w.dtype).min)
            last = w[:, :, -1, :]
            img = image[:, None, :].expand_as(last)
            w[:, :, -1, :] = torch.where(img, last + alpha * last.abs(), last)
            want = (torch.softmax(w, -1) @ v).transpose(1, 2)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            plain, _ = compat.eager_attention(module, q, k, v, mask, scale)
            assert not torch.allclose(got[:, -1], plain[:, -1])  # the edit is real
            torch.testing.assert_close(got[:, :-1], plain[:, :-1])  # earlier rows untouched


def test_pai_layers_keep_the_absolute_start_on_a_shallow_llm(tiny_mm, images, prompts):
    """start_layer is absolute (the release's range(2, 32): every layer but the first two) and the end
    is the LLM's depth: the 4-layer tiny LLM amplifies layers 2..3, not a proportional 0..3."""
    assert len(tiny_mm.adapter.layers) == 4
    for params, want in (({}, [2, 3]), ({"start_layer": 1, "end_layer": 3}, [1, 2])):
        recipe = load_recipe({"decoding": {"method": "pai", "params": {"gamma": 1.0, **params}}})
        with Session(tiny_mm, recipe) as s:
            out = s.generate(images[:1], prompts[:1], max_new_tokens=1)
        assert out[0].stats["amplified_layers"] == want


@pytest.mark.parametrize(
    "params, key",
    [
        ({"end_layer": 40}, "end_layer"),
        ({"start_layer": 3, "end_layer": 2}, "end_layer"),
        ({"start_layer": 7}, "start_layer"),
    ],
)
def test_pai_layer_range_refusal_names_the_key_at_fault(tiny_mm, params, key):
    """An end_layer past the LLM's depth (or not after start_layer) is refused at decoding.params.end_layer, naming
    the value given, not at start_layer with end - 1 (a 4-layer LLM: layers 0..3)."""
    from mmfast.capabilities import ModelFacts, check_model
    from mmfast.errors import ConfigError

    recipe = load_recipe({"decoding": {"method": "pai", "params": params}})
    with pytest.raises(ConfigError) as exc:
        check_model(recipe, ModelFacts.of_adapter(tiny_mm.adapter))
    assert exc.value.path == f"decoding.params.{key}" and str(params[key]) in exc.value.detail


def test_pai_cfg_step_matches_official_formula(tiny_mm, images, prompts):
    """With alpha = 0 the first token is argmax of gamma(s - u) + u masked by s >= log(0.1) + max s,
    with s / u the log-softmax of the image prompt / the image-free prompt (computed here directly)."""
    gamma = 1.7
    recipe = load_recipe({"decoding": {"method": "pai", "params": {"alpha": 0.0, "gamma": gamma}}})
    with Session(tiny_mm, recipe) as s:
        batch = tiny_mm.prepare(images[:2], prompts[:2])
        clean = s.runner.prefill(s.ctx.build_inputs(batch, s.encode(batch)))[1].logits[:, -1]
        uncond = s.runner.prefill(s.ctx.text_only_inputs(batch))[1].logits[:, -1]
        first = [r.token_ids[0] for r in s.generate(images[:2], prompts[:2], max_new_tokens=1)]
    sl, ul = torch.log_softmax(clean, -1), torch.log_softmax(uncond, -1)
    fused = gamma * (sl - ul) + ul
    fused = fused.masked_fill(sl < math.log(0.1) + sl.max(-1, keepdim=True).values, float("-inf"))
    assert first == fused.argmax(-1).tolist()


def test_pai_batch_equals_single(tiny_mm, images, prompts):
    dec = {"method": "pai", "params": {"alpha": 1.0, "gamma": 1.5}}
    batched, _ = _tokens(tiny_mm, images[:3], prompts[:3], dec)
    single = [_tokens(tiny_mm, [im], [p], dec)[0][0] for im, p in zip(images[:3], prompts[:3])]
    assert batched == single
    base, _ = _tokens(tiny_mm, images[:3], prompts[:3], {"method": "greedy"})
    assert batched != base


@pytest.mark.parametrize("first", [True, False])
def test_pai_decode_without_cache_amplifies_what_the_cached_decode_does(first, tiny_mm, images, prompts):
    """Under a stage that decodes without a KV cache (Dynamic-LLaVA ``use_cache: false``: every step recomputes the
    sequence) PAI amplifies the rows the cached decode amplified: every generated token's, and the prompt's last row
    when the first token is amplified (``amplify_first_token``); false: the generated rows still (the official CFG
    quirk skips the first token only). Same tokens as the cached decode."""
    outs = {}
    for use_cache in (True, False):
        stage = {"method": "dynamic_llava", "params": {"predictors": "random", "use_cache": use_cache}}
        dec = {"method": "pai", "params": {"alpha": 2.0, "gamma": 1.0, "amplify_first_token": first}}
        outs[use_cache], _ = _tokens(tiny_mm, images[:2], prompts[:2], dec, n=10, pruning=[stage])
    assert outs[False] == outs[True]


def test_attention_overriders_refused_together():
    with pytest.raises(IncompatibleRecipeError, match="zipvl.*pai|pai.*zipvl"):
        load_recipe({"pruning": [{"method": "zipvl"}], "decoding": {"method": "pai"}})
    # the no-op setting overrides nothing and stacks
    load_recipe({"pruning": [{"method": "zipvl"}], "decoding": {"method": "pai", "params": {"alpha": 0.0}}})


# -- ONLY -------------------------------------------------------------------------------------------
def test_only_noop_is_greedy(tiny_mm, images, prompts):
    base, _ = _tokens(tiny_mm, images[:3], prompts[:3], {"method": "greedy"})
    noop = {"alpha_pos": 0.0, "alpha_neg": 0.0, "beta": 0.0, "sample": False}
    got, _ = _tokens(tiny_mm, images[:3], prompts[:3], {"method": "only", "params": noop})
    assert got == base


def _only_rule(p: torch.Tensor, text: list[int], img: list[int]) -> torch.Tensor:
    """The official rule on one sample's last-row probabilities p [H, K], written with index lists."""
    p = p.clone()
    for cols in (text, img):
        x = p[:, cols]
        p[:, cols] = torch.where(x > x.mean(-1, keepdim=True) + x.std(-1, keepdim=True), torch.zeros_like(x), x)

    def ent(cols, nan):
        q = p[:, cols] / p[:, cols].sum(-1, keepdim=True)
        return torch.nan_to_num(-(q * torch.log(q + 1e-6)).sum(-1), nan=nan)

    ratio = ent(text, 0.0) / ent(img, float("inf"))
    p[ratio < ratio.mean()] = 0.0
    return p


def test_only_perturbed_logits_match_direct_computation(tiny_mm, images, prompts):
    """l' = lm_head(norm(h) + 0.5 x_final), h = last layer's MLP block on input_layernorm(a) + 0.2 x_last,
    a = o_proj(P' V) at layer 0 with P' the official outlier / entropy-ratio rule -- all computed here
    from the model's weights with eager attention; then the first token is argmax of the official fusion."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    params = {"sample": False, "gamma": 0.2}
    ad = tiny_mm.adapter
    lm, cfg = ad.language_model, ad.text_config
    with Session(tiny_mm, load_recipe({"decoding": {"method": "only", "params": params}})) as s:
        batch = tiny_mm.prepare(images[:2], prompts[:2])
        inputs = s.ctx.build_inputs(batch, s.encode(batch))
        state, step = s.runner.prefill(inputs)
        got = s.decoder.perturbed_logits(state.extras["only"])
        first = [r.token_ids[0] for r in s.generate(images[:2], prompts[:2], max_new_tokens=1)]
    with torch.no_grad():
        out = lm(
            inputs_embeds=inputs.embeds,
            attention_mask=inputs.attention_mask,
            position_ids=inputs.position_ids,
            output_hidden_states=True,
        )
        x_last = out.hidden_states[cfg.num_hidden_layers - 1][:, -1]  # input of the last layer
        x_final = out.last_hidden_state[:, -1]
        layer0 = ad.layers[0].self_attn
        h0 = ad.layers[0].input_layernorm(inputs.embeds)
        bsz, t, _ = h0.shape
        nh, hd = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
        q = layer0.q_proj(h0).view(bsz, t, nh, hd).transpose(1, 2)
        k = layer0.k_proj(h0).view(bsz, t, -1, hd).transpose(1, 2)
        v = layer0.v_proj(h0).view(bsz, t, -1, hd).transpose(1, 2)
        cos, sin = lm.rotary_emb(h0, inputs.position_ids)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        a_rows = []
        for b in range(bsz):
            valid = inputs.attention_mask[b].bool()
            idx = valid.nonzero().squeeze(1)
            scores = torch.einsum("hd,htd->ht", q[b, :, -1], k[b]) * hd**-0.5  # [H, T]
            scores = scores.masked_fill(~valid, float("-inf"))
            p = torch.softmax(scores, -1)
            img = [int(i) for i in idx if inputs.image_mask[b, i]]
            text = [int(i) for i in idx[1:] if not inputs.image_mask[b, i]]  # BOS (first real token) excluded
            p = _only_rule(p, text, img)
            a_rows.append(layer0.o_proj(torch.einsum("ht,htd->hd", p, v[b]).reshape(-1)))
        a = torch.stack(a_rows)
        last = ad.layers[-1]
        h = last.input_layernorm(a) + 0.2 * x_last
        h = h + last.mlp(last.post_attention_layernorm(h))
        want = ad.lm_head(lm.norm(h) + 0.5 * x_final)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    l = step.logits[:, -1]
    tvd = (torch.softmax(l, -1) - torch.softmax(want, -1)).abs().sum(-1)
    fused = torch.stack([l[b] + 3.0 * want[b] if tvd[b] < 0.2 else 2.0 * l[b] - want[b] for b in range(bsz)])
    fused = fused.masked_fill(l < math.log(0.1) + l.max(-1, keepdim=True).values, float("-inf"))
    assert first == fused.argmax(-1).tolist()


def test_only_batch_equals_single(tiny_mm, images, prompts):
    dec = {"method": "only", "params": {"gamma": 1.5}}  # sampling (official), per-sample generators
    batched, out = _tokens(tiny_mm, images[:3], prompts[:3], dec)
    single = [_tokens(tiny_mm, [im], [p], dec)[0][0] for im, p in zip(images[:3], prompts[:3])]
    assert batched == single
    assert "only" in out[0].stats and out[0].stats["intervention_layer"] == 0


# -- ClearSight (VAF) -------------------------------------------------------------------------------
def test_clearsight_paper_layers():
    from mmfast.decoding.clearsight import paper_layers

    assert paper_layers(32) == list(range(9, 15))
    assert paper_layers(4) == [1, 2]


def test_clearsight_noop_is_greedy(tiny_mm, images, prompts):
    base, _ = _tokens(tiny_mm, images[:3], prompts[:3], {"method": "greedy"})
    got, _ = _tokens(
        tiny_mm, images[:3], prompts[:3], {"method": "clearsight", "params": {"enhance": 1.0, "suppress": 1.0}}
    )
    assert got == base


def test_clearsight_scales_logits_of_rows_after_the_image(tiny_mm, images, prompts):
    """The override equals eager attention where every row after the image has its pre-mask logits
    multiplied by enhance on image keys and by suppress on the keys before the image."""
    enh, sup = 1.6, 0.7
    recipe = load_recipe(
        {"decoding": {"method": "clearsight", "params": {"enhance": enh, "suppress": sup, "layers": [1]}}}
    )
    with Session(tiny_mm, recipe) as s:
        state = _state(s, tiny_mm, images[:2], prompts[:2])
        valid, image = state.groups[0].key_mask, state.inputs.image_mask  # [B, T]
        bsz, t = valid.shape
        pos = torch.arange(t).expand(bsz, -1)
        first_img = torch.where(image, pos, t).min(1, keepdim=True).values
        last_img = torch.where(image, pos, -1).max(1, keepdim=True).values
        system = valid & (pos < first_img)  # BOS + system prompt
        after = valid & (pos > last_img)  # instruction + assistant prompt
        module = tiny_mm.adapter.layers[1].self_attn
        for q_len in (t, 1):
            q, k, v, scale = _qkv(tiny_mm, bsz, q_len, t, seed=1)
            mask = _causal_mask(valid, q_len)
            with s.runner._activate(state, "decode"):
                got = s.decoder._override(1)(module, q, k, v, mask, scale, compat.eager_attention)
            w = q @ k.transpose(-1, -2) * scale  # [B, H, Q, T]
            for b in range(bsz):
                for r in range(q_len):
                    if after[b, t - q_len + r]:
                        w[b, :, r, image[b]] *= enh
                        w[b, :, r, system[b]] *= sup
            w = w.masked_fill(~mask, torch.finfo(w.dtype).min)
            want = (torch.softmax(w, -1) @ v).transpose(1, 2)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            plain, _ = compat.eager_attention(module, q, k, v, mask, scale)
            assert not torch.allclose(got, plain)


def test_clearsight_batch_equals_single(tiny_mm, images, prompts):
    dec = {"method": "clearsight", "params": {"enhance": 2.0, "suppress": 0.5}}
    batched, _ = _tokens(tiny_mm, images[:3], prompts[:3], dec)
    single = [_tokens(tiny_mm, [im], [p], dec)[0][0] for im, p in zip(images[:3], prompts[:3])]
    assert batched == single
    base, _ = _tokens(tiny_mm, images[:3], prompts[:3], {"method": "greedy"})
    assert batched != base


@pytest.mark.parametrize("compile", ["off", "static"])
@pytest.mark.parametrize(
    "decoder", [{"method": "pai", "params": {"alpha": 2.0, "gamma": 1.0}}, {"method": "clearsight"}]
)
def test_attention_editors_step_aside_for_a_per_call_decoder(decoder, compile, tiny_mm, images, prompts):
    """``generate(decoding=...)`` replaces the recipe's decoder for the call: PAI's and ClearSight's attention edits
    (hooks installed for the session) do not act on that call's forwards, and act again on the next own call."""
    ims, ps = images[:2], prompts[:2]
    plain = {"model": {"compile": compile}}
    with Session(tiny_mm, load_recipe(plain)) as s:
        greedy = [r.token_ids for r in s.generate(ims, ps, max_new_tokens=6)]
        beam = [r.token_ids for r in s.generate(ims, ps, max_new_tokens=6, decoding="beam")]
    with Session(tiny_mm, load_recipe({**plain, "decoding": decoder})) as s:
        own = [r.token_ids for r in s.generate(ims, ps, max_new_tokens=6)]
        assert [r.token_ids for r in s.generate(ims, ps, max_new_tokens=6, decoding="greedy")] == greedy
        assert [r.token_ids for r in s.generate(ims, ps, max_new_tokens=6, decoding="beam")] == beam
        assert [r.token_ids for r in s.generate(ims, ps, max_new_tokens=6)] == own != greedy


# -- with pruning stages ----------------------------------------------------------------------------
@pytest.mark.parametrize("decoder", ["pai", "only", "clearsight"])
def test_peers_run_on_a_pruned_layout(decoder, tiny_mm, images, prompts):
    """FastV drops vision slots inside the LLM (new layer groups): the key classes follow the layout."""
    from mmfast.registry import PRUNERS

    stage = {"method": "fastv", "params": PRUNERS.get("fastv").cls.test_params(tiny_mm.adapter)}
    dec = {"method": decoder}
    batched, _ = _tokens(tiny_mm, images[:2], prompts[:2], dec, pruning=[stage])
    single = [_tokens(tiny_mm, [im], [p], dec, pruning=[stage])[0][0] for im, p in zip(images[:2], prompts[:2])]
    assert batched == single


@pytest.mark.parametrize("decoder", ["pai", "only", "clearsight"])
def test_peers_restore_the_model(decoder, tiny_mm, images, prompts):
    from mmfast.hooks.session import count_hooks

    model = tiny_mm.model
    impl, hooks = compat.get_attn_implementation(model), count_hooks(model)
    batch = tiny_mm.prepare(images[:1], prompts[:1])
    inputs = tiny_mm.processor(images=batch.images[0], text=batch.texts[0], return_tensors="pt")
    with torch.no_grad():
        before = model(**inputs).logits
    with Session(tiny_mm, load_recipe({"decoding": {"method": decoder}})) as s:
        s.generate(images[:2], prompts[:2], max_new_tokens=2)
    assert compat.get_attn_implementation(model) == impl and count_hooks(model) == hooks
    assert all("_mmfast_attn" not in layer.self_attn.__dict__ for layer in tiny_mm.adapter.layers)
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, before)


@pytest.mark.parametrize("decoder", ["pai", "only", "clearsight"])
def test_peers_with_grouped_query_attention(decoder, tiny_gqa_dir, images, prompts):
    import mmfast

    mm = mmfast.load(tiny_gqa_dir, device="cpu", dtype="float32")
    dec = {"method": decoder, "params": {"sample": False}}
    batched, _ = _tokens(mm, images[:2], prompts[:2], dec)
    single = [_tokens(mm, [im], [p], dec)[0][0] for im, p in zip(images[:2], prompts[:2])]
    assert batched == single
