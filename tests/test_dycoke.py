"""DyCoke (mmfast/pruning/dycoke.py): TTM's kept tokens and DP's per-step selection equal direct ports
of the release's code (KD-TAO/DyCoke @dd74634) on the same tensors; the no-op setting is the baseline;
batch equals per sample; it runs on tiny OneVision and Qwen2.5-VL videos with fewer vision tokens;
an image-only batch is refused before compute (Qwen3-VL: tests/test_video_items.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import random_video, video_models

import mmfast
from mmfast import compat
from mmfast.config import load_recipe
from mmfast.errors import IncompatibleRecipeError
from mmfast.pipeline import Session
from mmfast.pruning.dycoke import DPInputs, dp_step, ttm_keep
from mmfast.runtime import LMRunner

_mm = video_models()


def _recipe(**params) -> dict:
    return {"pruning": [{"method": "dycoke", "params": {"l": 2, **params}}]}


# -- the release's code, ported line by line (llava_arch.dycole_ttm, PrunableDynamicCache) -------------
def _release_ttm(image_feature, num_tokens_per_frame, merging_ratio):
    num_frames = image_feature.shape[0] // num_tokens_per_frame
    merging_ratio = 1 - merging_ratio
    t = num_tokens_per_frame
    similarities = []
    for i in range(0, num_frames - 1, 2):
        f1 = torch.nn.functional.normalize(image_feature[i * t : (i + 1) * t], p=2, dim=1)
        f2 = torch.nn.functional.normalize(image_feature[(i + 1) * t : (i + 2) * t], p=2, dim=1)
        similarities.append(torch.nn.functional.cosine_similarity(f1, f2, dim=1))
    modified = []
    for i in range(0, num_frames - 1, 2):
        keep = similarities[i // 2].topk(int(merging_ratio * t), largest=False).indices
        modified.append(image_feature[i * t : (i + 1) * t])
        modified.append(image_feature[(i + 1) * t : (i + 2) * t][keep])
    for i in range(0, num_frames - 4, 4):
        f1, f2 = image_feature[i * t : (i + 1) * t], image_feature[(i + 2) * t : (i + 3) * t]
        keep = torch.nn.functional.cosine_similarity(f1, f2, dim=1).topk(int(merging_ratio * t), largest=False).indices
        modified[i] = f1
        modified[i + 2] = f2[keep]
    return torch.cat(modified, dim=0)


class _ReleaseDP:
    def __init__(self, start, img_len, p, threshold=0.9):  # the release's constant 0.9; lower in a test
        self.start, self.img_len, self.p, self.attention_score = start, img_len, p, None
        self.threshold = threshold

    def step(self, attention_avg, seq_len):  # dycoke_pruning + update_cache; None = full cache
        image_attention = attention_avg[self.start : self.start + self.img_len]
        if self.attention_score is not None:
            similarity = torch.nn.functional.cosine_similarity(image_attention, self.attention_score, dim=0)
        else:
            similarity = 0
        self.attention_score = image_attention
        if similarity < self.threshold:
            top = torch.topk(image_attention, int(self.img_len * (1 - self.p)), sorted=False)[1] + self.start
            full = torch.arange(seq_len)
            return torch.cat([full[: self.start], top, full[self.start + self.img_len :]]).tolist()
        return None


@pytest.mark.parametrize("n_frames", [8, 9, 12])
def test_ttm_keeps_the_release_tokens(n_frames):
    torch.manual_seed(n_frames)
    t, d = 6, 5
    feats = torch.randn(n_frames * t, d)
    feats[t : 2 * t] = feats[:t] + 0.1 * torch.randn(t, d)  # some near-duplicate frames
    kept = ttm_keep(feats.reshape(n_frames, t, d), 0.7)
    ours = torch.cat([feats.reshape(n_frames, t, d)[f][idx] for f, idx in enumerate(kept)])
    assert torch.equal(ours, _release_ttm(feats, t, 0.7))
    assert ours.shape[0] < feats.shape[0]


def test_dp_selection_follows_the_release_step_by_step():
    torch.manual_seed(0)
    start, img_len, seq = 3, 12, 20
    release = _ReleaseDP(start, img_len, 0.8)
    slots = torch.arange(seq)[None]  # [1, seq] one sample, every slot its own prompt slot
    cand = (slots >= start) & (slots < start + img_len)
    k = torch.tensor([[int(img_len * (1 - 0.8))]])
    prev, has_prev = torch.zeros(1, seq), torch.tensor([[False]])
    base = torch.rand(seq)
    outcomes = []
    for step in range(8):
        attn = base + (0.01 if step % 3 else 1.0) * torch.rand(seq)  # some steps similar, some not
        attn = attn / attn.sum()
        expected = release.step(attn, seq)
        drop, result = dp_step(attn[None], DPInputs(cand, slots, slots, k, prev, has_prev), 0.9)
        prev, has_prev = result.attention, torch.tensor([[True]])
        got = None if not result.pruned[0] else (~drop[0]).nonzero()[:, 0].tolist()  # the attended slots
        outcomes.append(got is None)
        if expected is None:
            assert got is None and not drop.any()
        else:
            assert sorted(expected) == got
    assert any(outcomes) and not all(outcomes)  # both branches of the rule were exercised


def test_dp_in_the_model_attends_what_the_release_keeps(monkeypatch):
    """OneVision, batch 1: at every decode step the layers >= l attend exactly the cache slots the
    release's ``PrunableDynamicCache`` keeps for the same layer l-1 attention row (video start = its
    first slot, ``image_token_length`` = TTM output - 1), or all of them when it keeps the full cache
    (threshold 0.5 instead of 0.9 in both, so that this random model has steps of both kinds)."""
    from mmfast.pruning.dycoke import DyCoke

    mm = _mm("llava_onevision")
    steps = []
    original = DyCoke._decode_step

    def spy(self, layer, hidden, state):
        original(self, layer, hidden, state)
        if hidden.shape[1] == 1:
            assert (self.layer, self.probe_name) == (2, "dycoke.1")  # l = 2: attention of layer l - 1
            grp = state.groups[state.group_of(self.layer)]
            attend = grp.fwd_mask[0, 0, 0]  # sdpa: bool [T]
            steps.append((self.ctx.probe[self.probe_name].probs[0, 0].clone(), attend.clone(), state.inputs))

    monkeypatch.setattr(DyCoke, "_decode_step", spy)
    out = mm.generate(None, ["Describe."], videos=[random_video(8)], recipe=_recipe(threshold=0.5), max_new_tokens=8)[0]
    inputs = steps[0][2]
    video = (inputs.tags["video"][0] > 0).nonzero().squeeze(1)
    start, n_ttm = int(video[0]), video.numel() - 1  # the TTM output, without the closing newline
    release = _ReleaseDP(start, n_ttm - 1, 0.8, threshold=0.5)  # this random model's steps straddle 0.5
    full_steps = 0
    for probs, attend, _ in steps:
        kept = release.step(probs, probs.shape[0])
        if kept is None:
            full_steps += 1
            assert bool(attend.all())
        else:
            assert sorted(kept) == attend.nonzero().squeeze(1).tolist()
    assert len(steps) == 7 and out.stats["dycoke"]["pruned_steps"] == 7 - full_steps
    assert 0 < full_steps < 7  # both branches of the rule ran


@pytest.mark.parametrize("family", ["llava_onevision", "qwen2_5_vl"])
def test_noop_settings_reproduce_the_baseline(family):
    mm = _mm(family)
    kw = dict(videos=[random_video(8)], max_new_tokens=6)
    base = mm.generate(None, ["Describe."], **kw)[0]
    noop = mm.generate(None, ["Describe."], recipe=_recipe(k=0.0, p=0.0), **kw)[0]
    assert noop.token_ids == base.token_ids and noop.n_vision_tokens == base.n_vision_tokens
    # DP installed (its own layer group and per-step mask) but never selecting: still the baseline
    never = mm.generate(None, ["Describe."], recipe=_recipe(k=0.0, threshold=-1.0), **kw)[0]
    assert never.token_ids == base.token_ids


@pytest.mark.parametrize("family", ["llava_onevision", "qwen2_5_vl"])
def test_prunes_a_video_with_fewer_vision_tokens(family):
    mm = _mm(family)
    kw = dict(videos=[random_video(8)], max_new_tokens=6)
    base = mm.generate(None, ["Describe."], **kw)[0]
    out = mm.generate(None, ["Describe."], recipe=_recipe(), **kw)[0]
    assert out.n_vision_tokens < base.n_vision_tokens
    frames, per = (8, 4) if family == "llava_onevision" else (4, 16)  # Qwen: temporal groups of 2 frames
    step_b = frames > 4  # the release's second pass runs for windows i < F - 4
    pruned_frames = frames // 2 + (1 if step_b else 0)
    newline = 1 if family == "llava_onevision" else 0
    assert out.n_vision_tokens == (frames - pruned_frames) * per + pruned_frames * int(0.3 * per) + newline
    st = out.stats["dycoke"]
    assert st["pruned_steps"] == 5  # every decode step re-selects on this random model
    assert st["dp_kept"] == int(st["candidates"] * 0.2)
    assert st["candidates"] == out.n_vision_tokens - 1 - newline
    # DP alone changes the answer against TTM alone, and a threshold no step passes prunes nothing
    ttm_only = mm.generate(None, ["Describe."], recipe=_recipe(p=0.0), **kw)[0]
    never = mm.generate(None, ["Describe."], recipe=_recipe(threshold=-1.0), **kw)[0]
    assert never.token_ids == ttm_only.token_ids and never.stats["dycoke"]["pruned_steps"] == 0
    # DP's mask reaches the layers >= l: the last layer's output at the first decode step differs
    assert not torch.allclose(_first_step_output(mm, _recipe()), _first_step_output(mm, _recipe(p=0.0)))


def _first_step_output(mm, recipe) -> torch.Tensor:
    """The last LLM layer's output [d] at the first single-token decode step."""
    seen = []

    def hook(module, args, output):
        out = output[0] if isinstance(output, tuple) else output
        if out.shape[1] == 1:
            seen.append(out[0, 0].detach().clone())

    handle = mm.adapter.layers[-1].register_forward_hook(hook)
    try:
        mm.generate(None, ["Describe."], videos=[random_video(8)], recipe=recipe, max_new_tokens=2)
    finally:
        handle.remove()
    return seen[0]


