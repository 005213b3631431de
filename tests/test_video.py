"""Video input on Qwen2-VL, Qwen2.5-VL, Qwen3-VL and LLaVA-OneVision (tiny random models, fp32):
greedy through mmfast equals transformers' ``model.generate`` on the models' own video path
(``pixel_values_videos``, ``video_grid_thw``, ``second_per_grid_ts``) for one video, a video with an
image, and a batch of two videos of different lengths; the frame processing matches the image
processor and HF's timestamp rule; pruners run on video tokens and keep their (t, h, w) positions;
bad video input is refused before compute with a clear error."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import random_video, video_models
from PIL import Image

import mmfast
from mmfast.config import load_recipe
from mmfast.errors import InputError
from mmfast.models.base import FRAME, VIDEO
from mmfast.pipeline import Session

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava_onevision"]
N_NEW = 6
_mm = video_models()


def _image(seed: int = 5) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (36, 44, 3), dtype=np.uint8))


def _hf_inputs(mm, batch, inputs, b: int) -> dict:
    """transformers' inputs for sample ``b``: mmfast's expanded ids (the HF model checks the counts
    against its features) and the pixels in the model's own image / video arguments."""
    valid = inputs.attention_mask[b].bool()
    ids = inputs.input_ids[b][valid][None]
    out: dict = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    own = [i for i, o in enumerate(batch.image_owner) if o == b]
    imgs = [i for i in own if not batch.item(i).is_video]
    vids = [i for i in own if batch.item(i).is_video]
    fam = mm.adapter.family
    if fam == "llava_onevision":
        if imgs:
            out["pixel_values"], out["image_sizes"] = batch.pixel_values[imgs], batch.image_sizes[imgs]
        if vids:
            (i,) = vids
            out["pixel_values_videos"] = batch.pixel_values[i : i + 1, : batch.item(i).n_frames]
        return out
    rows = lambda idx: torch.cat([batch.pixel_values[i, : int(batch.image_sizes[i].prod())] for i in idx])  # noqa: E731
    if imgs:
        out["pixel_values"], out["image_grid_thw"] = rows(imgs), batch.image_sizes[imgs]
    if vids:
        out["pixel_values_videos"] = rows(vids)
        grids = batch.image_sizes[vids]
        # Qwen3-VL's items are the frame groups of one video: the processor's grid is (t, h, w)
        out["video_grid_thw"] = grids if fam != "qwen3_vl" else torch.tensor([[len(vids), *grids[0, 1:].tolist()]])
        if fam == "qwen2_5_vl":
            clip = batch.videos[b]
            out["second_per_grid_ts"] = torch.tensor([2 / clip.sampled_fps])
    kind = torch.zeros_like(ids)
    kind[ids == mm.adapter.image_token_id] = 1
    kind[ids == mm.adapter.video_token_id] = 2
    out["mm_token_type_ids"] = kind
    return out


def _hf_greedy(mm, hf: dict) -> list[int]:
    out = mm.model.generate(**hf, max_new_tokens=N_NEW, do_sample=False)[0, hf["input_ids"].shape[1] :].tolist()
    return out[: out.index(2)] if 2 in out else out


def _check_against_hf(mm, images, prompts, videos, **kw) -> list:
    with Session(mm, load_recipe({})) as s:
        batch = mm.prepare(images, prompts, videos=videos, **kw)
        inputs = s.build_inputs(batch, s.encode(batch))
    got = mm.generate(images, prompts, videos=videos, max_new_tokens=N_NEW, **kw)
    for b in range(len(prompts)):
        want = _hf_greedy(mm, _hf_inputs(mm, batch, inputs, b))
        assert got[b].token_ids == want, (b, got[b].token_ids, want)
    return got


@pytest.mark.parametrize("family", FAMILIES)
def test_one_video_greedy_equals_transformers(family):
    mm = _mm(family)
    out = _check_against_hf(mm, None, ["Describe the video."], [random_video(4)], video_fps=2.0)
    if family == "llava_onevision":  # 4 frames x (4 x 4 grid pooled to 2 x 2) + the closing newline
        assert out[0].n_vision_tokens == 4 * 2 * 2 + 1
    else:  # 28 px -> 32 px (multiple of patch 4 x merge 2): 4 frames / 2 per group x (8 / 2) ** 2 units
        assert out[0].n_vision_tokens == 2 * 4 * 4


