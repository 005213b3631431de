"""Hook sessions restore the model exactly: same logits, no hooks left, same attention implementation."""

from __future__ import annotations

import pytest
import torch

from mmfast import compat
from mmfast.config import Recipe, load_recipe
from mmfast.errors import InputError
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


def test_sessions_closed_out_of_order_restore_the_model(tiny_mm):
    """A session closed while a later one is open (not LIFO) hands what it restores to the later one: after both,
    nothing of either is left (the first used to restore the original, the second then put the first's back)."""
    model, layer = tiny_mm.model, tiny_mm.adapter.layers[0]
    before_impl = compat.get_attn_implementation(model)
    before_scaling = layer.self_attn.scaling
    first, second = HookSession(model), HookSession(model)
    for hs, value in ((first, 0.5), (second, 0.25)):
        hs.set_attr(layer, "_tmp_flag", value)
        hs.set_attr(layer.self_attn, "scaling", value)
        hs.use_probe_attention()
    first.close()
    assert layer._tmp_flag == 0.25 and layer.self_attn.scaling == 0.25  # the open session's values stay
    assert compat.get_attn_implementation(model) != before_impl  # and its probe
    second.close()
    assert "_tmp_flag" not in layer.__dict__
    assert layer.self_attn.scaling == before_scaling
    assert compat.get_attn_implementation(model) == before_impl


def test_an_inner_sessions_attention_override_goes_with_it(tiny_mm, images, prompts):
    """An inner session that overrides attention (ZipVL) on modules the outer one probes (FastV) adds to a copy of
    the outer's hooks there: closed, it leaves the outer's as they were (its override stayed in them and the outer
    session then failed: "ZipVL: the LLM ran outside the runner")."""
    fastv = load_recipe({"pruning": [{"method": "fastv", "params": {"k": 1, "drop_ratio": 0.5}}]})
    with Session(tiny_mm, fastv) as outer:
        alone = [r.token_ids for r in outer.generate(images[:2], prompts[:2], max_new_tokens=4)]
        probed = tiny_mm.adapter.layers[0].self_attn._mmfast_attn
        with Session(tiny_mm, load_recipe({"pruning": [{"method": "zipvl"}]})) as inner:
            inner.generate(images[:2], prompts[:2], max_new_tokens=4)
        assert tiny_mm.adapter.layers[0].self_attn._mmfast_attn is probed and probed.override is None
        assert [r.token_ids for r in outer.generate(images[:2], prompts[:2], max_new_tokens=4)] == alone
    for layer in tiny_mm.adapter.layers:
        assert "_mmfast_attn" not in layer.self_attn.__dict__


def test_set_attr_of_a_parameter_or_buffer_puts_it_back(tiny_mm):
    """A parameter or buffer replaced through the session is restored on close (it was deleted: the old value was
    looked up in the instance ``__dict__`` only, so close() took it for an absent attribute)."""
    proj = tiny_mm.adapter.layers[0].self_attn.q_proj
    rotary = tiny_mm.adapter.language_model.rotary_emb
    weight, inv_freq = proj.weight, rotary.inv_freq
    with HookSession(tiny_mm.model) as hs:
        hs.set_attr(proj, "weight", torch.nn.Parameter(weight.detach() * 0))
        hs.set_attr(rotary, "inv_freq", inv_freq * 2)
    assert proj._parameters["weight"] is weight
    assert rotary._buffers["inv_freq"] is inv_freq


def test_set_attr_of_a_property_puts_its_value_back(tiny_mm):
    """A property set through the session (a config's ``_attn_implementation``) gets its value back on close (close()
    took it for an absent attribute, and deleting a property without a deleter failed silently: it stayed changed)."""
    config = tiny_mm.adapter.text_config
    before = config._attn_implementation
    with HookSession(tiny_mm.model) as hs:
        hs.set_attr(config, "_attn_implementation", "eager")
        assert config._attn_implementation == "eager"
    assert config._attn_implementation == before


def test_a_closed_session_installs_nothing(tiny_mm):
    """Hooks, attributes and probes installed through a closed session would stay on the model for good (its close()
    had run): refused, and the model is left as it was."""
    model = tiny_mm.model
    before_impl, before_hooks = compat.get_attn_implementation(model), count_hooks(model)
    session = Session(tiny_mm, Recipe())
    session.close()
    attn = tiny_mm.adapter.layers[1].self_attn
    with pytest.raises(InputError, match="closed"):
        session.probe.watch("late", attn, rows=last_row)
    with pytest.raises(InputError, match="closed"):
        session.runner.prune_at(2, lambda view: None)
    with pytest.raises(InputError, match="closed"):
        session.hooks.forward_hook(tiny_mm.adapter.lm_head, lambda m, a, o: o)
    session.close()
    assert count_hooks(model) == before_hooks
    assert compat.get_attn_implementation(model) == before_impl
    assert "_mmfast_attn" not in attn.__dict__


def test_a_session_that_changed_something_after_a_later_one_restores_the_model(tiny_mm, images, prompts):
    """An outer session that sets an attribute, or switches to the probe, after an inner (later) session did remembers
    the inner's value: the inner's close used to restore the original under it, and the outer's close then put the
    inner's value back for good (the probe implementation and the inner's attention hooks stayed on the model). Now the
    inner hands what it restores to the outer, whose probe keeps recording until it closes."""
    model, layer = tiny_mm.model, tiny_mm.adapter.layers[0]
    before_impl = compat.get_attn_implementation(model)
    outer, inner = HookSession(model), HookSession(model)
    inner.set_attr(layer, "_tmp_flag", "inner")
    outer.set_attr(layer, "_tmp_flag", "outer")
    inner.close()
    assert layer._tmp_flag == "outer"
    outer.close()
    assert "_tmp_flag" not in layer.__dict__

    fastv = load_recipe({"pruning": [{"method": "fastv", "params": {"k": 1, "drop_ratio": 0.5}}]})
    attn = tiny_mm.adapter.layers[0].self_attn  # FastV's probe at k = 1
    outer = Session(tiny_mm, Recipe())
    inner = Session(tiny_mm, fastv)
    outer.probe.watch("mine", attn, rows=last_row)
    inner.close()
    outer.generate(images[:1], prompts[:1], max_new_tokens=2)
    assert outer.probe.get("mine") is not None  # the outer's probe outlives the inner session
    outer.close()
    assert compat.get_attn_implementation(model) == before_impl
    assert "_mmfast_attn" not in attn.__dict__


def test_a_closed_inner_sessions_attention_override_stops_acting_in_the_outer(tiny_mm, images, prompts):
    """An outer session that probes a module after an inner one (ZipVL) overrode its attention adds to a copy of the
    inner's hooks there: the inner closed, its override stayed in that copy and the outer's next call failed ("ZipVL:
    the LLM ran outside the runner"). Now the closing session's recorders and override leave the copies too."""
    with Session(tiny_mm, Recipe()) as alone:
        want = [r.token_ids for r in alone.generate(images[:2], prompts[:2], max_new_tokens=4)]
    attn = tiny_mm.adapter.layers[0].self_attn
    with Session(tiny_mm, Recipe()) as outer:
        inner = Session(tiny_mm, load_recipe({"pruning": [{"method": "zipvl"}]}))
        outer.probe.watch("mine", attn, rows=last_row)
        inner.close()
        assert attn._mmfast_attn.override is None and len(attn._mmfast_attn.recorders) == 1
        assert [r.token_ids for r in outer.generate(images[:2], prompts[:2], max_new_tokens=4)] == want
        assert outer.probe.get("mine") is not None
    assert "_mmfast_attn" not in attn.__dict__
