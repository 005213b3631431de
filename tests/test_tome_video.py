"""ToMe's temporal merge of video tokens (mmfast/pruning/tome.py, "Video"; _tome_video.py): every step's
merges equal ToMe's official ``bipartite_soft_matching`` + ``merge_wavg`` (facebookresearch/ToMe
@af95e4b ``tome/merge.py``, ported line by line below) applied to each pair of adjacent segments, on
the same tensors and in the model; the schedule reaches the budget exactly; r = 0 and a budget of every
token are greedy exactly; a batch of two videos equals each alone; merged tokens keep their
representative's (t, h, w) ids on Qwen and contiguous positions on OneVision; images are refused where
the tower merge cannot run, and Qwen3-VL is refused."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import random_video, video_models
from PIL import Image

from mmfast.config import load_recipe
from mmfast.errors import ConfigError, IncompatibleRecipeError
from mmfast.models.base import FRAME, VIDEO
from mmfast.pipeline import Session
from mmfast.pruning._tome_video import n_steps, temporal_merge, video_schedule

_mm = video_models()


def _recipe(**params) -> dict:
    return {"pruning": [{"method": "tome", "params": params}]}


# -- ToMe's official code (tome/merge.py @af95e4b), ported line by line --------------------------------
def do_nothing(x, mode=None):
    return x


def bipartite_soft_matching(metric, r, class_token=False, distill_token=False):
    protected = 0
    if class_token:
        protected += 1
    if distill_token:
        protected += 1
    t = metric.shape[1]
    r = min(r, (t - protected) // 2)
    if r <= 0:
        return do_nothing, do_nothing
    with torch.no_grad():
        metric = metric / metric.norm(dim=-1, keepdim=True)
        a, b = metric[..., ::2, :], metric[..., 1::2, :]
        scores = a @ b.transpose(-1, -2)
        if class_token:
            scores[..., 0, :] = -math.inf
        if distill_token:
            scores[..., :, 0] = -math.inf
        node_max, node_idx = scores.max(dim=-1)
        edge_idx = node_max.argsort(dim=-1, descending=True)[..., None]
        unm_idx = edge_idx[..., r:, :]
        src_idx = edge_idx[..., :r, :]
        dst_idx = node_idx[..., None].gather(dim=-2, index=src_idx)
        if class_token:
            unm_idx = unm_idx.sort(dim=1)[0]

    def merge(x, mode="mean"):
        src, dst = x[..., ::2, :], x[..., 1::2, :]
        n, t1, c = src.shape
        unm = src.gather(dim=-2, index=unm_idx.expand(n, t1 - r, c))
        src = src.gather(dim=-2, index=src_idx.expand(n, r, c))
        dst = dst.scatter_reduce(-2, dst_idx.expand(n, r, c), src, reduce=mode)
        if distill_token:
            return torch.cat([unm[:, :1], dst[:, :1], unm[:, 1:], dst[:, 1:]], dim=1)
        return torch.cat([unm, dst], dim=1)

    return merge, None


def merge_wavg(merge, x, size=None):
    if size is None:
        size = torch.ones_like(x[..., 0, None])
    x = merge(x * size, mode="sum")
    size = merge(size, mode="sum")
    x = x / size
    return x, size


def merge_source(merge, x, source=None):
    if source is None:
        n, t, _ = x.shape
        source = torch.eye(t, device=x.device)[None, ...].expand(n, t, t)
    source = merge(source, mode="amax")
    return source


# -- the temporal variant, built on the official functions ---------------------------------------------
def _official_temporal(frames: torch.Tensor, plan: list[list[int]]):
    """Each step: pair (earlier, later) segments, interleave them (later at the even rows: ToMe's set A,
    the sources; earlier at the odd rows: set B), run the official matching with that pair's r, then
    order the pair's tokens by their first source (the representative). Returns (x, size, rep)."""
    n_frames, per, _ = frames.shape
    eye = torch.eye(n_frames * per)
    segs = [(frames[f], torch.ones(per, 1), eye[f * per : (f + 1) * per]) for f in range(n_frames)]
    for rs in plan:
        nxt = []
        for j, r in enumerate(rs):
            (xb, sb, ob), (xa, sa, oa) = segs[2 * j], segs[2 * j + 1]
            assert xa.shape[0] == xb.shape[0], "the official split needs equal sets"
            inter = lambda a, b: torch.stack([a, b], 1).reshape(1, 2 * a.shape[0], -1)  # noqa: E731
            x, size, source = inter(xa, xb), inter(sa, sb), inter(oa, ob)
            merge, _ = bipartite_soft_matching(x, r)
            source = merge_source(merge, x, source)
            x, size = merge_wavg(merge, x, size)
            rep = (source[0] > 0).float().argmax(-1)  # first member of each token
            order = rep.argsort()
            nxt.append((x[0][order], size[0][order], source[0][order]))
        segs = nxt + segs[2 * len(rs) :]
    (x, size, source) = segs[0] if len(segs) == 1 else [torch.cat(p) for p in zip(*segs)]
    return x, size[:, 0], (source > 0).float().argmax(-1)