@pytest.mark.parametrize("family", FAMILIES)
def test_video_and_image_greedy_equals_transformers(family):
    mm = _mm(family)
    _check_against_hf(mm, [_image()], ["What is shown?"], [random_video(3, seed=1)])


@pytest.mark.parametrize("family", FAMILIES)
def test_batch_of_two_videos_of_different_lengths_equals_transformers(family):
    mm = _mm(family)
    out = _check_against_hf(
        mm, None, ["Describe the video.", "What happens?"], [random_video(2, 2), random_video(6, 3)]
    )
    assert out[0].n_vision_tokens < out[1].n_vision_tokens


# -- frame processing ---------------------------------------------------------------------------------
def test_qwen_video_patches_equal_the_image_processor_on_a_still_video():
    """Two copies of one frame are what the image processor makes of that frame (it repeats an image
    on the temporal axis): the same resize, normalisation and patch order."""
    from mmfast.models._video import qwen_video_patches

    mm = _mm("qwen2_5_vl")
    frame = _image(7)  # 36 x 44: resized to multiples of 8
    want = mm.image_processor(images=[frame], return_tensors="pt")
    got, thw = qwen_video_patches([frame, frame], mm.video_settings)
    assert list(thw) == want["image_grid_thw"][0].tolist()
    torch.testing.assert_close(got, want["pixel_values"], atol=1e-5, rtol=0)


def test_onevision_frames_equal_the_image_processors_base_view():
    from mmfast.models._video import frames_tensor

    mm = _mm("llava_onevision")
    side = mm.adapter.vision_config.image_size
    frame = Image.fromarray(random_video(1, 9, (side, side))[0])
    base_view = mm.image_processor(images=[frame], return_tensors="pt")["pixel_values"][0, 0]
    torch.testing.assert_close(frames_tensor([frame], side, side, mm.video_settings)[0], base_view, atol=1e-5, rtol=0)


def test_qwen3_timestamps_follow_the_processor():
    from transformers import Qwen3VLProcessor

    from mmfast.models._video import qwen3_timestamps

    for idx, fps in (([0, 3, 6, 9, 12], 2.0), ([0, 1, 2, 3], None), ([5, 10, 15, 20, 25, 30], 30.0)):
        want = Qwen3VLProcessor._calculate_timestamps(None, list(idx), fps or 24, 2)
        assert qwen3_timestamps(idx, fps, 2) == want
    mm = _mm("qwen3_vl")
    text = mm.prepare(None, "Go.", videos=random_video(4), video_fps=2.0).texts[0]
    assert "<0.2 seconds><|vision_start|><|video_pad|><|vision_end|><1.2 seconds>" in text


def test_sampling_follows_the_processors_rules():
    from mmfast.video import FrameRule, VideoSampling, sample_indices

    qwen = FrameRule(2, 4, 768)
    # uniform: arange(0, T, T / n).int(); Qwen rounds n to a multiple of its temporal patch (2)
    assert sample_indices(10, VideoSampling(num_frames=3)) == [0, 3, 6]
    assert sample_indices(10, VideoSampling(num_frames=3), qwen) == [0, 2, 5, 7]
    # fps: T / video_fps * fps frames; Qwen clamps to min_frames (4) and floors to a multiple of 2
    assert sample_indices(8, VideoSampling(fps=1, video_fps=4)) == [0, 4]
    assert sample_indices(8, VideoSampling(fps=1, video_fps=4), qwen) == [0, 2, 4, 6]
    assert sample_indices(5, VideoSampling()) == [0, 1, 2, 3, 4]
    mm = _mm("qwen2_vl")
    batch = mm.prepare(None, "Go.", videos=random_video(10), num_frames=4)
    assert batch.videos[0].indices == [0, 2, 5, 7] and batch.image_sizes[0, 0] == 2