@pytest.mark.parametrize("family", ["llava_onevision", "qwen2_5_vl"])
def test_batch_equals_per_sample(family):
    mm = _mm(family)
    prompts, videos = ["Describe.", "What happens here?"], [random_video(8, 1), random_video(6, 2)]
    batch = mm.generate(None, prompts, videos=videos, recipe=_recipe(), max_new_tokens=5)
    for i in range(2):
        alone = mm.generate(None, [prompts[i]], videos=[videos[i]], recipe=_recipe(), max_new_tokens=5)[0]
        assert batch[i].token_ids == alone.token_ids
        assert batch[i].n_vision_tokens == alone.n_vision_tokens
        assert batch[i].stats["dycoke"]["pruned_steps"] == alone.stats["dycoke"]["pruned_steps"]


def test_images_only_is_refused():
    """An image-only batch is refused before compute (Qwen3-VL, whose frame groups are items, runs videos
    through the session's join: tests/test_video_items.py)."""
    from PIL import Image

    image = Image.fromarray(np.random.default_rng(5).integers(0, 255, (36, 44, 3), dtype=np.uint8))
    for family in ("qwen2_5_vl", "qwen3_vl"):
        with pytest.raises(IncompatibleRecipeError, match=r"dycoke.*needs a video.*videos="):
            _mm(family).generate([image], ["What?"], recipe=_recipe(), max_new_tokens=2)
    with pytest.raises(IncompatibleRecipeError, match="dycoke"):  # DP's per-step edit vs draft verification
        load_recipe({**_recipe(), "speculative": {"method": "prompt_lookup"}})


