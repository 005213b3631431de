"""Video stages on Qwen3-VL (mmfast/pruning/_video_items.py): every frame group of a video is its own
vision item there, and the session joins a video's items into one around the prune_vision of DyCoke,
FastVID and ToMe (``Capabilities.video_join``), then splits the rows back by their origin item.

Join then split is the identity; each method's kept (frame, cell) sets and rows equal its own rule
(``ttm_keep``, ``select_video``, ``temporal_merge``) on the stacked frames; kept tokens keep their unpruned
M-RoPE ids (a frame group left empty keeps its timestamp span); no-op = greedy, batch of two videos =
per sample; budgets are per video; DyCoke's DP excludes the video's last token (of its last non-empty
frame group)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from PIL import Image

import mmfast
from mmfast.capabilities import ModelFacts, caps_of, check_model, refusal, unmet_need
from mmfast.config import load_recipe
from mmfast.errors import ConfigError
from mmfast.models import ADAPTERS
from mmfast.models.base import FRAME, VIDEO
from mmfast.models.features import Need
from mmfast.pipeline import Session
from mmfast.pruning._video_items import ORIGIN, budget_items, join_videos, split_videos
from mmfast.registry import PRUNERS

_MODELS: dict[str, object] = {}


def _mm(family: str = "qwen3_vl"):
    if family not in _MODELS:
        from mmfast.models.factory import random_qwen_vl

        model, proc = random_qwen_vl(family, seed=1)
        _MODELS[family] = mmfast.load(model, proc)
    return _MODELS[family]


def _video(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, (n, 28, 28, 3), dtype=np.uint8)


def _image(seed: int = 5) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (36, 44, 3), dtype=np.uint8))


def _encode(mm, recipe, videos, images=None, prompts=None):
    """(batch, vision, inputs) of a session's encoding (no LLM)."""
    with Session(mm, load_recipe(recipe)) as s:
        batch = mm.prepare(images, prompts or ["Describe."] * len(videos), videos=videos)
        vision = s.encode(batch)
        return batch, vision, s.build_inputs(batch, vision)


def _video_items(batch, b: int = 0) -> list[int]:
    return [i for i, o in enumerate(batch.image_owner) if o == b and batch.item(i).is_video]


# -- the join itself -----------------------------------------------------------------------------------
def test_join_then_split_is_the_identity():
    """A batch of an image + a 4-group video and a 3-group video: the joined view has one item per video
    (grid (F, h, w), patch ids 0..F h w - 1, rows frame-major) and splitting the untouched view gives back
    every tensor, tag and extra of every item."""
    mm = _mm()
    with Session(mm, load_recipe({})) as s:
        batch = mm.prepare([[_image()], []], ["What?", "Describe."], videos=[_video(8, 1), _video(6, 2)])
        vision = s.encode(batch)
    n = vision.n_images
    assert [batch.item(i).is_video for i in range(n)] == [True] * 4 + [False] + [True] * 3  # the video first
    before = dataclasses.replace(
        vision,
        features=list(vision.features),
        patch_ids=list(vision.patch_ids),
        tags={k: list(v) for k, v in vision.tags.items()},
        extras={k: list(v) if isinstance(v, list) else v for k, v in vision.extras.items()},
    )
    joined = join_videos(vision, batch, mm.adapter.project)
    view, jb = joined.vision, joined.batch
    assert view.n_images == 3 and jb.image_owner == [0, 0, 1]
    assert [it.is_video for it in jb.items] == [True, False, True]
    _, h, w = vision.extras["grid_thw"][0]
    assert [view.extras["grid_thw"][j] for j in (0, 2)] == [(4, h, w), (3, h, w)]
    assert view.extras["grid_thw"][1] == vision.extras["grid_thw"][4]
    joined_items = budget_items(vision.counts(), batch, joined=True)
    assert view.counts() == [n for n, _ in joined_items] == [4 * h * w, vision.counts()[4], 3 * h * w]
    assert [what for _, what in joined_items] == ["video", "image", "video"]
    assert budget_items(vision.counts(), batch, joined=False) == [
        *[(h * w, "frame group")] * 4,
        (vision.counts()[4], "image"),
        *[(h * w, "frame group")] * 3,
    ]
    assert torch.equal(view.patch_ids[0].cpu(), torch.arange(4 * h * w))
    assert torch.equal(view.tags[FRAME][0].cpu(), torch.arange(4).repeat_interleave(h * w))
    assert torch.equal(view.tags[ORIGIN][2].cpu(), torch.tensor([5, 6, 7]).repeat_interleave(h * w))
    assert jb.image_sizes[0].tolist() == [4, 2 * h, 2 * w]
    assert int(view.extras["n_patches"][2]) == sum(vision.extras["n_patches"][5:8])
    torch.testing.assert_close(view.features[2], torch.cat(vision.features[5:8]))
    # a stage that changes nothing, and one that projects every item (as DyCoke does)
    for stage in (lambda v: v, lambda v: dataclasses.replace(v, projected=mm.adapter.project(v))):
        joined = join_videos(vision, batch, mm.adapter.project)
        with torch.inference_mode():
            out = split_videos(joined, stage(joined.vision))
            want_proj = mm.adapter.project(before)
        assert out.n_images == n and ORIGIN not in out.tags and set(out.tags) == set(before.tags)
        for i in range(n):
            assert torch.equal(out.features[i], before.features[i])
            assert torch.equal(out.patch_ids[i], before.patch_ids[i])
            for k in before.tags:
                assert torch.equal(out.tags[k][i], before.tags[k][i]), k
            if out.projected[i] is not None:
                torch.testing.assert_close(out.projected[i], want_proj[i])
        assert out.extras.keys() == before.extras.keys()
        for k, v in before.extras.items():
            assert out.extras[k] == v if not isinstance(v, torch.Tensor) else torch.equal(out.extras[k], v), k
        assert out.pixel_values is vision.pixel_values


