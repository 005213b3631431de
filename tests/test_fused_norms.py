"""model.fuse_norms: the LM's RMSNorm modules as one compiled kernel each (mmfast/models/fused_norms.py)."""

from __future__ import annotations

import logging

import pytest
import torch

import mmfast
from mmfast.config import load_recipe
from mmfast.models import fused_norms


def _norms(mm):
    return [m for m in mm.adapter.language_model.modules() if type(m).__name__.endswith("RMSNorm")]


def test_fused_norms_equal_eager_ones_and_the_session_restores_them(tiny_mm, images, prompts):
    norms = _norms(tiny_mm)
    assert norms and all("forward" not in m.__dict__ for m in norms)
    x = torch.randn(2, 7, norms[0].weight.shape[0])  # [B, T, d]
    eager = [m(x) for m in norms]
    base = load_recipe({})
    fused = load_recipe({"model": {"fuse_norms": True}})
    assert fused.hash() != base.hash() and load_recipe({"model": {"fuse_norms": False}}).hash() == base.hash()
    outs = {}
    for name, recipe in (("eager", base), ("fused", fused)):
        for mode in ("off", "static"):
            with mmfast.apply(tiny_mm, recipe, compile=mode) as s:
                if name == "fused":
                    assert all(getattr(m.forward, "mmfast_fused_norm", False) for m in norms)
                    got = [m(x) for m in norms]  # the compiled kernel: equal within fp32 tolerance
                    for a, b in zip(eager, got):
                        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
                res = s.generate(images[:2], prompts[:2], max_new_tokens=6)
            outs[name, mode] = [r.token_ids for r in res]
    assert all("forward" not in m.__dict__ for m in norms)  # close() restored transformers' forward
    assert outs["fused", "off"] == outs["eager", "off"]  # tiny fp32 differences do not move the argmax here
    assert outs["fused", "static"] == outs["fused", "off"]


def test_a_failing_compile_leaves_the_eager_norms_with_a_warning(tiny_mm, images, prompts, monkeypatch, caplog):
    def broken(module, hidden):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(fused_norms, "_fused", lambda: broken)
    with caplog.at_level(logging.WARNING, logger="mmfast.models.fused_norms"):
        with mmfast.apply(tiny_mm, load_recipe({"model": {"fuse_norms": True}})) as s:
            assert all("forward" not in m.__dict__ for m in _norms(tiny_mm))
            assert s.generate(images[:1], prompts[:1], max_new_tokens=2)[0].token_ids
    assert "torch.compile failed on this machine (RuntimeError: no compiler here)" in caplog.text


def test_fuse_norms_is_a_strict_boolean_key():
    with pytest.raises(Exception, match="fuse_norms"):
        load_recipe({"model": {"fuse_norms": "yes"}})
    with pytest.raises(Exception, match="fuse_norm"):
        load_recipe({"model": {"fuse_norm": True}})


def test_a_nested_session_keeps_the_open_sessions_fused_norms_without_a_warning(tiny_mm, caplog):
    """An inner session finds the outer one's fused norms: it leaves them (they keep running) and does not warn
    that the norms run as transformers ships them (it said so, of mmfast's own forwards)."""
    from mmfast.hooks import HookSession

    norms = _norms(tiny_mm)
    with HookSession(tiny_mm.model) as outer:
        assert fused_norms.install_fused_norms(tiny_mm.adapter.language_model, outer) == len(norms)
        fused = norms[0].forward
        with HookSession(tiny_mm.model) as inner, caplog.at_level(logging.WARNING):
            assert fused_norms.install_fused_norms(tiny_mm.adapter.language_model, inner) == 0
        assert "wrapped forward" not in caplog.text
        assert norms[0].forward is fused
    assert all("forward" not in m.__dict__ for m in norms)


def test_qwen3_vl_norms_stay_within_torchs_recompile_limit(monkeypatch):
    """Qwen3-VL's per-head q / k norms ([B, T, H, Dh]) beside the [B, T, d] ones, at batch 1 and 2, prefill and
    decode: every call reuses a few compiled variants (each norm sees [N, d] rows). Before, the variants per rank,
    batch and length (and a no_grad probe) passed torch's recompile limit (8) within two calls, and the norms
    met later ran eagerly."""
    import numpy as np
    import torch._dynamo
    from PIL import Image

    from mmfast.models.factory import random_qwen_vl

    model, proc = random_qwen_vl("qwen3_vl", seed=1)
    mm = mmfast.load(model, proc)
    im = Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 48, 3), dtype=np.uint8))
    torch._dynamo.reset()
    monkeypatch.setattr(torch._dynamo.config, "fail_on_recompile_limit_hit", True)
    recipe = load_recipe({"model": {"fuse_norms": True}})
    with mmfast.apply(mm, recipe) as s:
        assert any(m.weight.shape[-1] != mm.adapter.text_config.hidden_size for m in _norms(mm))  # per-head norms
        fused = [r.token_ids for r in s.generate([im, im], ["Describe.", "Is there a cat here now?"], max_new_tokens=5)]
        fused += [r.token_ids for r in s.generate([im], ["Describe."], max_new_tokens=5)]
    eager = [r.token_ids for r in mm.generate([im, im], ["Describe.", "Is there a cat here now?"], max_new_tokens=5)]
    eager += [r.token_ids for r in mm.generate([im], ["Describe."], max_new_tokens=5)]
    assert fused == eager