def test_frames_from_a_directory_sorted(tmp_path):
    mm = _mm("qwen2_vl")
    frames = random_video(4, 11)
    for i, f in enumerate(frames):  # written out of order; read back by sorted name
        Image.fromarray(f).save(tmp_path / f"f{3 - i:02d}.png")
    from_dir = mm.prepare(None, "Go.", videos=tmp_path)
    from_list = mm.prepare(None, "Go.", videos=[Image.fromarray(f) for f in frames[::-1]])
    assert torch.equal(from_dir.pixel_values, from_list.pixel_values)


# -- tags and pruning ---------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_video_tokens_carry_video_and_frame_tags(family):
    mm = _mm(family)
    with Session(mm, load_recipe({})) as s:
        batch = mm.prepare([_image()], ["What?"], videos=[random_video(4)])
        inputs = s.build_inputs(batch, s.encode(batch))
    video, frame = inputs.tags[VIDEO][0], inputs.tags[FRAME][0]
    is_video = inputs.input_ids[0] == mm.adapter.video_token_id
    assert torch.equal(video > 0, is_video) and int(inputs.image_mask[0].sum()) > int(is_video.sum())
    n_groups = 4 if family == "llava_onevision" else 2  # OneVision: frames; Qwen: groups of 2 frames
    assert sorted(set(frame[is_video].tolist())) == list(range(n_groups))
    assert frame[is_video].tolist() == sorted(frame[is_video].tolist())  # in time order
    assert not bool(frame[~is_video].any())


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize(
    "stage", [{"method": "divprune", "params": {"ratio": 0.5}}, {"method": "random", "params": {"fraction": 0.5}}]
)
def test_pre_llm_pruners_keep_video_tokens_positions(family, stage):
    """DivPrune and random drop on a video + image: fewer vision tokens, each kept video token keeps
    its unpruned (t, h, w) ids (Qwen2.5-VL: the scaled temporal id), and the text after keeps its
    positions."""
    mm = _mm(family)
    args = ([_image()], ["What?"])
    kw = dict(videos=[random_video(6)], video_fps=1.0)  # Qwen2.5-VL: second_per_grid_t 2 -> temporal step 4
    with Session(mm, load_recipe({})) as s:
        batch = mm.prepare(*args, **kw)
        base = s.build_inputs(batch, s.encode(batch))
    with Session(mm, load_recipe({"pruning": [stage]})) as s:
        batch = mm.prepare(*args, **kw)
        pruned = s.build_inputs(batch, s.encode(batch))
    vb, vp = base.image_mask[0], pruned.image_mask[0]
    assert int(vp.sum()) < int(vb.sum())
    key = lambda x, m: list(zip(x.image_index[0][m].tolist(), x.patch_ids[0][m].tolist()))  # noqa: E731
    where = dict(zip(key(base, vb), base.position_ids[0][vb].tolist()))
    assert [where[k] for k in key(pruned, vp)] == pruned.position_ids[0][vp].tolist()
    kept_video = pruned.tags[VIDEO][0] > 0
    assert bool(kept_video.any()) and int(kept_video.sum()) < int((base.tags[VIDEO][0] > 0).sum())
    if family == "qwen2_5_vl":
        assert int(pruned.position_ids[0][kept_video][:, 0].max() - pruned.position_ids[0][kept_video][:, 0].min()) > 2
    n_after = int(base.text_after_image[0].sum())
    assert torch.equal(pruned.position_ids[0, -n_after:], base.position_ids[0, -n_after:])
    out = mm.generate(*args, recipe={"pruning": [stage]}, max_new_tokens=3, **kw)
    assert out[0].n_vision_tokens == int(vp.sum())


def test_fastv_prunes_video_tokens_inside_the_llm():
    mm = _mm("qwen2_5_vl")
    recipe = {"pruning": [{"method": "fastv", "params": {"k": 1, "drop_ratio": 0.5}}]}
    out = mm.generate(None, ["Describe."], videos=[random_video(4)], recipe=recipe, max_new_tokens=3)
    assert out[0].vision_tokens_layer_avg < out[0].n_vision_tokens