DECODER_PARAMS = {"beam": {"num_beams": 2}, "opera": {"num_beams": 2, "num_attn_candidates": 2}}
#: refused on these families whatever the pruner (damro: CLS, ritual: family, lqcd: images only), and
#: opera: it needs every generated token in the last layer's cache, which DP's per-step edit hides
REFUSED = {"damro", "lqcd", "opera", "ritual", "dycoke"}


@pytest.mark.parametrize("family", ["llava_onevision", "qwen2_5_vl"])
def test_every_decoder_and_a_stacked_pruner_on_a_video(family):
    """The compatibility matrix feeds images (refused here); on a video batch of 2, DyCoke with every
    decoder, and stacked with FastV / after DivPrune, generates or is refused naming the method."""
    from mmfast.registry import DECODERS

    mm = _mm(family)
    kw = dict(videos=[random_video(8, 1), random_video(6, 2)], max_new_tokens=3)
    # m3id is left out: it fails on any video, without DyCoke too ("prompt has 1 image slots but 0 images")
    recipes = {
        d: {**_recipe(), "decoding": {"method": d, "params": DECODER_PARAMS.get(d, {})}}
        for d in DECODERS.names()
        if d != "m3id"
    }
    recipes["+fastv"] = {"pruning": [*_recipe()["pruning"], {"method": "fastv", "params": {"k": 3, "drop_ratio": 0.5}}]}
    # TTM compares grid cells across frames: an earlier token edit is refused (needs_full_grid)
    recipes["dycoke"] = {"pruning": [{"method": "divprune", "params": {"ratio": 0.5}}, *_recipe()["pruning"]]}
    refused, problems = set(), []
    for name, recipe in recipes.items():
        try:
            out = mm.generate(None, ["Describe.", "What?"], recipe=recipe, **kw)
        except IncompatibleRecipeError as exc:
            refused.add(name)
            if f"({name})" not in str(exc):
                problems.append(f"{name}: refusal does not name it: {exc}")
            continue
        except Exception as exc:  # noqa: BLE001 - report every combination that crashes
            problems.append(f"{name}: {type(exc).__name__}: {exc}")
            continue
        assert len(out) == 2 and all(r.stats["dycoke"]["kept"] < r.stats["dycoke"]["before_ttm"] for r in out)
    assert not problems, "\n".join(problems)
    assert refused == REFUSED


