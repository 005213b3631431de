"""Hook sessions restore the model exactly: same logits, no hooks left, same attention implementation."""

from __future__ import annotations

import torch

from mmfast import compat
from mmfast.config import Recipe
from mmfast.hooks import HookSession, count_hooks, last_row
from mmfast.pipeline import Session


def _logits(mm, images, prompts):
    batch = mm.prepare(images, prompts)
    inputs = mm.processor(images=batch.images[0], text=batch.texts[0], return_tensors="pt")
    with torch.no_grad():
        return mm.model(**inputs).logits


def test_session_restores_model(tiny_mm, images, prompts):
    model = tiny_mm.model
    before_logits = _logits(tiny_mm, images[:1], prompts[:1])
    before_impl = compat.get_attn_implementation(model)
    before_hooks = count_hooks(model)
    session = Session(tiny_mm, Recipe())
    probe = session.probe
    probe.watch("llm.1", tiny_mm.adapter.layers[1].self_attn, rows=last_row)
    probe.watch("vis.1", tiny_mm.adapter.vision_layers[1].self_attn, rows=lambda q, k: torch.tensor([0]))
    session.runner.prune_at(2, lambda view: view.vision & (torch.rand_like(view.vision.float()) > 0.5))
    session.hooks.forward_hook(tiny_mm.adapter.lm_head, lambda m, a, o: o * 2)
    assert count_hooks(model) > before_hooks
    assert compat.get_attn_implementation(model) != before_impl
    out = session.generate(images[:2], prompts[:2], max_new_tokens=4)
    assert probe.get("llm.1") is not None and probe.get("vis.1") is not None
    assert out[0].vision_tokens_layer_avg < out[0].n_vision_tokens
    session.close()
    assert count_hooks(model) == before_hooks
    assert compat.get_attn_implementation(model) == before_impl
    for layer in tiny_mm.adapter.layers:
        assert "_mmfast_attn" not in layer.self_attn.__dict__
    assert torch.equal(_logits(tiny_mm, images[:1], prompts[:1]), before_logits)


def test_session_closes_on_error(tiny_mm):
    before = count_hooks(tiny_mm.model)
    try:
        with HookSession(tiny_mm.model) as hs:
            hs.forward_hook(tiny_mm.adapter.lm_head, lambda m, a, o: o)
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert count_hooks(tiny_mm.model) == before


def test_set_attr_restores_absence_and_value(tiny_mm):
    mod = tiny_mm.adapter.layers[0]
    with HookSession(tiny_mm.model) as hs:
        hs.set_attr(mod, "_tmp_flag", 1)
        hs.set_attr(mod.self_attn, "scaling", 0.5)
        assert mod._tmp_flag == 1
    assert not hasattr(mod, "_tmp_flag")
    assert mod.self_attn.scaling != 0.5