@pytest.mark.parametrize("r", [8, 4, 0])
def test_merges_equal_the_official_bipartite_soft_matching(r):
    """8 frames x 6 tokens, random features: the r-per-step plan gives every pair of a step the same
    r, so the official split applies to every pair; tokens, sizes and representatives agree."""
    torch.manual_seed(0)
    frames = torch.randn(8, 6, 5)
    plan = video_schedule(8, 6, r=r)
    assert plan == [[r // 4] * 4, [r // 2] * 2, [r]]
    seg, done = temporal_merge(frames, plan, metric_dim=5)
    want_x, want_size, want_rep = _official_temporal(frames, plan)
    assert done == [r, r, r] and seg.x.shape[0] == 48 - 3 * r
    torch.testing.assert_close(seg.x, want_x)
    assert torch.equal(seg.size, want_size) and torch.equal(seg.rep, want_rep)
    assert float(seg.size.sum()) == 48


def test_a_merged_token_is_the_mean_of_its_members_and_keeps_the_earliest():
    """Two frames, one merge: the later frame's token most similar to any earlier token merges into it."""
    early = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    late = torch.tensor([[0.6, 0.8], [0.1, 1.0]])  # token 3 (0.1, 1) is closest to token 1 (0, 1)
    seg, _ = temporal_merge(torch.stack([early, late]), [[1]], metric_dim=2)
    assert seg.rep.tolist() == [0, 1, 2] and seg.size.tolist() == [1.0, 2.0, 1.0]
    torch.testing.assert_close(seg.x[1], (early[1] + late[1]) / 2)


def test_schedule_reaches_the_budget_exactly_and_spreads_the_merges():
    for n_frames, per in ((8, 6), (5, 4), (3, 7), (2, 3)):
        total = n_frames * per
        for keep in range(per, total + 1):
            plan = video_schedule(n_frames, per, keep=keep)
            assert len(plan) == n_steps(n_frames) and total - sum(map(sum, plan)) == keep, (n_frames, per, keep)
        with pytest.raises(ValueError, match="at least one frame's worth"):
            video_schedule(n_frames, per, keep=per - 1)
    assert video_schedule(8, 6, keep=24) == [[2, 2, 2, 2], [4, 4], [8]]  # 24 merges: 8 per step
    # 42 merges, 14 a step, but frame 0's segment must end at 6 tokens: step 1 takes 21 (pair 0 all 6)
    assert video_schedule(8, 6, keep=6) == [[6, 5, 5, 5], [7, 6], [8]]
    assert video_schedule(4, 5, r=100) == [[5, 5], [5]]  # r capped by the sources
    assert video_schedule(1, 9, keep=9) == []  # one frame: nothing to merge across, so below 9 is refused


# -- in the model -------------------------------------------------------------------------------------
def _encode(mm, recipe, videos, prompts=None):
    with Session(mm, load_recipe(recipe)) as s:
        batch = mm.prepare(None, prompts or ["Describe."] * len(videos), videos=videos)
        vision = s.encode(batch)
        return vision, s.build_inputs(batch, vision)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "llava_onevision"])
