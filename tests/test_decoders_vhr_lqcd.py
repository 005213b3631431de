"""VHR scales exactly the selected heads; LQCD contrasts against a leading rewording."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from mmfast.config import load_recipe
from mmfast.decoding.lqcd import leading_query
from mmfast.decoding.vhr import paper_layers, select_heads
from mmfast.pipeline import Session


def _tokens(mm, images, prompts, decoding, n=8):
    with Session(mm, load_recipe({"decoding": decoding})) as s:
        return [
            r.token_ids for r in s.generate(images, prompts, max_new_tokens=n, seed=0)
        ], s  # one stream for every call


def test_vhr_paper_layers():
    assert paper_layers(32) == [1] + list(range(18, 32))
    assert paper_layers(4) == [1, 2, 3]


def test_vhr_head_selection_rule():
    vhd = torch.tensor([[1.0, 2.0, 3.0, 10.0, 4.0, 0.5]])
    energy = torch.tensor([[1.0, 1.0, 1.0, 9.0, 1.0, 1.0]])  # head 3: VHD and energy outliers -> zeroed
    sel = select_heads(vhd, energy)
    # filtered = [1, 2, 3, 0, 4, 0.5], median (lower) = 1 -> heads above: 1, 2, 4
    assert sel.tolist() == [[False, True, True, False, True, False]]


def test_vhr_alpha_one_is_greedy(tiny_mm, images, prompts):
    base, _ = _tokens(tiny_mm, images[:2], prompts[:2], {"method": "greedy"})
    got, _ = _tokens(tiny_mm, images[:2], prompts[:2], {"method": "vhr", "params": {"alpha": 1.0}})
    assert got == base


def test_vhr_scales_exactly_the_selected_heads(tiny_mm, images, prompts):
    recipe = load_recipe({"decoding": {"method": "vhr", "params": {"alpha": 2.0, "layers": [1, 3]}}})
    h = tiny_mm.adapter.text_config.num_attention_heads
    with Session(tiny_mm, recipe) as s:
        out = s.generate(images[:2], prompts[:2], max_new_tokens=3)
        sel = torch.tensor([r.stats["vhr"]["selected_heads"]["3"] for r in out])  # [B, H] head set frozen at t = 0
        assert sel.shape == (2, h) and 0 < int(sel.sum()) < sel.numel()
        assert out[0].stats["vhr"]["reinforced_heads"]["3"] == int(sel[0].sum())
        # the frozen hook multiplies exactly the selected heads' slices of the o_proj input by alpha; it acts in the
        # running state's apply phase (here a stand-in) and reads the scales the last prefill filled in from its heads
        from mmfast.decoding.vhr import _Heads

        state = SimpleNamespace(extras={"vhr": _Heads("apply", 2, {3: sel})}, groups=[])
        x = torch.randn(2, 5, tiny_mm.adapter.text_config.hidden_size)
        with s.runner._activate(state, "decode"):
            (y,) = s.decoder._scale_hook(3)(None, (x,))
        assert s.decoder._scale_hook(3)(None, (x,)) is None  # no running state: VHR leaves other forwards alone
    xv, yv = x.view(2, 5, h, -1), y.view(2, 5, h, -1)
    for b in range(2):
        for head in range(h):
            want = 2.0 * xv[b, :, head] if sel[b, head] else xv[b, :, head]
            torch.testing.assert_close(yv[b, :, head], want)


def test_vhr_batch_equals_single(tiny_mm, images, prompts):
    dec = {"method": "vhr", "params": {"alpha": 3.0}}
    batched, _ = _tokens(tiny_mm, images[:3], prompts[:3], dec)
    single = [_tokens(tiny_mm, [im], [p], dec)[0][0] for im, p in zip(images[:3], prompts[:3])]
    assert batched == single


def test_lqcd_leading_templates():
    import random

    q = "Is there a dog in the image?\nAnswer the question using a single word or phrase."
    lead = leading_query(q, random.Random(0), ("{q} Surely yes.",), ("{q} Mention all.",))
    assert lead == "Is there a dog in the image? Surely yes.\nAnswer the question using a single word or phrase."
    assert (
        leading_query("Describe it.", random.Random(0), ("{q} yes",), ("{q} Mention all.",))
        == "Describe it. Mention all."
    )


def test_lqcd_noop_and_active(tiny_mm, images, prompts):
    base, _ = _tokens(tiny_mm, images[:2], prompts[:2], {"method": "greedy"})
    got, _ = _tokens(
        tiny_mm, images[:2], prompts[:2], {"method": "lqcd", "params": {"alpha": 0.0, "beta": 0.0, "sample": False}}
    )
    assert got == base
    recipe = load_recipe({"decoding": {"method": "lqcd", "params": {"alpha": 3.0, "beta": 0.0, "sample": False}}})
    with Session(tiny_mm, recipe) as s:
        res = s.generate(images[:2], prompts[:2], max_new_tokens=8)
    assert [r.token_ids for r in res] != base
    leads = [r.stats["leading_query"] for r in res]
    assert all(lead != p and lead.startswith(p) for lead, p in zip(leads, prompts[:2]))


def test_vhr_reinforces_a_repeated_layer_once(tiny_mm, images, prompts):
    """``layers`` is the set L_r of Alg. 1: a layer named twice is reinforced once (its heads chosen and scaled by
    alpha once), not chosen again on its already scaled outputs and scaled twice (ClearSight's ``layers`` likewise)."""
    once, _ = _tokens(tiny_mm, images[:3], prompts[:3], {"method": "vhr", "params": {"alpha": 3.0, "layers": [1, 2]}})
    twice, _ = _tokens(
        tiny_mm, images[:3], prompts[:3], {"method": "vhr", "params": {"alpha": 3.0, "layers": [2, 1, 2]}}
    )
    assert twice == once


def test_vhr_decode_without_cache_applies_the_frozen_heads(tiny_mm, images, prompts):
    """Under a stage that decodes without a KV cache (Dynamic-LLaVA ``use_cache: false``: every step recomputes the
    image stream alone), VHR applies the heads frozen at the joint prefill: the same tokens as the cached decode, not
    a new head choice on a batch without its text-only stream (which crashed)."""
    outs = {}
    for use_cache in (True, False):
        stage = {"method": "dynamic_llava", "params": {"predictors": "random", "use_cache": use_cache}}
        recipe = load_recipe({"pruning": [stage], "decoding": {"method": "vhr", "params": {"alpha": 3.0}}})
        with Session(tiny_mm, recipe) as s:
            outs[use_cache] = [r.token_ids for r in s.generate(images[:2], prompts[:2], max_new_tokens=8)]
    assert outs[False] == outs[True]


def test_lqcd_leading_branch_longer_than_the_context_is_refused(tiny_mm, images, prompts, monkeypatch):
    """The leading rewording is longer than the user's prompt: when the clean prompt just fits the LLM's context, the
    leading branch does not, and decoding it past the context (positions the model never saw) is refused by name."""
    import re

    import pytest

    from mmfast.errors import InputError

    clean_total = 1
    for _ in range(2):  # the text alone is checked before the tower, text + vision tokens after it
        monkeypatch.setattr(tiny_mm.adapter.text_config, "max_position_embeddings", clean_total)
        with pytest.raises(InputError) as err:
            _tokens(tiny_mm, images[:1], prompts[1:2], {"method": "greedy"}, n=4)
        clean_total = int(re.search(r"new tokens = (\d+)", str(err.value)).group(1))
    assert "16 vision tokens" in str(err.value)
    monkeypatch.setattr(tiny_mm.adapter.text_config, "max_position_embeddings", clean_total)
    _tokens(tiny_mm, images[:1], prompts[1:2], {"method": "greedy"}, n=4)  # the clean prompt fits exactly
    lqcd = {"method": "lqcd", "params": {"alpha": 1.0, "sample": False}}
    with pytest.raises(InputError, match=r"the leading branch of sample 0: \d+ tokens \+ 4 new tokens = \d+, \d+ over"):
        _tokens(tiny_mm, images[:1], prompts[1:2], lqcd, n=4)