def test_the_need_is_met_on_qwen3_for_the_video_stages_only():
    """DyCoke, FastVID and ToMe run on Qwen3-VL (videos); HICom, which takes the one-item need as a
    substitute but is not served by the join, keeps its refusal; a method needing one item without the
    join is still refused there."""
    q3 = ADAPTERS["qwen3_vl"].features
    for name in ("dycoke", "fastvid", "tome"):
        assert unmet_need(caps_of(PRUNERS.get(name).cls, None), q3) is None, name
    facts = ModelFacts("qwen3_vl", 4, 4, (24, 24), q3)
    msg = check_model(load_recipe({"pruning": [{"method": "hicom"}]}), facts)
    assert "(hicom) needs one fixed square patch grid per image, which this model (qwen3_vl)" in msg
    dycoke = caps_of(PRUNERS.get("dycoke").cls, None)
    unjoined = dataclasses.replace(dycoke, video_join=False)
    assert unmet_need(unjoined, q3) is Need.VIDEO_ONE_ITEM
    msg = refusal("pruning[0] (x)", unjoined, facts, PRUNERS)
    assert "needs a video as one vision item" in msg and "every frame group of a video is its own vision item" in msg
    assert unmet_need(dycoke, ADAPTERS["qwen2_5_vl"].features) is None


# -- each method's own rule on the joined frames ---------------------------------------------------------
def _frames(mm, n_frames: int):
    """The unpruned video's per-frame-group items: (projected [F, n, d], features [F, n, Dv'], items)."""
    batch, base, _ = _encode(mm, {}, [_video(n_frames)])
    items = _video_items(batch)
    with torch.inference_mode():
        proj = mm.adapter.project(base)
    return torch.stack([proj[i] for i in items]), torch.stack([base.features[i] for i in items]), items


@pytest.mark.parametrize("n_frames", [10, 12])  # 5 groups (an odd last one, dropped), 6 (step b runs)
def test_dycoke_ttm_keeps_per_frame_group_what_the_rule_keeps_on_the_joined_frames(n_frames):
    from mmfast.pruning.dycoke import ttm_keep

    mm = _mm()
    frames, _, items = _frames(mm, n_frames)
    want = ttm_keep(frames.float(), 0.7)
    _, got, inputs = _encode(mm, {"pruning": [{"method": "dycoke", "params": {"l": 2, "p": 0.0}}]}, [_video(n_frames)])
    assert len(items) == n_frames // 2
    for f, i in enumerate(items):  # each frame group holds its own kept cells, in the release's order
        assert torch.equal(got.patch_ids[i].cpu(), want[f].cpu()), f
        torch.testing.assert_close(got.projected[i], frames[f][want[f]])
        assert bool((got.tags[FRAME][i] == f).all())
    if n_frames == 10:
        assert got.counts()[items[-1]] == 0  # the odd last group: empty, its span stays in the prompt
    assert int(inputs.image_mask.sum()) == sum(int(w.numel()) for w in want)