@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava_onevision"])
@pytest.mark.parametrize("method", ["dart", "pyramiddrop", "sparsevlm"])
def test_in_llm_pruners_drop_video_tokens_keeping_their_positions(family, method):
    """The in-LLM pruners act on a video's tokens as on an image's: fewer tokens in the later layers,
    every kept slot with its prefill token's positions (M-RoPE (t, h, w) ids on Qwen)."""
    from mmfast.config import load_recipe
    from mmfast.pipeline import Session
    from mmfast.registry import PRUNERS

    mm = _mm(family)
    stage = {"method": method, "params": PRUNERS.get(method).cls.test_params(mm.adapter)}
    batch = mm.prepare(None, ["Describe."], videos=[random_video(4)])
    with Session(mm, load_recipe({"pruning": [stage]})) as s:
        inputs = s.build_inputs(batch, s.encode(batch))
        state, _ = s.runner.prefill(inputs)
    assert len(state.groups) > 1
    vision = inputs.image_mask[0]
    for grp in state.groups[1:]:
        valid = grp.key_mask[0]
        src = grp.source[0][valid]
        assert 0 < int(vision[src].sum()) < int(vision.sum())  # video tokens dropped, some kept
        if not grp.compact:  # M-RoPE: the original ids (LLaVA-style families renumber compactly)
            assert torch.equal(grp.positions[0][valid], inputs.position_ids[0][src])


@pytest.mark.parametrize("method", [None, "dart"])
def test_a_new_token_has_one_position_in_every_layer_group_when_the_top_video_token_is_dropped(method):
    """A Qwen2.5-VL video's temporal ids pass the text after it (frame groups 4 ids apart here), so its last
    frame group holds the sample's top position. A layer group that drops those tokens in the LLM keeps its
    slots' ids; a generated token takes the same position in it as in the layers before (group 0's, HF's
    rope_deltas), not its own top + 1 (which put it below kept video tokens, and at another position per
    layer group)."""
    from mmfast.config import load_recipe
    from mmfast.pipeline import Session

    mm = _mm("qwen2_5_vl")
    batch = mm.prepare(None, ["Describe."], videos=[random_video(16, 1, (28, 36))], video_fps=1.0)
    recipe = {} if method is None else {"pruning": [{"method": method, "budget": {"ratio": 0.5}}]}
    with Session(mm, load_recipe(recipe)) as s:
        inputs = s.build_inputs(batch, s.encode(batch))
        top = inputs.position_ids[0].amax(-1)  # [L]
        vision = inputs.image_mask[0]
        assert top[vision].max() > top[~vision].max()  # the video holds the top position
        if method is None:  # drop the tokens at the top position at layer 2
            s.runner.prune_at(2, lambda view: ~(view.vision & (top == top.max())[None]))
        state, out = s.runner.prefill(inputs)
        want = int(top.max()) + 1
        assert any(int(g.next_positions()) < want for g in state.groups[1:])  # a group dropped the top token
        for _ in range(2):
            s.runner.step(state, torch.tensor([[7]]))
            assert [g.positions[0, -1].tolist() for g in state.groups] == [[want] * 3] * len(state.groups)
            want += 1


# -- bad input ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llava", "llava_next"])
def test_family_without_video_refuses_videos(family):
    from mmfast.models import factory

    model, proc = factory.random_llava(seed=0) if family == "llava" else factory.random_llava_next(seed=0)
    mm = mmfast.load(model, proc)
    with pytest.raises(InputError, match=rf"{family} model, which has no video input; pass the frames as images"):
        mm.generate(None, "Describe.", videos=random_video(2), max_new_tokens=2)


@pytest.mark.parametrize(
    ("video", "kw", "match"),
    [
        ([], {}, "video 0 has no frames"),
        (np.zeros((0, 8, 8, 3), np.uint8), {}, "video 0 has no frames"),
        (np.zeros((2, 8, 8), np.uint8), {}, r"shape \(2, 8, 8\); a video array is \[T, H, W, 3\]"),
        ("no_such_clip.mp4", {}, r"video 0 'no_such_clip\.mp4' not found"),
        ("notes.txt", {}, "is not a directory of frames nor a video file"),
        (random_video(4), {"num_frames": 8}, "asked for 8 frames but the video has 4"),
        (random_video(4), {"num_frames": 2, "fps": 1.0}, "num_frames and fps both given"),
        (random_video(4), {"fps": 1.0}, "needs the source's frame rate; pass video_fps="),
        ([Image.new("RGB", (28, 28)), Image.new("RGB", (30, 28))], {}, "frames of different sizes"),
        ([random_video(2)], {}, r"frame 0 is a uint8 array of shape \(2, 28, 28, 3\), not a uint8 \[H, W, 3\] frame"),
        ([Image.new("RGB", (28, 28)), 3], {}, "frame 1 is a int; frames are PIL images"),
    ],
)
def test_bad_videos_are_refused_before_compute(video, kw, match):
    with pytest.raises(InputError, match=match):
        _mm("qwen2_vl").prepare(None, "Go.", videos=video, **kw)


