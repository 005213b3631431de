"""HICom on OneVision video (mmfast/pruning/hicom.py, _hicom_video.py): the frame grouping equals the
release's ``divide_feature`` / ``balance_divide_feature`` and the local tokens its ``LocalCompressor``
(lntzm/HICom ``hicom/model/projector.py``, ``use_guide direct``), ported line by line here, on the
same tensors; the keys and guide come from the SigLIP the tower was cut from as the release's
``SiglipVisionTower`` computes them; no-op is the baseline; a batch of two videos equals per sample;
images on OneVision, Qwen and a missing guide are refused with what to do; a budget is per video."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import random_video, video_models

from mmfast.config import load_recipe
from mmfast.errors import ConfigError, IncompatibleRecipeError, ModelLoadError
from mmfast.pipeline import Session
from mmfast.pruning._hicom_video import group_index_bins, release_bins, video_local

_mm = video_models()


@pytest.fixture(scope="module")
def siglip_dir(tmp_path_factory):
    """A tiny SigLIP whose first vision layers are the tiny OneVision tower (which is it cut to one
    layer less, as OneVision's 26 of SigLIP-so400m's 27), saved with a tokenizer, as a user downloads one."""
    from mmfast.pruning._hicom_video import random_siglip

    mm = _mm()
    vc, tok = mm.adapter.vision_config, mm.tokenizer
    model = random_siglip(vc, tok, vc.num_hidden_layers, seed=3, text_width=24, text_positions=16)
    torch.manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    missing = model.vision_model.load_state_dict(mm.adapter.vision_tower.state_dict(), strict=False).missing_keys
    assert all(k.startswith(("head.", f"encoder.layers.{vc.num_hidden_layers}.")) for k in missing)
    d = tmp_path_factory.mktemp("siglip")
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


def _recipe(**params) -> dict:
    return {"pruning": [{"method": "hicom", "params": {"global_queries": 0, **params}}]}


# -- the release's code, ported line by line (hicom/model/projector.py, LocalCompressor) ---------------
def _release_balance_divide_feature(x, kernel_size):
    t = x.shape[0]
    split_size = math.ceil(t / kernel_size)
    no_repeat_num = t % split_size
    if no_repeat_num == 0:
        no_repeat_num = split_size
    split_idx_list = [kernel_size - (0 if i < no_repeat_num else 1) for i in range(split_size)]
    start_idx = 0
    splited_x = []
    for i in range(split_size):
        end_idx = start_idx + split_idx_list[i]
        if split_idx_list[i] < kernel_size:
            start_idx -= 1
        splited_x.append(x[start_idx:end_idx, ...])
        start_idx = end_idx
    return torch.stack(splited_x, dim=1)


def _release_divide_feature(x, kernel_size):  # einops.rearrange written as reshape / permute
    t, h, w = x.shape[:3]
    if t % kernel_size[0] == 0:  # '(t1 t2) h w d -> t2 t1 h w d'
        t_reshape_x = x.reshape(t // kernel_size[0], kernel_size[0], *x.shape[1:]).transpose(0, 1)
    else:
        t_reshape_x = _release_balance_divide_feature(x, kernel_size[0])
    t_reshape_x = t_reshape_x.permute(2, 0, 1, 3, 4)  # 't2 t1 h w d -> h t2 t1 w d'
    if h % kernel_size[1] == 0:  # '(h1 h2) t2 t1 w d -> h2 h1 t2 t1 w d'
        th = t_reshape_x.reshape(h // kernel_size[1], kernel_size[1], *t_reshape_x.shape[1:]).transpose(0, 1)
    else:
        th = _release_balance_divide_feature(t_reshape_x, kernel_size[1])
    th = th.permute(4, 0, 1, 2, 3, 5)  # 'h2 h1 t2 t1 w d -> w h2 h1 t2 t1 d'
    if w % kernel_size[2] == 0:  # '(w1 w2) h2 h1 t2 t1 d -> w2 w1 h2 h1 t2 t1 d'
        thw = th.reshape(w // kernel_size[2], kernel_size[2], *th.shape[1:]).transpose(0, 1)
    else:
        thw = _release_balance_divide_feature(th, kernel_size[2])
    w2, w1, h2, h1, t2, t1, d = thw.shape  # 'w2 w1 h2 h1 t2 t1 d -> (t1 h1 w1) (t2 h2 w2) d'
    return thw.permute(5, 3, 1, 4, 2, 0, 6).reshape(t1 * h1 * w1, t2 * h2 * w2, d)


def _release_local(frames_feature, frames_embed, guide_embed, tk, sk, logit_scale=None, logit_bias=None):
    """LocalCompressor.forward up to ``self.readout`` (direct guide, no adapters): (out [G, Dv], attn [G, S])."""
    t, h, w = frames_feature.shape[:3]
    qk_dim = frames_embed.shape[-1]
    if frames_embed is not None and logit_scale is not None:
        frames_embed = frames_embed / frames_embed.norm(p=2, dim=-1, keepdim=True)
        guide_embed = guide_embed / guide_embed.norm(p=2, dim=-1, keepdim=True)
    key, value = frames_embed, frames_feature
    temporal_kernel_size = 1 if t == 1 else tk
    downsampled_size = (math.ceil(t / temporal_kernel_size), math.ceil(h / sk), math.ceil(w / sk))
    query = guide_embed.reshape(1, 1, 1, -1).repeat(*downsampled_size, 1)  # GuideInjector 'direct'
    reshape_key = _release_divide_feature(key, (temporal_kernel_size, sk, sk))
    reshape_value = _release_divide_feature(value, (temporal_kernel_size, sk, sk))
    reshape_query = _release_divide_feature(query, (1, 1, 1))
    if logit_scale is not None:
        logits = torch.bmm(reshape_query, reshape_key.permute(0, 2, 1)) * logit_scale.exp() + logit_bias
    else:
        logits = torch.bmm(reshape_query, reshape_key.permute(0, 2, 1)) / math.sqrt(qk_dim)
    attn = torch.softmax(logits, dim=-1)
    return torch.bmm(attn, reshape_value)[:, 0], attn[:, 0]


# -- grouping and local compressor against the port -----------------------------------------------------
@pytest.mark.parametrize(
    ("shape", "kernel"),
    [((8, 27, 27), (4, 3, 3)), ((7, 27, 27), (4, 3, 3)), ((13, 27, 27), (4, 2, 2)), ((3, 4, 4), (4, 2, 2))],
)
def test_grouping_equals_the_release_divide_feature(shape, kernel):
    t, h, w = shape
    volume = torch.arange(t * h * w).reshape(t, h, w, 1)
    want = _release_divide_feature(volume, kernel)[..., 0]  # [G, S] member raster indices
    bins = tuple(release_bins(n, k) for n, k in zip(shape, kernel))
    assert torch.equal(group_index_bins(shape, bins), want)


def test_grouping_where_the_release_fails_falls_back_to_adaptive_bins():
    with pytest.raises(RuntimeError):  # 6 frames, kernel 4: groups of 4 and 2 cannot be stacked
        _release_divide_feature(torch.zeros(6, 3, 3, 1), (4, 3, 3))
    assert release_bins(6, 4) == [(0, 3), (3, 6)]  # two groups, as the release's count


@pytest.mark.parametrize("clip_scale", [False, True])
def test_local_tokens_equal_the_release_local_compressor(clip_scale):
    torch.manual_seed(0)
    t, h, w, dv, d = 8, 27, 27, 12, 16
    values, keys, guide = torch.randn(t, h, w, dv), torch.randn(t, h, w, d), torch.randn(d)
    scale = (torch.tensor([2.3]), torch.tensor([-1.5])) if clip_scale else None
    want, want_w = _release_local(values, keys, guide, 4, 3, *(scale or ()))
    bins = (release_bins(t, 4), release_bins(h, 3), release_bins(w, 3))
    got, got_w, _ = video_local(values, keys, guide, bins, scale)
    assert got.shape == (2 * 9 * 9, dv)
    torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(got_w, torch.full_like(got_w, 1 / 36))  # the weighting is not a plain mean


def test_video_tokens_equal_the_release_pipeline(siglip_dir):
    """On the tiny OneVision: the release's SigLIP tower (values = hidden_states[-2], keys =
    last_hidden_state + head.mlp(head.layernorm(.)), guide = text pooler_output of the instruction padded
    to max_length), its local compressor, then the model's projector, instead of the 2x2 pooling; the
    closing newline stays last."""
    from transformers import AutoTokenizer, SiglipModel

    mm, prompt = _mm(), "What is the man doing?"
    recipe = load_recipe(_recipe(spatial_kernel=2, guide_model=str(siglip_dir)))
    batch = mm.prepare(None, [prompt], videos=[random_video(8)])
    with Session(mm, recipe) as s:
        vision = s.encode(batch)
    siglip = SiglipModel.from_pretrained(siglip_dir).eval()
    tok = AutoTokenizer.from_pretrained(siglip_dir)
    with torch.no_grad():
        out = siglip.vision_model(batch.pixel_values[0, :8], output_hidden_states=True)
        values = out.hidden_states[-2].reshape(8, 4, 4, -1)
        emb = out.last_hidden_state
        keys = (emb + siglip.vision_model.head.mlp(siglip.vision_model.head.layernorm(emb))).reshape(8, 4, 4, -1)
        guided = tok([prompt], return_tensors="pt", padding="max_length", truncation=True, max_length=16)
        guide = siglip.text_model(**guided).pooler_output[0]
        local, _ = _release_local(values, keys, guide, 4, 2)
        want = mm.adapter.projector(local)
    got = vision.projected[0]
    assert got.shape[0] == 2 * 2 * 2 + 1
    torch.testing.assert_close(got[:-1], want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[-1], mm.model.model.image_newline.to(got))
    assert vision.tags["frame"][0].tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 1] and set(
        vision.tags["video"][0].tolist()
    ) == {1}


# -- end to end ------------------------------------------------------------------------------------------
def test_noop_reproduces_greedy_on_a_video():
    mm, kw = _mm(), dict(videos=[random_video(8)], max_new_tokens=6)
    base = mm.generate(None, ["Describe."], **kw)[0]
    noop = mm.generate(None, ["Describe."], recipe=_recipe(spatial_kernel=1, temporal_kernel=1), **kw)[0]
    assert noop.token_ids == base.token_ids and noop.n_vision_tokens == base.n_vision_tokens == 8 * 4 + 1


def test_batch_of_two_videos_equals_per_sample(siglip_dir):
    mm, recipe = _mm(), _recipe(spatial_kernel=2, guide_model=str(siglip_dir))
    prompts, videos = ["Describe.", "What happens here?"], [random_video(8, 1), random_video(6, 2)]
    batch = mm.generate(None, prompts, videos=videos, recipe=recipe, max_new_tokens=5)
    base = mm.generate(None, prompts, videos=videos, max_new_tokens=5)
    for i in range(2):
        alone = mm.generate(None, [prompts[i]], videos=[videos[i]], recipe=recipe, max_new_tokens=5)[0]
        assert batch[i].token_ids == alone.token_ids and batch[i].n_vision_tokens == alone.n_vision_tokens
    assert [r.n_vision_tokens for r in batch] == [2 * 4 + 1, 2 * 4 + 1]  # 2 frame groups of 2 x 2, newline
    assert [r.n_vision_tokens for r in base] == [8 * 4 + 1, 6 * 4 + 1]


def test_local_grid_stat_is_each_samples_own_in_a_batch(siglip_dir):
    """Videos of different lengths in one batch: each sample reports its own local grid (12 frames: 3 frame
    groups of 2 x 2; 4 frames: 1), as alone, not the last video's of the batch."""
    mm, recipe = _mm(), _recipe(spatial_kernel=2, guide_model=str(siglip_dir))
    prompts, videos = ["Describe.", "What happens here?"], [random_video(12, 1), random_video(4, 2)]
    batch = mm.generate(None, prompts, videos=videos, recipe=recipe, max_new_tokens=1)
    assert [r.stats["hicom"]["local_grid"] for r in batch] == [[3, 2, 2], [1, 2, 2]]
    for i in range(2):
        alone = mm.generate(None, [prompts[i]], videos=[videos[i]], recipe=recipe, max_new_tokens=1)[0]
        assert batch[i].stats["hicom"] == alone.stats["hicom"]