def test_fastvid_keeps_per_frame_group_what_select_video_keeps_on_the_joined_frames(monkeypatch):
    from mmfast.pruning._fastvid_ops import FastVIDParams, select_video
    from mmfast.pruning.fastvid import ATTN_EXTRA, FastVID

    mm = _mm()
    per_item, seen = [], []
    observe, prune = FastVID.observe_tower, FastVID.prune_vision

    def spy_observe(self, vision):
        observe(self, vision)
        per_item.extend(vision.extras[ATTN_EXTRA])

    def spy_prune(self, vision, batch):
        seen.append((list(vision.extras[ATTN_EXTRA]), [p.clone() for p in self.adapter.project(vision)]))
        return prune(self, vision, batch)

    monkeypatch.setattr(FastVID, "observe_tower", spy_observe)
    monkeypatch.setattr(FastVID, "prune_vision", spy_prune)
    # two segments, no sub-segment cut: only each segment's last frame group keeps tokens
    cfg = {"retention_ratio": 0.5, "c": 2, "tau": 0.0, "ignore": -1.0}
    batch, got, _ = _encode(mm, {"pruning": [{"method": "fastvid", "params": cfg}]}, [_video(12)])
    items = _video_items(batch)
    ((attn, emb),) = seen
    assert len(attn) == 1 and attn[0].shape[0] == len(items) == 6  # one joined item: [F, n]
    assert torch.equal(attn[0], torch.cat([per_item[i] for i in items]))  # the frame groups' own A, stacked
    frames, _, _ = _frames(mm, 12)
    n = frames.shape[1]
    torch.testing.assert_close(emb[0].reshape(frames.shape), frames)
    prm = FastVIDParams(cfg["retention_ratio"], cfg["c"], cfg["tau"], cfg["ignore"], 0.4, 4, 0.6)
    kept, rows = select_video(
        emb[0].reshape(frames.shape),
        attn[0],
        emb[0].reshape(frames.shape).float().mean(1),
        prm,
        torch.Generator().manual_seed(0),
    )
    assert kept.numel() < 6 * n
    for f, i in enumerate(items):
        mine = (kept // n) == f
        assert torch.equal(got.patch_ids[i].cpu(), (kept[mine] % n).cpu()), f
        torch.testing.assert_close(got.projected[i].float(), rows[mine].float(), rtol=1e-5, atol=1e-5)
    assert sum(got.counts()[i] == 0 for i in items) == 4  # frame groups left without a token


def test_tome_merges_across_frame_groups_as_temporal_merge_on_the_joined_frames():
    from mmfast.pruning._tome_video import temporal_merge, video_schedule

    mm = _mm()
    frames, feats, items = _frames(mm, 8)
    f, t, d = frames.shape
    values = torch.cat([frames.float(), feats.float()], -1)
    seg, done = temporal_merge(values, video_schedule(f, t, r=6), d)
    _, got, _ = _encode(mm, {"pruning": [{"method": "tome", "params": {"r": 6}}]}, [_video(8)])
    frame_of = seg.rep // t
    for k, i in enumerate(items):
        mine = frame_of == k  # a merged token stays in its representative's (the earliest member's) group
        assert torch.equal(got.patch_ids[i].cpu(), (seg.rep[mine] % t).cpu()), k
        torch.testing.assert_close(got.projected[i].float(), seg.x[mine, :d], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.features[i].float(), seg.x[mine, d:], rtol=1e-5, atol=1e-5)
        assert torch.equal(got.extras["tome.size"][i].cpu(), seg.size[mine].cpu())  # a per-row extra, split
    assert got.stats["tome"]["per_sample_merged"] == [sum(done)] and sum(done) > 6
    assert bool((seg.size > 1).any())


# -- positions, generation, batches ------------------------------------------------------------------------
RECIPES = {
    "dycoke": ({"l": 2}, {"k": 0.0, "p": 0.0}),
    "fastvid": ({"retention_ratio": 0.3}, {"retention_ratio": 1.0, "tau": 2.0, "beta": 1.0}),
    "tome": ({"r": 8}, {"r": 0}),
}


def _recipe(name: str, noop: bool = False) -> dict:
    return {"pruning": [{"method": name, "params": RECIPES[name][int(noop)]}]}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_kept_tokens_keep_their_positions_and_empty_groups_their_spans(name):
    """An image (not for ToMe) + a 5-group video: every kept token has its unpruned (t, h, w) ids in its own frame
    group, the image and all text (timestamps included) keep theirs, frame groups may be left empty."""
    mm = _mm()
    kw = dict(images=[_image()], prompts=["What?"]) if name != "tome" else {}  # ToMe takes no image here
    _, _, base = _encode(mm, {}, [_video(10)], **kw)
    batch, got, pruned = _encode(mm, _recipe(name), [_video(10)], **kw)
    vb, vp = base.image_mask[0], pruned.image_mask[0]
    key = lambda x, m: list(zip(x.image_index[0][m].tolist(), x.patch_ids[0][m].tolist()))  # noqa: E731
    where = dict(zip(key(base, vb), base.position_ids[0][vb].tolist()))
    assert [where[k] for k in key(pruned, vp)] == pruned.position_ids[0][vp].tolist()
    text_b, text_p = base.attention_mask[0].bool() & ~vb, pruned.attention_mask[0].bool() & ~vp
    assert torch.equal(base.position_ids[0][text_b], pruned.position_ids[0][text_p])
    assert torch.equal(base.input_ids[0][text_b], pruned.input_ids[0][text_p])
    video_b, video_p = base.tags[VIDEO][0] > 0, pruned.tags[VIDEO][0] > 0
    assert 0 < int(video_p.sum()) < int(video_b.sum())
    assert int((vp & ~video_p).sum()) == int((vb & ~video_b).sum())  # the image keeps every token
    counts = [got.counts()[i] for i in _video_items(batch)]
    if name == "dycoke":  # the odd last group is dropped whole
        assert counts[-1] == 0
    if name != "tome":
        assert int((vp & ~video_p).sum()) > 0
    assert len(counts) == 5


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_generate_noop_is_greedy_and_batch_equals_per_sample(name):
    mm = _mm()
    kw = dict(videos=[_video(8)], max_new_tokens=5)
    base = mm.generate(None, ["Describe."], **kw)[0]
    noop = mm.generate(None, ["Describe."], recipe=_recipe(name, noop=True), **kw)[0]
    assert noop.token_ids == base.token_ids and noop.n_vision_tokens == base.n_vision_tokens
    out = mm.generate(None, ["Describe."], recipe=_recipe(name), **kw)[0]
    assert out.n_vision_tokens < base.n_vision_tokens
    prompts, videos = ["Describe.", "What happens here?"], [_video(10, 1), _video(6, 2)]
    batch = mm.generate(None, prompts, videos=videos, recipe=_recipe(name), max_new_tokens=5)
    for b in range(2):
        alone = mm.generate(None, [prompts[b]], videos=[videos[b]], recipe=_recipe(name), max_new_tokens=5)[0]
        assert batch[b].token_ids == alone.token_ids, b
        assert batch[b].n_vision_tokens == alone.n_vision_tokens, b
        assert batch[b].stats == {**alone.stats, "scoring_s": batch[b].stats["scoring_s"]}, b


def test_dycoke_dp_excludes_the_last_token_of_the_whole_video(monkeypatch):
    """The release's candidates are the video's tokens but its last: over the frame groups' spans that is
    the last kept token of the last non-empty group (the odd fifth group is empty here)."""
    from mmfast.pruning.dycoke import CANDIDATE_TAG, DyCoke

    mm = _mm()
    seen = []
    split = DyCoke._split

    def spy(self, view):
        edit = split(self, view)
        seen.append(view.state.inputs)
        return edit

    monkeypatch.setattr(DyCoke, "_split", spy)
    out = mm.generate(None, ["Describe."], videos=[_video(10)], recipe=_recipe("dycoke"), max_new_tokens=3)[0]
    inputs = seen[0]
    video = (inputs.tags[VIDEO][0] > 0) & inputs.image_mask[0]
    cand = inputs.tags[CANDIDATE_TAG][0]
    (left,) = (video & ~cand).nonzero().squeeze(1).tolist()
    assert left == int(video.nonzero().max())  # the video's last slot
    assert int(inputs.tags[FRAME][0][left]) == 3 == int(inputs.tags[FRAME][0][video].max())
    assert out.stats["dycoke"]["candidates"] == out.n_vision_tokens - 1


# -- budgets per video ---------------------------------------------------------------------------------------
def test_budgets_are_per_video():
    """8 frames: 4 frame groups of 16 tokens. A budget counts the whole video (more than a group's 16 is
    fine, more than the video's 64 is refused naming 64), and the stats count the video's tokens."""
    mm = _mm()
    kw = dict(videos=[_video(8)], max_new_tokens=2)
    for tokens in (20, 50):
        out = mm.generate(None, ["Go."], recipe={"pruning": [{"method": "tome", "budget": {"tokens": tokens}}]}, **kw)
        assert out[0].n_vision_tokens == tokens == out[0].stats["tome"]["tokens"]
    out = mm.generate(None, ["Go."], recipe={"pruning": [{"method": "tome", "budget": {"ratio": 0.25}}]}, **kw)
    assert out[0].n_vision_tokens == 16
    for budget, kept in (({"tokens": 24}, 24), ({"ratio": 0.25}, 16)):
        recipe = {"pruning": [{"method": "fastvid", "params": {"tau": 2.0}, "budget": budget}]}
        out = mm.generate(None, ["Go."], recipe=recipe, **kw)[0]
        assert out.n_vision_tokens == kept == out.stats["fastvid"]["kept"]  # one-frame segments: B / F per group
    with pytest.raises(ConfigError, match=r"pruning\[0\]\.budget\.tokens: 65 .*\(64 vision tokens"):
        mm.generate(None, ["Go."], recipe={"pruning": [{"method": "fastvid", "budget": {"tokens": 65}}]}, **kw)
    with pytest.raises(ConfigError, match=r"ask for at least 16 tokens"):
        mm.generate(None, ["Go."], recipe={"pruning": [{"method": "tome", "budget": {"tokens": 10}}]}, **kw)
    prompts, videos = ["Go.", "Go on."], [_video(8, 1), _video(4, 2)]
    both = mm.generate(None, prompts, videos=videos, recipe={"pruning": [{"method": "tome", "budget": {"ratio": 0.5}}]})
    assert [r.n_vision_tokens for r in both] == [32, 16]


@pytest.mark.parametrize(
    ("family", "method", "item", "n"),
    [
        ("qwen3_vl", "fastvid", "video", 64),  # the stage sees the video as one item (4 groups of 16)
        ("qwen3_vl", "divprune", "frame group", 16),  # each frame group is its own item
        ("qwen2_5_vl", "divprune", "video", 64),  # the video is one item of grid (4, h, w)
    ],
)
def test_a_budget_a_video_cannot_meet_is_refused_before_the_tower(family, method, item, n):
    """The vision tokens of every item are known from its grid before the tower runs (t h w / merge^2): a
    ``tokens`` budget above them is refused then, naming the item the budget is per, and no tower block runs."""
    mm = _mm(family)
    calls = []
    handle = mm.adapter.vision_tower.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(ConfigError, match=rf"{n + 1} vision tokens per {item} is more than this {item} has \({n} "):
            recipe = {"pruning": [{"method": method, "budget": {"tokens": n + 1}}]}
            mm.generate(None, ["Go."], videos=[_video(8)], recipe=recipe, max_new_tokens=1)
        assert calls == []
        out = mm.generate(
            None,
            ["Go."],
            videos=[_video(8)],
            recipe={"pruning": [{"method": method, "budget": {"tokens": n}}]},
            max_new_tokens=1,
        )
    finally:
        handle.remove()
    assert calls == [1]  # the budget that fits ran the tower
    assert out[0].n_vision_tokens == (n if item == "video" else 4 * n)