@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava_onevision"])
def test_dp_runs_in_captured_static_steps(family, monkeypatch, caplog):
    """model.compile: DP's step is tensor work on inputs staged before each step, so DyCoke's decode steps run on the
    static cache and as captured graphs (CUDA-graph semantics emulated: the recorded ops replayed, Python frozen,
    host reads refused) with the tokens and per-sample pruned steps of compile off, at batch 2 and 1 (threshold 0.5:
    steps of both kinds); no fallback is logged."""
    import logging

    from mmfast._graph_emulator import ReplayEmulator
    from mmfast.pipeline import Session

    made = []

    class Graph(ReplayEmulator):
        def __init__(self) -> None:
            super().__init__()
            made.append(self)

    mm = _mm(family)
    prompts, videos = ["Describe.", "What?"], [random_video(8, 1), random_video(6, 2)]
    recipe = load_recipe(_recipe(threshold=0.5))

    def run(mode: str, n: int) -> tuple[list, list]:
        with mmfast.apply(mm, recipe, compile=mode) as s:
            out = s.generate(None, prompts[:n], videos=videos[:n], max_new_tokens=8)
        return [r.token_ids for r in out], [r.stats["dycoke"]["pruned_steps"] for r in out]

    for n in (2, 1):
        off = run("off", n)
        assert run("static", n) == off
        with monkeypatch.context() as m, caplog.at_level(logging.INFO, logger="mmfast"):
            m.setattr(Session, "_capture_factory", lambda self: Graph)
            made.clear()
            assert run("static", n) == off
        assert sum(g.replays for g in made) >= 5  # the decode steps replayed
        falls_back = ("without a captured graph", "dynamic KV cache")
        assert not [r for r in caplog.records if any(w in r.getMessage() for w in falls_back)]
        pruned = off[1]
        assert all(0 < p < len(t) - 1 for p, t in zip(pruned, off[0]))  # both kinds of step ran


@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava_onevision"])
def test_captured_dp_steps_serve_a_longer_prompt_on_the_same_buffers(family, monkeypatch):
    """A second call whose prompt is longer (or shorter) takes the first call's KV buffers and replays its decode
    graphs: DP's staged inputs are laid out on the buffers' capacity, not on the first prompt's length, so the replay
    reads this call's previous attention and slot maps (emulated graphs; tokens and pruned steps of compile off)."""
    from mmfast._graph_emulator import ReplayEmulator

    mm = _mm(family)
    recipe = load_recipe(_recipe(threshold=0.5))
    video = [random_video(8, 1)]
    short, long = "What?", "What? " + " ".join(["word"] * 6)

    buffers, lengths = [], []
    prefill = LMRunner.prefill

    def spy(self, inputs, **kw):
        state, out = prefill(self, inputs, **kw)
        if compat.is_static(state.cache):
            buffers.append(compat.static_buffers(state.cache))
            lengths.append(inputs.input_ids.shape[1])
        return state, out

    def run(mode: str, order: list[str]) -> list:
        with mmfast.apply(mm, recipe, compile=mode) as s:
            out = [s.generate(None, [p], videos=video, max_new_tokens=8)[0] for p in order]
        return [(r.token_ids, r.stats["dycoke"]["pruned_steps"]) for r in out]

    monkeypatch.setattr(LMRunner, "prefill", spy)
    for order in ([short, long], [long, short]):
        off = run("off", order)
        buffers.clear(), lengths.clear()
        with monkeypatch.context() as m:
            m.setattr(Session, "_capture_factory", lambda self: ReplayEmulator)
            assert run("static", order) == off, order
        assert lengths[0] != lengths[1] and buffers[0] == buffers[1]  # the second call took the first's buffers