def test_budget_is_tokens_per_video(siglip_dir):
    """``budget: {tokens: N}``: N vision tokens per video at the LLM input (frame groups x local cells
    + global + the closing newline), the largest local grid that fits; too small a budget is refused."""
    mm = _mm()
    recipe = {"pruning": [{**_recipe(guide_model=str(siglip_dir))["pruning"][0], "budget": {"tokens": 7}}]}
    out = mm.generate(None, ["Describe."], videos=[random_video(8)], recipe=recipe, max_new_tokens=3)[0]
    assert out.n_vision_tokens == 7 and out.stats["hicom"]["local_grid"] == [2, 1, 3]  # 2 x 3 cells + newline
    recipe["pruning"][0]["budget"] = {"tokens": 2}
    with pytest.raises(ConfigError, match=r"budget.tokens.*smallest feasible budget is 3"):
        mm.generate(None, ["Describe."], videos=[random_video(8)], recipe=recipe, max_new_tokens=3)


def test_global_branch_on_a_video_needs_weights(siglip_dir, tmp_path):
    """No OneVision global weights ship: global_queries > 0 names the missing file and the training
    command (and global_queries: 0); with weights (random here) the global tokens precede the newline."""
    mm, missing = _mm(), str(tmp_path / "hicom_global.safetensors")
    with pytest.raises(ConfigError, match=r"global_weights.*no local directory"):
        Session(mm, load_recipe(_recipe(global_queries=32, guide_model=str(siglip_dir))))
    with pytest.raises(ModelLoadError, match=r"hicom_global.safetensors.*train_hicom.py.*global_queries: 0"):
        Session(mm, load_recipe(_recipe(global_queries=32, global_weights=missing, guide_model=str(siglip_dir))))
    recipe = _recipe(spatial_kernel=2, global_queries=4, global_weights="random", guide_model=str(siglip_dir))
    out = mm.generate(None, ["Describe."], videos=[random_video(8)], recipe=recipe, max_new_tokens=3)[0]
    assert out.n_vision_tokens == 2 * 4 + 4 + 1  # local, global, newline
    recipe["pruning"][0]["params"]["local"] = False
    out = mm.generate(None, ["Describe."], videos=[random_video(8)], recipe=recipe, max_new_tokens=3)[0]
    assert out.n_vision_tokens == 4 + 1  # global tokens only, newline