@pytest.mark.parametrize(
    ("images", "videos", "bare"),
    [(None, [None], 0), (None, [random_video(2), None], 1), ([None, _image()], [None, None], 0)],
)
def test_a_sample_with_neither_image_nor_video_is_refused(images, videos, bare):
    """With ``videos=``, a sample whose video is None and that has no image is refused as without videos (it
    crashed in the pixel packing, or slipped through as a text-only row)."""
    prompts = ["Go."] * len(videos)
    with pytest.raises(InputError, match=f"prompt {bare} has no image; pass an image \\(or a video"):
        _mm("qwen2_vl").prepare(images, prompts, videos=videos)


def test_unreadable_frame_and_empty_directory(tmp_path):
    mm = _mm("llava_onevision")
    with pytest.raises(InputError, match="is a directory without frame images"):
        mm.prepare(None, "Go.", videos=tmp_path)
    Image.new("RGB", (28, 28)).save(tmp_path / "a.png")
    (tmp_path / "b.png").write_bytes(b"not a png")
    with pytest.raises(InputError, match=r"video 0, frame 1: image .*b\.png' cannot be read"):
        mm.prepare(None, "Go.", videos=tmp_path)


def test_video_longer_than_the_context_is_refused(monkeypatch):
    mm = _mm("qwen2_vl")
    monkeypatch.setattr(mm.adapter.text_config, "max_position_embeddings", 40)
    with pytest.raises(InputError, match=r"video 0: 6 frames make 48 vision tokens; .* over the context .*num_frames="):
        mm.prepare(None, "Describe the video.", videos=random_video(6))


@pytest.mark.parametrize("decoding", ["vcd", "beam", "m3id"])
def test_decoders_run_on_a_video(decoding):
    """Contrastive and beam decoders take a video + image batch (VCD noises every item's pixels; M3ID's
    vision-free branch drops the video's placeholder as well as the image's)."""
    mm = _mm("qwen2_5_vl")
    out = mm.generate(
        [_image(), None],
        ["What?", "Go."],
        videos=[random_video(2), random_video(4)],
        decoding=decoding,
        max_new_tokens=3,
    )
    assert len(out) == 2 and all(r.token_ids for r in out)


def test_a_method_that_reprompts_images_refuses_a_video():
    from mmfast.errors import IncompatibleRecipeError

    mm = _mm("qwen2_5_vl")
    with pytest.raises(IncompatibleRecipeError, match=r"decoding \(lqcd\) takes images only \(its branch re-prompts"):
        mm.generate(None, "Go.", videos=random_video(2), recipe={"decoding": {"method": "lqcd"}}, max_new_tokens=2)


def test_video_settings_come_from_the_checkpoints_video_processor(tmp_path):
    """A checkpoint's ``video_preprocessor_config.json`` (or the ``video_processor`` entry of its
    ``processor_config.json``) sets the frame size, not the image processor's."""
    import json

    from mmfast.models.factory import random_qwen_vl, save_model

    path = save_model(*random_qwen_vl("qwen2_vl", seed=1), tmp_path / "q")
    default = mmfast.load(path, device="cpu").prepare(None, "Go.", videos=random_video(2))
    assert default.image_sizes[0].tolist() == [1, 8, 8]  # the image processor's pixel range: 28 -> 32 px
    small = {"size": {"shortest_edge": 8 * 8, "longest_edge": 16 * 16}, "temporal_patch_size": 2}
    (path / "video_preprocessor_config.json").write_text(json.dumps(small))
    mm = mmfast.load(path, device="cpu")
    assert mm.video_settings.source.endswith("video_preprocessor_config.json")
    assert mm.prepare(None, "Go.", videos=random_video(2)).image_sizes[0].tolist() == [1, 4, 4]  # 28 -> 16 px
    (path / "video_preprocessor_config.json").unlink()
    proc = (
        json.loads((path / "processor_config.json").read_text()) if (path / "processor_config.json").is_file() else {}
    )
    (path / "processor_config.json").write_text(json.dumps({**proc, "video_processor": small}))
    assert mmfast.load(path, device="cpu").prepare(None, "Go.", videos=random_video(2)).image_sizes[0].tolist() == [
        1,
        4,
        4,
    ]