def test_the_models_video_tokens_merge_as_the_official_rule(family):
    """On the unpruned projected tokens of an 8-frame video (Qwen: 4 frame groups x 16; OneVision: 8
    frames x 4 + a newline), the official rule's tokens equal the stage's, at the representatives'
    patch ids and frames; Qwen's kept tokens keep their (t, h, w) ids, OneVision's are contiguous."""
    mm = _mm(family)
    base, base_in = _encode(mm, {}, [random_video(8)])
    got, got_in = _encode(mm, _recipe(r=4), [random_video(8)])
    with torch.inference_mode():
        pid, proj = base.patch_ids[0], mm.adapter.project(base)[0]
    real = pid >= 0
    n_frames, per = (8, 4) if family == "llava_onevision" else (4, 16)
    frames = proj[real].float().reshape(n_frames, per, -1)
    want_x, want_size, want_rep = _official_temporal(frames, video_schedule(n_frames, per, r=4))
    n_real = want_x.shape[0]
    assert got.counts() == [n_real + int((~real).sum())]
    torch.testing.assert_close(got.projected[0][:n_real].float(), want_x, atol=1e-5, rtol=1e-5)
    assert torch.equal(got.patch_ids[0][:n_real], pid[real][want_rep])
    assert torch.equal(got.extras["tome.size"][0][:n_real], want_size)
    assert torch.equal(got.tags[FRAME][0][:n_real], base.tags[FRAME][0][real][want_rep])
    if family == "llava_onevision":  # the closing newline stays last, as it was
        assert got.patch_ids[0][-1] == -1 and torch.equal(got.projected[0][-1], proj[-1])
    assert got.stats["tome"]["per_sample_merged"] == [4 * n_steps(n_frames)]
    # positions: each kept vision token keeps its representative's slot positions (Qwen: 3-D ids)
    vb, vg = base_in.image_mask[0], got_in.image_mask[0]
    if family == "llava_onevision":
        valid = got_in.attention_mask[0].bool()
        assert torch.equal(got_in.position_ids[0][valid], torch.arange(int(valid.sum())))
    else:
        where = dict(zip(base_in.patch_ids[0][vb].tolist(), base_in.position_ids[0][vb].tolist()))
        assert [where[p] for p in got_in.patch_ids[0][vg].tolist()] == got_in.position_ids[0][vg].tolist()
        n_after = int(base_in.text_after_image[0].sum())
        assert torch.equal(got_in.position_ids[0, -n_after:], base_in.position_ids[0, -n_after:])
        # the pre-merger features merged with the same weights: the merger of their mean is not the mean
        # of the merged tokens, but unmerged tokens keep their own rows
        single = got.extras["tome.size"][0] == 1
        torch.testing.assert_close(got.features[0][single], base.features[0][got.patch_ids[0][single]])


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "llava_onevision"])
def test_noop_settings_reproduce_greedy(family):
    mm = _mm(family)
    kw = dict(videos=[random_video(8)], max_new_tokens=6)
    base = mm.generate(None, ["Describe."], **kw)[0]
    n = base.n_vision_tokens
    for recipe in (_recipe(r=0), _recipe(budget=n), {"pruning": [{"method": "tome", "budget": {"tokens": n}}]}):
        out = mm.generate(None, ["Describe."], recipe=recipe, **kw)[0]
        assert out.token_ids == base.token_ids and out.n_vision_tokens == n, recipe
    pruned = mm.generate(None, ["Describe."], recipe={"pruning": [{"method": "tome", "budget": {"tokens": 20}}]}, **kw)
    assert pruned[0].n_vision_tokens == 20