# -- refusals --------------------------------------------------------------------------------------------
def test_images_on_onevision_qwen_and_a_missing_guide_are_refused(siglip_dir):
    from PIL import Image

    mm = _mm()
    calls = []
    handle = mm.adapter.vision_tower.register_forward_hook(lambda *a: calls.append(1))
    image = Image.fromarray(np.random.default_rng(5).integers(0, 255, (36, 44, 3), dtype=np.uint8))
    try:
        with pytest.raises(
            IncompatibleRecipeError,
            match=r"\(hicom\) needs a video on this model \(llava_onevision\) and takes no image.*videos=",
        ):
            mm.generate([image], ["What?"], recipe=_recipe(guide_model=str(siglip_dir)), max_new_tokens=2)
        with pytest.raises(
            IncompatibleRecipeError, match=r"\(hicom\) needs a video on this model"
        ):  # an image beside a video
            mm.generate([[image]], ["What?"], videos=[random_video(4)], recipe=_recipe(guide_model=str(siglip_dir)))
    finally:
        handle.remove()
    assert not calls  # refused before the tower ran
    with pytest.raises(IncompatibleRecipeError, match=r"\(hicom\) needs one fixed square patch grid.*qwen2_5_vl"):
        Session(_mm("qwen2_5_vl"), load_recipe(_recipe()))
    with pytest.raises(ConfigError, match=r"guide_model.*google/siglip-so400m-patch14-384"):
        Session(mm, load_recipe(_recipe()))
    with pytest.raises(ConfigError, match=r"guide_model.*not a SiglipModel directory"):
        Session(mm, load_recipe(_recipe(guide_model=str(siglip_dir / "nowhere"))))
