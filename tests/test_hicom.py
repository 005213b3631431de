"""HICom: local weights (sum to 1, average pooling at alpha=0), token counts, instruction dependence,
video frames grouped by 4, the global branch (shapes, weight files) and its training step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mmfast.config import load_recipe
from mmfast.errors import ModelLoadError
from mmfast.pipeline import Session
from mmfast.pruning._grid import group_index
from mmfast.pruning._hicom_guide import guide_text, load_clip_guide
from mmfast.pruning._hicom_modules import (
    GlobalCompressor,
    local_compress,
    local_grid,
    save_global,
    sincos_3d,
)

TINY = {"spatial_kernel": 2, "global_queries": 0, "clip_model": "random"}


def _session(mm, **params):
    return Session(mm, load_recipe({"pruning": [{"method": "hicom", "params": {**TINY, **params}}]}))


def test_local_weights_sum_to_one_and_alpha0_is_average_pooling():
    torch.manual_seed(0)
    values, keys, guide = torch.randn(1, 6, 6, 8), torch.randn(1, 6, 6, 5), torch.randn(5)
    for alpha in (0.3, 1.0):
        tokens, w, index = local_compress(values, keys, guide, (1, 3, 3), alpha, 20.0)
        assert tokens.shape == (9, 8) and index.shape == (9, 4)
        torch.testing.assert_close(w.sum(1), torch.ones(9))
        assert not torch.allclose(w, torch.full_like(w, 0.25))
    tokens, w, _ = local_compress(values, keys, guide, (1, 3, 3), 0.0, 20.0)
    ref = F.adaptive_avg_pool2d(values[0].permute(2, 0, 1), (3, 3)).flatten(1).T
    torch.testing.assert_close(tokens, ref)
    assert torch.all(w == 0.25)
    # uneven grid (5 x 5 with 2 x 2 kernels -> 3 x 3 adaptive bins) still normalises
    _, w, _ = local_compress(torch.randn(1, 5, 5, 8), torch.randn(1, 5, 5, 5), guide, (1, 3, 3), 0.5, 20.0)
    torch.testing.assert_close(w.sum(1), torch.ones(9))


def test_token_counts_and_alpha0_matches_avgpool(tiny_mm, images, prompts):
    assert local_grid(1, 24, 24, 1, 3, None) == (1, 8, 8) and local_grid(1, 24, 24, 1, 2, None) == (1, 12, 12)
    batch = tiny_mm.prepare(images[:3], prompts[:3])
    with _session(tiny_mm) as s:
        res = s.generate(images[:3], prompts[:3], max_new_tokens=2)
    assert [r.n_vision_tokens for r in res] == [4, 4, 4]  # (4 / 2)^2
    with _session(tiny_mm, local_rule="blend", alpha=0.0) as s:
        pooled = s.encode(batch)
    with Session(tiny_mm, load_recipe({"pruning": [{"method": "avgpool", "params": {"keep": 4}}]})) as s:
        avg = s.encode(batch)
    for a, b in zip(pooled.features, avg.features):
        torch.testing.assert_close(a, b)


def test_instruction_changes_local_tokens(tiny_mm, images):
    im = [images[0], images[0]]
    batch = tiny_mm.prepare(im, ["Is there a cat in the image?", "What color is the car?"])
    with _session(tiny_mm) as s:
        v = s.encode(batch)
    assert not torch.allclose(v.features[0], v.features[1])
    with _session(tiny_mm, local_rule="blend") as s:
        v = s.encode(batch)
    assert not torch.allclose(v.features[0], v.features[1])
    with _session(tiny_mm, local_rule="blend", alpha=0.0) as s:
        v = s.encode(batch)
    torch.testing.assert_close(v.features[0], v.features[1])


def test_video_frames_grouped_in_fours(tiny_mm, images, prompts):
    index = group_index((8, 4, 4), (2, 2, 2))
    frames = torch.div(index, 16, rounding_mode="floor")
    assert index.shape == (8, 16)
    for g in range(8):
        assert sorted(set(frames[g].tolist())) == ([0, 1, 2, 3] if g < 4 else [4, 5, 6, 7])
    clip = [images[0], images[1]] * 4  # 8 frames for one prompt
    with _session(tiny_mm) as s:
        batch = tiny_mm.prepare([clip, images[2]], [prompts[0], prompts[1]])
        v = s.encode(batch)
        res = s.run(batch, max_new_tokens=2)
    assert v.counts() == [8] + [0] * 7 + [4]  # 2 frame groups x 2 x 2, other frame slots empty
    assert [r.n_vision_tokens for r in res] == [8, 4]
    assert res[0].stats["hicom"]["frames"] == 8
    # identical frames compress to the single-image tokens
    with _session(tiny_mm) as s:
        v4 = s.encode(tiny_mm.prepare([[images[0]] * 4], [prompts[0]]))
        v1 = s.encode(tiny_mm.prepare([images[0]], [prompts[0]]))
    torch.testing.assert_close(v4.features[0], v1.features[0], atol=1e-5, rtol=1e-5)
    with _session(tiny_mm, frames="images") as s:
        vi = s.encode(tiny_mm.prepare([clip], [prompts[0]]))
    assert vi.counts() == [4] * 8


def test_guide_text():
    assert (
        guide_text("Is there a dog in the image?\nAnswer the question using a single word or phrase.")
        == "Is there a dog in the image?"
    )
    assert (
        guide_text(
            "<image>\nWhich one?\nA. cat\nB. dog\nAnswer with the option's letter from the given choices directly."
        )
        == "Which one?"
    )


def test_global_branch_shapes_and_weight_files(tiny_mm, images, prompts, tmp_path):
    glob = GlobalCompressor(32, 64, 16, n_queries=5)
    pre, tok = glob(torch.randn(2, 3, 4, 4, 32), torch.randn(2, 16))
    assert pre.shape == (2, 5, 32) and tok.shape == (2, 5, 64)
    assert sincos_3d(3, 4, 4, 32).shape == (3, 4, 4, 32)
    with pytest.raises(ModelLoadError, match="train_hicom.py"):
        _session(tiny_mm, global_queries=5, global_weights=str(tmp_path / "missing.safetensors"))
    vc, tc = tiny_mm.adapter.vision_config, tiny_mm.adapter.text_config
    path = save_global(
        GlobalCompressor(vc.hidden_size, tc.hidden_size, 16, n_queries=5), tmp_path / "g.safetensors", {}
    )
    with _session(tiny_mm, global_queries=5, global_weights=str(path)) as s:
        batch = tiny_mm.prepare(images[:2], prompts[:2])
        v = s.encode(batch)
        res = s.run(batch, max_new_tokens=2)
    assert v.counts() == [9, 9] and v.projected[0].shape == (9, tc.hidden_size)
    assert v.features[0].shape == (9, vc.hidden_size)
    assert [r.n_vision_tokens for r in res] == [9, 9]
    with pytest.raises(Exception, match="n_queries"):
        _session(tiny_mm, global_queries=6, global_weights=str(path))


def test_global_weights_with_missing_tensors_name_the_file_and_the_fix(tmp_path):
    from safetensors.torch import load_file, save_file

    from mmfast.pruning._hicom_modules import load_global

    path = save_global(GlobalCompressor(32, 64, 16, n_queries=5), tmp_path / "g.safetensors", {})
    tensors = load_file(str(path))
    del tensors["query"]
    save_file(tensors, str(path))
    expect = {"vision_hidden": 32, "llm_hidden": 64, "text_dim": 16, "n_queries": 5}
    with pytest.raises(ModelLoadError, match=r"g\.safetensors .*missing \['query'\].*train_hicom\.py"):
        load_global(path, model_hint="m", expect=expect)


def test_global_modes_direct_and_coarse_against_direct_computation(tiny_mm, images, prompts, tmp_path):
    """coarse (the paper): FiLM-modulated learned queries; direct (the release's --use_guide direct):
    every query is MLP(g), so the global tokens are identical. Both checked against the formulas written
    out here; a weight file of one mode is refused for the other, and the stats name the mode."""
    torch.manual_seed(0)
    d, llm, p, n = 32, 64, 16, 5
    frames, guide = torch.randn(1, 2, 4, 4, d), torch.randn(1, p)
    for mode in ("coarse", "direct"):
        glob = GlobalCompressor(d, llm, p, n_queries=n, mode=mode).eval()
        with torch.no_grad():
            for prm in glob.parameters():  # non-trivial weights (the init zeroes the biases)
                prm.add_(0.1 * torch.randn_like(prm))
            pre, tok = glob(frames, guide)
            g = glob.text2q(guide)[0]  # [d]
            if mode == "direct":
                q = g.expand(n, d)
            else:
                scale, shift = glob.coarse_proj(g).chunk(2)
                q = F.layer_norm(
                    glob.query * (1 + scale) + shift, (d,), glob.coarse_norm.weight, glob.coarse_norm.bias, 1e-6
                )
            kv = (frames[0] + sincos_3d(2, 4, 4, d)).reshape(-1, d)
            h = glob.heads
            qh, kh, vh = (
                x.view(x.shape[0], h, d // h).transpose(0, 1)
                for x in (glob.q_proj(q), glob.k_proj(kv), glob.v_proj(kv))
            )
            att = torch.softmax(qh @ kh.transpose(1, 2) / (d // h) ** 0.5, -1) @ vh  # [h, n, d/h]
            expect = q + glob.out_proj(att.transpose(0, 1).reshape(n, d))
        torch.testing.assert_close(pre[0], expect, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(tok[0], glob.readout(expect), rtol=1e-4, atol=1e-5)
        identical = bool((tok[0] - tok[0, :1]).abs().max() < 1e-6)
        assert identical == (mode == "direct")
    assert not hasattr(GlobalCompressor(d, llm, p, n, mode="direct"), "coarse_proj")
    vc, tc = tiny_mm.adapter.vision_config, tiny_mm.adapter.text_config
    path = save_global(
        GlobalCompressor(vc.hidden_size, tc.hidden_size, 16, n_queries=5, mode="direct"), tmp_path / "d.safetensors", {}
    )
    with pytest.raises(Exception, match="global_mode"):
        _session(tiny_mm, global_queries=5, global_weights=str(path))  # default coarse vs a direct file
    with _session(tiny_mm, global_queries=5, global_weights=str(path), global_mode="direct") as s:
        res = s.generate(images[:1], prompts[:1], max_new_tokens=2)
    assert res[0].stats["hicom"]["global_mode"] == "direct"


def test_local_release_rule_against_direct_computation(tiny_mm, images, prompts):
    """local_rule: release = HICom's released local attention: w = softmax(g . k / sqrt(P)) over each
    group with raw keys visual_projection(last hidden state) (no post-layernorm), checked on the tiny
    model against the rule written out here; it differs from the default blend."""
    from mmfast.pruning._grid import group_index

    batch = tiny_mm.prepare(images[:1], prompts[:1])
    with _session(tiny_mm) as s:  # the default
        v = s.encode(batch)
    with _session(tiny_mm, local_rule="blend") as s:
        v_blend = s.encode(batch)
    ad = tiny_mm.adapter
    clip = load_clip_guide("random", tiny_mm.model, tiny_mm.tokenizer)
    with torch.no_grad():
        hs = ad.vision_tower(batch.pixel_values.float(), output_hidden_states=True).hidden_states
        feats = hs[ad.vision_feature_layer_index() + 1][0, 1:]  # [N, Dv] feature layer
        keys = clip.visual_projection(hs[-1][0, 1:].float())  # [N, P] raw, no post-layernorm
        g = clip.text_embeds([guide_text(prompts[0])])[0]  # [P]
        rows, cols = ad.grid
        idx = group_index((1, rows, cols), (1, rows // 2, cols // 2))  # spatial_kernel 2
        expect = []
        for members in idx.tolist():
            m = [j for j in members if j >= 0]
            w = torch.softmax(keys[m] @ g / keys.shape[-1] ** 0.5, 0)
            expect.append((w[:, None] * feats[m]).sum(0))
    torch.testing.assert_close(v.features[0], torch.stack(expect), rtol=1e-4, atol=1e-5)
    assert not torch.allclose(v.features[0], v_blend.features[0], atol=1e-4)


def test_training_step_decreases_loss(tiny_mm):
    from mmfast.train.embedded import _collate
    from mmfast.train.hicom import HIComTrainConfig, hicom_loss, local_tokens
    from mmfast.train.world_data import Turn, encode_conversation

    torch.manual_seed(0)
    mm = tiny_mm
    tok = mm.tokenizer
    clip = load_clip_guide("random", mm.model, tok)
    cfg = HIComTrainConfig(spatial_kernel=2, n_queries=3)
    vc, d = mm.adapter.vision_config, mm.adapter.text_config.hidden_size
    glob = GlobalCompressor(vc.hidden_size, d, clip.dim, cfg.n_queries)
    convs = [
        encode_conversation(tok, [Turn("Is there a cat in the image?", "Yes.", "yesno")]),
        encode_conversation(tok, [Turn("Describe the image.", "A red dog sits next to a blue cup.", "detail")]),
    ]
    ids, labels, mask, *_ = _collate(convs, 4 + cfg.n_queries, mm.adapter.image_token_id, tok.pad_token_id)
    feats = torch.randn(2, 16, vc.hidden_size)
    keys = clip.patch_embeds(torch.randn(2, 16, vc.hidden_size))
    guides = clip.text_embeds(["Is there a cat in the image?", "Describe the image."])
    local = local_tokens(feats, keys, guides, (4, 4), cfg)
    assert local.shape == (2, 4, vc.hidden_size)
    llava = mm.model
    before = {k: v.clone() for k, v in llava.state_dict().items()}
    opt = torch.optim.Adam(glob.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        loss = hicom_loss(llava, glob, feats, local, guides, ids, labels, mask, mm.adapter.image_token_id, (4, 4))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert all(torch.equal(v, before[k]) for k, v in llava.state_dict().items())  # LLaVA stays frozen
    llava.zero_grad(set_to_none=True)


def test_pruning_bench_names_the_hicom_global_mode():
    from mmfast.bench.common import variants
    from mmfast.bench.pruning import hicom_modes

    recipe = load_recipe("configs/bench/pruning.yaml")
    results = {v.name: {"pruning": [st._to_recipe() for st in v.recipe.pruning]} for v in variants(recipe)}
    modes = hicom_modes({"results": results})
    assert "hicom-64 coarse" in modes and "hicom-192 coarse" in modes
    results["hicom-64"]["pruning"][0]["params"]["global_mode"] = "direct"
    assert "hicom-64 direct" in hicom_modes({"results": results})