def test_cli_run_with_a_video_directory(tmp_path, tiny_dir, capsys):
    """``mmfast run --video DIR``: answers on a video family; exit 2 with the family's reason on LLaVA."""
    from mmfast.cli import main
    from mmfast.models.factory import random_qwen_vl, save_model

    frames = tmp_path / "frames"
    frames.mkdir()
    for i, f in enumerate(random_video(4, 13)):
        Image.fromarray(f).save(frames / f"{i:03d}.png")
    qwen = save_model(*random_qwen_vl("qwen2_5_vl", seed=1), tmp_path / "q")
    args = ["--video", str(frames), "--prompt", "Describe.", "--max-new-tokens", "2", "--json"]
    for name, model in (("q.yaml", qwen), ("l.yaml", tiny_dir)):
        (tmp_path / name).write_text(f"model: {{name: {model}, device: cpu}}\n")
    assert main(["run", str(tmp_path / "q.yaml"), *args, "--num-frames", "2", "--video-fps", "4"]) == 0
    assert '"n_vision_tokens": 16' in capsys.readouterr().out  # 2 frames = 1 group of 4 x 4 units
    assert main(["run", str(tmp_path / "l.yaml"), *args]) == 2
    assert "llava model, which has no video input" in capsys.readouterr().err


def test_context_check_after_the_tower_names_the_video(monkeypatch):
    """With the prompt within the context but no room for max_new_tokens, the session's check names
    the sample's video and its frames."""
    mm = _mm("qwen2_5_vl")
    monkeypatch.setattr(mm.adapter.text_config, "max_position_embeddings", 60)
    with pytest.raises(InputError, match=r"32 vision tokens \(0 image\(s\), a video of 4 frames\) \+ 20 new tokens"):
        mm.generate(None, "Go.", videos=random_video(4), max_new_tokens=20)


def test_a_video_placeholder_in_the_prompt_text_is_refused():
    mm = _mm("qwen2_vl")
    with pytest.raises(InputError, match=r"prompt 0 contains the video placeholder '<\|video_pad\|>'"):
        mm.prepare([_image()], ["What is <|video_pad|> here?"])


def test_divprune_on_a_onevision_video():
    """DivPrune keeps a fraction of the video's pooled tokens (and newline) on OneVision; the kept
    tokens keep their frame tags."""
    mm = _mm("llava_onevision")
    stage = {"method": "divprune", "params": {"ratio": 0.5}}
    with Session(mm, load_recipe({"pruning": [stage]})) as s:
        batch = mm.prepare(None, ["Go."], videos=[random_video(4)])
        pruned = s.build_inputs(batch, s.encode(batch))
    kept = pruned.image_mask[0]
    assert int(kept.sum()) == round(0.5 * (4 * 4 + 1))
    assert bool((pruned.tags[VIDEO][0][kept] == 1).all())
    assert set(pruned.tags[FRAME][0][kept].tolist()) <= {0, 1, 2, 3}


@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava_onevision"])
def test_prompt_lookup_drafts_equal_greedy_on_a_video(family):
    mm = _mm(family)
    args = (None, ["Describe.", "What happens?"])
    kw = dict(videos=[random_video(2, 4), random_video(4, 5)], max_new_tokens=10)
    greedy = mm.generate(*args, **kw)
    spec = mm.generate(*args, recipe={"speculative": {"method": "prompt_lookup"}}, **kw)
    assert [r.token_ids for r in spec] == [r.token_ids for r in greedy]