@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava_onevision"])
def test_batch_of_two_videos_equals_per_sample(family):
    mm = _mm(family)
    prompts, videos = ["Describe.", "What happens here?"], [random_video(8, 1), random_video(6, 2)]
    recipe = {"pruning": [{"method": "tome", "budget": {"ratio": 0.5}}]}
    batch = mm.generate(None, prompts, videos=videos, recipe=recipe, max_new_tokens=5)
    for i in range(2):
        alone = mm.generate(None, [prompts[i]], videos=[videos[i]], recipe=recipe, max_new_tokens=5)[0]
        assert batch[i].token_ids == alone.token_ids
        assert batch[i].n_vision_tokens == alone.n_vision_tokens
        assert batch[i].stats["tome"]["merged"] == alone.stats["tome"]["merged"] > 0


def test_images_are_refused_where_the_tower_merge_cannot_run():
    image = Image.fromarray(np.random.default_rng(5).integers(0, 255, (36, 44, 3), dtype=np.uint8))
    for family in ("qwen2_5_vl", "llava_onevision", "qwen3_vl"):
        mm = _mm(family)
        calls = []
        handle = mm.adapter.vision_tower.register_forward_hook(lambda *a: calls.append(1))
        try:
            for images, videos in (([image], None), ([image], [random_video(2)])):
                with pytest.raises(
                    IncompatibleRecipeError, match=rf"\(tome\) needs a video on this model \({family}\)"
                ):
                    mm.generate(images, ["What?"], videos=videos, recipe=_recipe(budget=8), max_new_tokens=2)
        finally:
            handle.remove()
        assert not calls  # before compute
    with pytest.raises(ConfigError, match=r"pruning\[0\]\.budget\.tokens: .*ask for at least 16 tokens"):
        _mm("qwen2_5_vl").generate(
            None, ["Go."], videos=[random_video(8)], recipe={"pruning": [{"method": "tome", "budget": {"tokens": 10}}]}
        )
    with pytest.raises(ConfigError, match=r"pruning\[0\]\.params\.budget: .*ask for at least 5 tokens"):
        _mm("llava_onevision").generate(None, ["Go."], videos=[random_video(8)], recipe=_recipe(budget=4))


def test_a_video_stage_after_tome():
    """ToMe first, DivPrune on what it left: the merged tokens are candidates like any other."""
    mm = _mm("qwen2_5_vl")
    recipe = {
        "pruning": [
            {"method": "tome", "budget": {"tokens": 32}},
            {"method": "divprune", "budget": {"tokens": 12}},
        ]
    }
    vision, inputs = _encode(mm, recipe, [random_video(8)])
    assert vision.counts() == [12] and bool((inputs.tags[VIDEO][0][inputs.image_mask[0]] == 1).all())


def test_support_is_images_in_the_tower_else_videos_only():
    from mmfast.capabilities import caps_of, supported_families_marked
    from mmfast.registry import PRUNERS

    marked = supported_families_marked(caps_of(PRUNERS.get("tome").cls, None))
    assert sorted(marked) == [
        "llava",
        "llava_onevision (videos only)",
        "qwen2_5_vl (videos only)",
        "qwen2_vl (videos only)",
        "qwen3_vl (videos only)",
    ]


@pytest.mark.parametrize("first", ["dycoke", "tome"])
def test_two_video_stages_that_need_whole_frames_are_refused_as_a_pair(first):
    """DyCoke and ToMe both read whole frames and each changes them, so no order serves both: the refusal says to
    keep one, whichever is listed first (it used to say "put dycoke first" with DyCoke already first)."""
    stages = {"dycoke": {"method": "dycoke", "params": {"l": 2}}, "tome": {"method": "tome", "params": {"r": 4}}}
    second = "tome" if first == "dycoke" else "dycoke"
    with pytest.raises(IncompatibleRecipeError) as info:
        _mm("qwen2_5_vl").generate(
            None, ["Go."], videos=[random_video(4)], recipe={"pruning": [stages[first], stages[second]]}
        )
    assert "both need every image's full patch grid" in str(info.value)
    assert "keep only one of them" in str(info.value) and " first" not in str(info.value)
