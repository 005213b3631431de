"""Every registered pruning method: no-op setting == baseline exactly, batch > 1 == batch 1,
session restore; plus the layer-group mechanics they all rely on."""

from __future__ import annotations

import pytest
import torch

from mmfast.capabilities import caps_of
from mmfast.config import Recipe, load_recipe
from mmfast.hooks import count_hooks
from mmfast.pipeline import Session
from mmfast.registry import PRUNERS


def _prefill_logits(session, images, prompts):
    batch = session.mm.prepare(images, prompts)
    inputs = session.build_inputs(batch, session.encode(batch))
    _, out = session.runner.prefill(inputs)
    return out.logits


def _method_recipe(name: str, params: dict) -> Recipe:
    return load_recipe({"pruning": [{"method": name, "params": params}]})


@pytest.mark.parametrize("name", PRUNERS.names())
def test_noop_setting_reproduces_baseline(name, tiny_mm, images, prompts):
    cls = PRUNERS.get(name).cls
    if caps_of(cls, None).videos_only:
        pytest.skip(f"needs a video input: its no-op, batch and static-cache checks are in tests/test_{name}.py")
    with Session(tiny_mm, Recipe()) as base:
        want = _prefill_logits(base, images[:2], prompts[:2])
        want_gen = base.generate(images[:2], prompts[:2], max_new_tokens=6)
    with Session(tiny_mm, _method_recipe(name, cls.noop_params(tiny_mm.adapter))) as s:
        got = _prefill_logits(s, images[:2], prompts[:2])
        got_gen = s.generate(images[:2], prompts[:2], max_new_tokens=6)
    assert torch.equal(got, want)
    assert [r.token_ids for r in got_gen] == [r.token_ids for r in want_gen]


@pytest.mark.parametrize("name", PRUNERS.names())
def test_batch_equals_single_and_restores(name, tiny_mm, images, prompts):
    """Every stage decides per image: a batch of 4 gives each sample exactly its batch-1 output."""
    cls = PRUNERS.get(name).cls
    if caps_of(cls, None).videos_only:
        pytest.skip(f"needs a video input: its no-op, batch and static-cache checks are in tests/test_{name}.py")
    before = count_hooks(tiny_mm.model)
    recipe = _method_recipe(name, cls.test_params(tiny_mm.adapter))
    with Session(tiny_mm, recipe) as s:
        batched = s.generate(images[:4], prompts[:4], max_new_tokens=6)
        single = [s.generate([im], [p], max_new_tokens=6)[0] for im, p in zip(images[:4], prompts[:4])]
    assert [r.token_ids for r in batched] == [r.token_ids for r in single]
    assert [r.n_vision_tokens for r in batched] == [r.n_vision_tokens for r in single]
    assert [r.vision_tokens_layer_avg for r in batched] == pytest.approx([r.vision_tokens_layer_avg for r in single])
    assert all(r.vision_tokens_layer_avg < r.n_vision_tokens or r.n_vision_tokens < 16 for r in batched)
    assert count_hooks(tiny_mm.model) == before


def test_forced_group_matches_baseline(tiny_mm, images, prompts):
    """A layer group that keeps every slot computes what the unhooked model computes (mask, RoPE)."""
    with Session(tiny_mm, Recipe()) as base:
        want = _prefill_logits(base, images[:3], prompts[:3])
        gen_want = base.generate(images[:3], prompts[:3], max_new_tokens=6)
    with Session(tiny_mm, Recipe()) as s:
        s.runner.skip_noop_groups = False
        s.runner.prune_at(2, lambda view: torch.ones_like(view.vision))
        got = _prefill_logits(s, images[:3], prompts[:3])
        gen = s.generate(images[:3], prompts[:3], max_new_tokens=6)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert [r.token_ids for r in gen] == [r.token_ids for r in gen_want]