def test_dp_after_an_in_llm_pruner_ranks_what_layer_l_minus_1_attends(monkeypatch):
    """Stacked after PyramidDrop (which drops video tokens before DyCoke's probe layer l - 1, and again at
    l), DP ranks the video tokens that layer l - 1 still attends by its attention row, as the release's
    rule does on that layout, and layers >= l attend the kept ones they still hold (the compatibility
    matrix on videos found an IndexError here: the row was read against the prompt's full layout)."""
    from mmfast.pruning.dycoke import DyCoke
    from mmfast.registry import PRUNERS

    mm = _mm("llava_onevision")
    steps = []
    original = DyCoke._decode_step

    def spy(self, layer, hidden, state):
        original(self, layer, hidden, state)
        if hidden.shape[1] == 1:
            probe, dp = state.groups[state.group_of(self.layer - 1)], state.groups[state.group_of(self.layer)]
            assert state.group_of(self.layer - 1) > 0  # an earlier stage changed the layout layer l - 1 attends
            probs = self.ctx.probe[self.probe_name].probs[0, 0, : probe.length].clone()
            attended = dp.source[0][dp.fwd_mask[0, 0, 0]].tolist()
            steps.append((probs, probe.source[0].tolist(), attended, dp.source[0].tolist()))

    monkeypatch.setattr(DyCoke, "_decode_step", spy)
    pyramid = {"method": "pyramiddrop", "params": PRUNERS.get("pyramiddrop").cls.test_params(mm.adapter)}
    recipe = {"pruning": [pyramid, *_recipe(threshold=0.5)["pruning"]]}
    out = mm.generate(None, ["Describe."], videos=[random_video(8)], recipe=recipe, max_new_tokens=8)[0]
    batch = mm.prepare(None, ["Describe."], videos=[random_video(8)])
    with Session(mm, load_recipe(_recipe(p=0.0))) as s:  # the TTM output's layout (the prompt slots)
        inputs = s.build_inputs(batch, s.encode(batch))
    frame_slots = ((inputs.tags["video"][0] > 0) & (inputs.patch_ids[0] >= 0)).nonzero().squeeze(1)
    candidates = set(frame_slots[:-1].tolist())  # the release's image_token_length: the last one left out
    source = steps[0][1]
    present = [i for i, s in enumerate(source) if s in candidates]  # cache slots of layer l - 1's candidates
    assert present == list(range(present[0], present[0] + len(present))) and len(present) < len(candidates)
    release = _ReleaseDP(present[0], len(present), 0.8, threshold=0.5)
    full_steps = 0
    for probs, step_source, attended, dp_source in steps:  # the cache grows by one slot per step
        kept = release.step(probs, probs.shape[0])
        if kept is None:
            full_steps += 1
            kept = range(probs.shape[0])
        kept_slots = {step_source[i] for i in kept}
        assert attended == [s for s in dp_source if s in kept_slots]
    assert out.stats["dycoke"]["pruned_steps"] == len(steps) - full_steps
    assert 0 < full_steps < len(steps)  # both branches of the rule ran


def test_dp_layer_outside_the_llm_is_refused_before_weights_load():
    """``l`` past the LLM's depth is refused from the model's config (``mmfast validate``), at its recipe path, as
    FastV's ``k``; with p = 0 (no DP) ``l`` is unused."""
    from mmfast.capabilities import ModelFacts, check_model
    from mmfast.errors import ConfigError
    from mmfast.models import ADAPTERS

    facts = ModelFacts("llava_onevision", 4, 4, (4, 4), ADAPTERS["llava_onevision"].features)
    with pytest.raises(ConfigError) as exc:
        check_model(load_recipe({"pruning": [{"method": "dycoke", "params": {"l": 40}}]}), facts)
    assert exc.value.path == "pruning[0].params.l" and "layer 40" in exc.value.detail
    assert check_model(load_recipe({"pruning": [{"method": "dycoke", "params": {"l": 40, "p": 0.0}}]}), facts) is None
