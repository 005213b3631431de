"""The fused Qwen-VL tower attention (mmfast/models/qwen_tower.py): equal to transformers' per-chunk
loop within fp32 tolerance on all three families, with fewer attention calls, installed by every
session (switchable) and removed exactly on exit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

import mmfast
from mmfast.config import load_recipe
from mmfast.errors import ConfigError
from mmfast.hooks import HookSession
from mmfast.models.qwen_tower import ChunkPlan, chunked_attention, install_fused_tower
from mmfast.pipeline import Session

FAMILIES = ["qwen2_5_vl", "qwen2_vl", "qwen3_vl"]
OFF = {"model": {"fused_vision_attention": False}}


@pytest.fixture(params=FAMILIES, scope="module")
def qmm(request, tmp_path_factory):
    from mmfast.models.factory import random_qwen_vl, save_model

    model, processor = random_qwen_vl(request.param, seed=3)
    path = save_model(model, processor, tmp_path_factory.mktemp(request.param))
    return mmfast.load(path, device="cpu", dtype="float32")


def _image(h: int, w: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))


# 40 x 48 -> 10 x 12 patches: Qwen2.5-VL's 4 x 4-patch windows have lengths 16 and 8 (edge rows);
# 64 x 32 -> 16 x 8 patches: a second image size (full-attention blocks get two chunk lengths)
ONE = [_image(40, 48)]
TWO = [_image(40, 48), _image(64, 32, seed=1)]
SAME = [_image(40, 48), _image(40, 48, seed=2)]  # equal sizes: one batched call (a view, no gather)


def _tower(mm, images):
    """The adapter's tower output (features per image, deepstack tags) and the number of sdpa calls."""
    batch = mm.prepare(images, ["Describe."] * len(images))
    calls = 0
    real = F.scaled_dot_product_attention

    def counting(*a, **kw):
        nonlocal calls
        calls += 1
        return real(*a, **kw)

    F.scaled_dot_product_attention = counting
    try:
        with torch.no_grad():
            vision = mm.adapter.encode_images(batch.pixel_values, image_sizes=batch.image_sizes)
    finally:
        F.scaled_dot_product_attention = real
    return vision, calls, batch.image_sizes


def _calls(mm, grid_thw) -> tuple[int, int]:
    """Attention calls per tower forward: (transformers' loop: one per chunk per block, fused: one per
    distinct chunk length per block). A chunk is an image, or a window in Qwen2.5-VL's windowed blocks."""
    from transformers.vision_utils import get_vision_window_index

    tower = mm.adapter.vision_tower
    sizes = grid_thw.prod(-1)
    full = (len(tower.blocks), len(sizes), len(set(sizes.tolist())))
    if mm.adapter.family != "qwen2_5_vl":
        return full[0] * full[1], full[0] * full[2]
    _, cu_win = get_vision_window_index(
        grid_thw,
        spatial_merge_size=tower.spatial_merge_size,
        window_size=tower.window_size,
        patch_size=tower.patch_size,
        kwargs={},
    )
    lengths = torch.as_tensor(cu_win).diff()
    lengths = lengths[lengths > 0].tolist()
    n_full = len(tower.fullatt_block_indexes)
    n_win = len(tower.blocks) - n_full
    return n_full * full[1] + n_win * len(lengths), n_full * full[2] + n_win * len(set(lengths))


@pytest.mark.parametrize("images", [ONE, TWO, SAME], ids=["one_image", "two_sizes", "two_same_size"])
def test_fused_tower_equals_transformers(qmm, images):
    ref, hf_calls, grid = _tower(qmm, images)
    want_hf, want_fused = _calls(qmm, grid)
    assert hf_calls == want_hf
    with HookSession(qmm.model) as hooks:
        n = install_fused_tower(qmm.adapter, hooks)
        assert n == len(qmm.adapter.vision_layers)
        fused, calls, _ = _tower(qmm, images)
    assert calls == want_fused  # the fused path ran: one call per chunk length
    assert calls < hf_calls or (qmm.adapter.family != "qwen2_5_vl" and images is not SAME)
    for a, b in zip(ref.features, fused.features):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert ref.tags.keys() == fused.tags.keys()
    for key in ref.tags:
        for a, b in zip(ref.tags[key], fused.tags[key]):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    again, calls_after, _ = _tower(qmm, images)  # restored: transformers' loop, bitwise
    assert calls_after == hf_calls
    assert all(torch.equal(a, b) for a, b in zip(ref.features, again.features))