class _PerItem:
    """A stage's ``tower_per_image`` answer (``Pruner.tower_per_image``): one item a tower call."""

    def tower_per_image(self) -> bool:
        return True


def test_per_item_tower_calls_equal_one_call():
    """A stage that needs the tower one item at a time (``tower_per_image``) gets the same tokens,
    tags and positions for a video + image batch."""
    mm = _mm("qwen2_5_vl")
    got = []
    for per_item in (False, True):
        with Session(mm, load_recipe({})) as s:
            s._tower_per_image = [_PerItem()] if per_item else []  # a stage that asks for one item a tower call
            batch = mm.prepare(
                [_image(), None], ["What?", "Go."], videos=[random_video(2), random_video(4)], video_fps=3.0
            )
            got.append(s.build_inputs(batch, s.encode(batch)))
    a, b = got
    torch.testing.assert_close(a.embeds, b.embeds, atol=1e-5, rtol=1e-5)
    assert torch.equal(a.position_ids, b.position_ids) and a.tags.keys() == b.tags.keys()
    assert all(torch.equal(a.tags[k], b.tags[k]) for k in (VIDEO, FRAME))


def test_qwen3_sampling_follows_its_processor():
    """Qwen3-VL's processor keeps ``num_frames`` as asked (no rounding to the temporal patch) and spreads
    the indices with ``linspace(0, T - 1, n).round()``; fps sampling is clamped, not floored to 2."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    mm, proc = _mm("qwen3_vl"), Qwen3VLVideoProcessor()
    for total, kw in ((10, {"num_frames": 4}), (10, {"num_frames": 3}), (10, {"num_frames": 5}), (9, {"fps": 1.0})):
        got = mm.prepare(None, "Go.", videos=random_video(total), video_fps=1.0, **kw).videos[0].indices
        want = proc.sample_frames(VideoMetadata(total_num_frames=total, fps=1.0), **kw).tolist()
        assert got == want, (total, kw, got, want)


def test_qwen3_frame_size_bounds_the_whole_video(tmp_path):
    """Qwen3VLVideoProcessor's ``smart_resize`` bounds t x h x w (the whole video), not one frame."""
    import json

    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

    from mmfast.models.factory import random_qwen_vl, save_model

    path = save_model(*random_qwen_vl("qwen3_vl", seed=1), tmp_path / "q3")
    conf = {"size": {"shortest_edge": 64, "longest_edge": 8192}, "temporal_patch_size": 2}
    (path / "video_preprocessor_config.json").write_text(json.dumps(conf))
    mm = mmfast.load(path, device="cpu")
    s = mm.video_settings
    for n_frames, side in ((8, 64), (3, 64), (2, 8)):
        h, w = smart_resize(n_frames, side, side, 2, s.patch_size * s.merge_size, 64, 8192)
        grid = mm.prepare(None, "Go.", videos=random_video(n_frames, 1, (side, side))).image_sizes[0].tolist()
        assert grid == [1, h // s.patch_size, w // s.patch_size], (n_frames, side, grid, h, w)


def test_a_video_config_with_min_and_max_pixels_sets_the_frame_size(tmp_path):
    """A ``video_preprocessor_config.json`` in the older Qwen-VL style (``min_pixels`` / ``max_pixels``, which
    ``Qwen2VLVideoProcessor`` lets override ``size``) bounds the frames, not the image processor's ``size``
    (which used to win: the video config's own bounds were ignored)."""
    import json

    from mmfast.models.factory import random_qwen_vl, save_model

    path = save_model(*random_qwen_vl("qwen2_vl", seed=1), tmp_path / "q")
    for conf in (
        {"min_pixels": 8 * 8, "max_pixels": 16 * 16, "temporal_patch_size": 2},
        {"size": {"shortest_edge": 256, "longest_edge": 4096}, "min_pixels": 8 * 8, "max_pixels": 16 * 16},
    ):
        (path / "video_preprocessor_config.json").write_text(json.dumps(conf))
        mm = mmfast.load(path, device="cpu")
        assert mm.video_settings.size == {"shortest_edge": 64, "longest_edge": 256}
        assert mm.prepare(None, "Go.", videos=random_video(2)).image_sizes[0].tolist() == [1, 4, 4]  # 28 -> 16 px
