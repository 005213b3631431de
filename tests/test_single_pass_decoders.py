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
        out = s.generate(images, prompts, max_new_tokens=n)
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


def test_attention_overriders_refused_together():
    with pytest.raises(IncompatibleRecipeError, match="zipvl.*pai|pai.*zipvl"):
        load_recipe({"pruning": [{"method": "zipvl"}], "decoding": {"method": "pai"}})
    # the no-op setting overrides nothing and stacks
    load_recipe({"pruning": [{"method": "zipvl"}], "decoding": {"method": "pai", "params": {"alpha": 0.0}}})