def test_session_installs_and_restores_exactly(qmm):
    attn = [blk.attn for blk in qmm.adapter.vision_layers]
    ref, hf_calls, _ = _tower(qmm, SAME)
    with Session(qmm, load_recipe({})):
        assert all("forward" in m.__dict__ for m in attn)
        _, calls, _ = _tower(qmm, SAME)
        assert calls < hf_calls
    assert not any("forward" in m.__dict__ for m in attn)
    with Session(qmm, load_recipe(OFF)):
        assert not any("forward" in m.__dict__ for m in attn)
        _, calls, _ = _tower(qmm, SAME)
        assert calls == hf_calls
    after, _, _ = _tower(qmm, SAME)
    assert all(torch.equal(a, b) for a, b in zip(ref.features, after.features))


def test_greedy_token_identical_with_and_without_fused_tower(qmm):
    images, prompts = TWO, ["Describe the image.", "Is there a cat?"]
    fused = qmm.generate(images, prompts, max_new_tokens=10)
    plain = qmm.generate(images, prompts, recipe=OFF, max_new_tokens=10)
    assert [r.token_ids for r in fused] == [r.token_ids for r in plain]


def test_probe_passes_through_unprobed_modules_and_sees_probed_ones(qmm):
    """Under the probe's sdpa wrapper the fused path still runs on modules nobody probes; a probed
    module runs transformers' per-chunk calls, so its recorder sees every chunk."""
    from mmfast.hooks import attach

    ref, hf_calls, grid = _tower(qmm, ONE)
    _, want_fused = _calls(qmm, grid)
    with HookSession(qmm.model) as hooks:
        install_fused_tower(qmm.adapter, hooks)
        hooks.use_probe_attention()
        out, calls, _ = _tower(qmm, ONE)
        assert calls == want_fused
        seen = []
        probed = qmm.adapter.vision_layers[0].attn  # a windowed block on Qwen2.5-VL
        attach(hooks, probed).recorders.append(lambda m, q, k, mask, scale: seen.append(q.shape[-2]))
        out2, calls2, _ = _tower(qmm, ONE)
    for a, b in zip(ref.features, out2.features):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert sum(seen) == int(grid.prod())  # every chunk of block 0 went through the probe
    if qmm.adapter.family == "qwen2_5_vl":  # one call per window there, one per length when fused
        assert len(seen) > 2 and calls2 > calls
    assert not any(
        "forward" in blk.attn.__dict__ or "_mmfast_attn" in blk.attn.__dict__ for blk in qmm.adapter.vision_layers
    )


def test_wrapped_forward_is_left_alone(qmm, caplog):
    """A forward someone else wrapped per instance (accelerate's offload hooks) is not replaced."""
    attn = qmm.adapter.vision_layers[0].attn
    with HookSession(qmm.model) as outer:
        outer.set_attr(attn, "forward", attn.forward)
        with HookSession(qmm.model) as hooks, caplog.at_level("WARNING"):
            assert install_fused_tower(qmm.adapter, hooks) == 0
        assert "already have a wrapped forward" in caplog.text
    assert "forward" not in attn.__dict__


def test_a_nested_session_keeps_the_open_sessions_fused_tower_without_a_warning(qmm, caplog):
    """An inner session finds the outer one's fused forwards: it leaves them (they keep running) and does not warn
    that the tower runs as transformers ships it (it said so, of mmfast's own forwards)."""
    with HookSession(qmm.model) as outer:
        assert install_fused_tower(qmm.adapter, outer) > 0
        fused = qmm.adapter.vision_layers[0].attn.forward
        with HookSession(qmm.model) as hooks, caplog.at_level("WARNING"):
            assert install_fused_tower(qmm.adapter, hooks) == 0
        assert "wrapped forward" not in caplog.text
        assert qmm.adapter.vision_layers[0].attn.forward is fused


def test_chunk_plan_buckets_and_views():
    plan = ChunkPlan.of(torch.tensor([0, 16, 24, 40, 48, 48, 60]))  # lengths 16, 8, 16, 8, (empty), 12
    assert sorted((b.length, b.n) for b in plan.buckets) == [(8, 2), (12, 1), (16, 2)]
    assert ChunkPlan.of(torch.tensor([0, 10, 20])).buckets[0].index is None  # equal sizes in order: a view
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 60, 2, 4).unbind(0)  # [S, H, Dh]
    want = torch.cat(
        [
            F.scaled_dot_product_attention(*(t[s:e].transpose(0, 1) for t in (q, k, v)), scale=0.5).transpose(0, 1)
            for s, e in [(0, 16), (16, 24), (24, 40), (40, 48), (48, 60)]
        ]
    )
    torch.testing.assert_close(chunked_attention(q, k, v, plan, 0.5), want, rtol=1e-6, atol=1e-6)


def test_config_key_is_strict():
    assert load_recipe(OFF).model.fused_vision_attention is False
    with pytest.raises(ConfigError, match="model.fused_vision_attention"):
        load_recipe({"model": {"fused_vision_attention": "maybe"}})
