"""``mmfast eval`` with video inputs: the ``video_pope`` task over a tiny generated video world, on a
tiny random Qwen2.5-VL saved to a directory (CPU, fp32, seconds).

Records and metrics are written (the official POPE rule, the clip as the intervals' unit, unparsed
answers counted); an interrupted run resumes without redoing, losing or duplicating samples and ends
with the uninterrupted run's answers and metrics; a clip whose frames change is recomputed; each
answer equals a direct ``generate(videos=...)`` of the sample's clip; a family without video input
(LLaVA), a missing or invalid video world and impossible settings are refused before compute (exit 2).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import mmfast
from mmfast.cli import main
from mmfast.config import load_recipe
from mmfast.eval import runner
from mmfast.eval.pope import PopeRecord, score_pope
from mmfast.eval.runner import run_eval
from mmfast.eval.unparsed import TaskUnparsed, pope_unparsed
from mmfast.world.video_pope import read_video_pope

N_NEW = 3
FRAMES = 4  # of the clips' 8


@pytest.fixture(scope="module")
def vworld(tmp_path_factory) -> Path:
    """3 clips of 8 frames at 32 x 32 px, 2 drawn for POPE: 12 questions per split."""
    from mmfast.world.video import write_video_world
    from mmfast.world.video_render import VideoConfig

    root = tmp_path_factory.mktemp("vworld")
    write_video_world(
        root, seed=0, n_clips=3, pope_clips=2, config=VideoConfig(frames=8, image_size=32), progress=False
    )
    return root


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> Path:
    from mmfast.models.factory import random_qwen_vl, save_model

    model, processor = random_qwen_vl("qwen2_5_vl", seed=1)
    return save_model(model, processor, tmp_path_factory.mktemp("qwen25"))


@pytest.fixture(scope="module")
def qwen_mm(qwen_dir):
    return mmfast.load(qwen_dir, device="cpu", dtype="float32")


def _data(model: Path, world: Path, out: Path, **task) -> dict:
    opts = {"video_world": str(world), "max_new_tokens": N_NEW, "num_frames": FRAMES, **task}
    return {
        "name": "vpope",
        "model": {"name": str(model), "device": "cpu", "dtype": "float32"},
        "eval": {"tasks": ["video_pope"], "video_pope": opts, "batch_size": 2},
        "output": {"dir": str(out)},
    }


def _recipe(model: Path, world: Path, out: Path, batch_size: int = 2, **task):
    data = _data(model, world, out, **task)
    data["eval"]["batch_size"] = batch_size
    return load_recipe(data)


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def _answers(path: Path) -> dict[str, tuple]:
    return {r["doc_id"]: (r["resps"], r["filtered_resps"], r["fingerprint"]) for r in _lines(path)}


def test_cli_eval_writes_records_and_pope_metrics(qwen_dir, vworld, tmp_path, capsys):
    cfg = tmp_path / "r.yaml"
    cfg.write_text(json.dumps(_data(qwen_dir, vworld, tmp_path / "run", splits=["random", "adversarial"])))
    assert main(["-q", "eval", str(cfg)]) == 0
    printed = capsys.readouterr().out
    assert "video_pope random" in printed and "not a result" in printed
    assert next(ln for ln in printed.splitlines() if ln.startswith("video_pope unparsed")).split()[2] == "24"
    recs = _lines(tmp_path / "run" / "samples.jsonl")
    qs = {s: read_video_pope(vworld / "pope" / f"video_pope_{s}.json") for s in ("random", "adversarial")}
    assert len(recs) == len({r["doc_id"] for r in recs}) == 24
    for split, questions in qs.items():
        mine = [r for r in recs if r["task"] == f"video_pope_{split}"]
        assert [r["meta"]["question_id"] for r in mine] == [q.question_id for q in questions]
        assert [(r["video"], r["prompt"], r["target"]) for r in mine] == [(q.video, q.text, q.label) for q in questions]
        assert all("image" not in r and r["n_vision_tokens"] == 2 * 4 * 4 for r in mine)  # 4 frames, 2 per group
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["counts"] == {"planned": 24, "finished": 24, "failed": 0, "not_run": 0, "quarantined_lines": 0}
    m = summary["metrics"]["video_pope"]
    for split in ("random", "adversarial"):  # the official rule on the records' raw answers
        mine = [r for r in recs if r["task"] == f"video_pope_{split}"]
        want = score_pope([PopeRecord(r["meta"]["question_id"], r["target"], r["resps"][0][0]) for r in mine])
        assert {k: m[split][k] for k in ("accuracy", "f1", "tp", "fp", "tn", "fn", "n_unknown")} == {
            "accuracy": want.accuracy,
            "f1": want.f1,
            "tp": want.counts.tp,
            "fp": want.counts.fp,
            "tn": want.counts.tn,
            "fn": want.counts.fn,
            "n_unknown": want.counts.n_unknown,
        }
        assert len(m[split]["f1_ci95"]) == 2
    assert m["n_units"] == 2  # the clips are the resampled units
    assert m["unparsed"]["n"] == 24 and m["unparsed"]["k"] == sum(pope_unparsed(r["resps"][0][0]) for r in recs)
    proto = summary["protocol"]["tasks"]["video_pope"]
    world = json.loads((vworld / "video_world.json").read_text())
    assert proto["files"]["random"]["sha256"] == world["sha256"]["pope/video_pope_random.json"]
    assert proto["num_frames"] == FRAMES and "no shipped model" in proto["accuracy"]
    # mmfast report: the run's video POPE rows, unparsed answers counted by the official rule
    assert main(["-q", "report", str(tmp_path / "run"), "--output", str(tmp_path / "rep")]) == 0
    md = (tmp_path / "rep" / "report.md").read_text()
    k = m["unparsed"]["k"]
    assert f"| run | random | 12 | {m['random']['f1']:.3f} [" in md and "| run | adversarial | 12 |" in md
    assert f"| run | mean | 24 | {m['mean_f1']:.3f} [" in md and f"| {TaskUnparsed(k, 24).cell()}" in md


def test_answers_equal_direct_generate(qwen_mm, qwen_dir, vworld, tmp_path, monkeypatch):
    monkeypatch.setenv("MMFAST_CACHE", str(tmp_path / "cache"))
    run_eval(_recipe(qwen_dir, vworld, tmp_path / "run", splits=["popular"]), limit=4, mm=qwen_mm)
    assert not list((tmp_path / "cache").glob("world-*"))  # a video-only evaluation generates no image world
    recs = _lines(tmp_path / "run" / "samples.jsonl")
    assert len(recs) == 4
    clips = [vworld / "clips" / r["video"] for r in recs]
    got = qwen_mm.generate(None, [r["prompt"] for r in recs], videos=clips, num_frames=FRAMES, max_new_tokens=N_NEW)
    for r, g, clip in zip(recs, got, clips):
        (one,) = qwen_mm.generate(None, r["prompt"], videos=clip, num_frames=FRAMES, max_new_tokens=N_NEW)
        assert r["resps"] == [[g.text]] == [[one.text]]
        assert r["n_vision_tokens"] == g.n_vision_tokens == one.n_vision_tokens


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl", "llava_onevision"])
def test_every_video_family_answers_as_direct_generate(family, vworld, tmp_path):
    from mmfast.models.factory import random_llava_onevision, random_qwen_vl

    model, processor = random_llava_onevision(seed=1) if family == "llava_onevision" else random_qwen_vl(family, seed=1)
    mm = mmfast.load(model, processor)
    recipe = _recipe(Path("unused"), vworld, tmp_path / "run", batch_size=3, splits=["adversarial"])
    run_eval(recipe, limit=3, mm=mm)
    recs = _lines(tmp_path / "run" / "samples.jsonl")
    assert len(recs) == 3 and all("error" not in r for r in recs)
    for r in recs:  # batched in the evaluation, one by one here
        (one,) = mm.generate(
            None, r["prompt"], videos=vworld / "clips" / r["video"], num_frames=FRAMES, max_new_tokens=N_NEW
        )
        assert r["resps"] == [[one.text]] and r["n_vision_tokens"] == one.n_vision_tokens


def test_interrupted_run_resumes_to_the_uninterrupted_result(qwen_mm, qwen_dir, vworld, tmp_path, monkeypatch):
    whole = run_eval(_recipe(qwen_dir, vworld, tmp_path / "whole", batch_size=1), mm=qwen_mm)
    out = tmp_path / "cut"
    real, calls = runner._run_batch, []

    def stop_after_three(*args, **kwargs):
        if len(calls) == 3:
            raise KeyboardInterrupt
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "_run_batch", stop_after_three)
    with pytest.raises(KeyboardInterrupt):
        run_eval(_recipe(qwen_dir, vworld, out, batch_size=2), mm=qwen_mm)
    monkeypatch.setattr(runner, "_run_batch", real)
    before = (out / "samples.jsonl").read_text().splitlines()
    assert len(before) == 6  # 3 batches of 2 saved as they came
    resumed = run_eval(_recipe(qwen_dir, vworld, out, batch_size=3), mm=qwen_mm)  # batch_size changes no answer
    after = (out / "samples.jsonl").read_text().splitlines()
    assert after[:6] == before  # kept, not redone
    ids = [json.loads(x)["doc_id"] for x in after]
    assert len(ids) == len(set(ids)) == 36
    assert _answers(out / "samples.jsonl") == _answers(tmp_path / "whole" / "samples.jsonl")
    assert resumed["metrics"] == whole["metrics"]
    assert resumed["protocol"]["samples_digest"] == whole["protocol"]["samples_digest"]

    # a clip whose frames change under the same path: its questions (and only those) are recomputed
    clip = json.loads(after[0])["video"]
    frame = vworld / "clips" / clip / "frame_003.png"
    original = frame.read_bytes()
    try:
        Image.fromarray(np.full((32, 32, 3), 7, dtype=np.uint8)).save(frame)
        again = run_eval(_recipe(qwen_dir, vworld, out, batch_size=3), mm=qwen_mm)
    finally:
        frame.write_bytes(original)
    n_clip = sum(1 for x in after if json.loads(x)["video"] == clip)
    assert len((out / "samples.jsonl").read_text().splitlines()) == 36  # compacted: one current record each
    fresh = _answers(out / "samples.jsonl")
    old = _answers(tmp_path / "whole" / "samples.jsonl")
    changed = [d for d in fresh if fresh[d][2] != old[d][2]]
    assert len(changed) == n_clip and again["counts"]["finished"] == 36


def test_llava_is_refused_before_compute(tiny_dir, vworld, tmp_path, capsys):
    cfg = tmp_path / "r.yaml"
    cfg.write_text(json.dumps(_data(tiny_dir, vworld, tmp_path / "run")))
    assert main(["-q", "eval", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "llava model, which takes no video input" in err and "qwen2_5_vl" in err
    assert not (tmp_path / "run").exists()  # refused before the model loaded or anything was written


def test_llava_model_object_is_refused(tiny_mm, tiny_dir, vworld, tmp_path):
    from mmfast.errors import IncompatibleRecipeError

    with pytest.raises(IncompatibleRecipeError, match="takes no video input"):
        run_eval(_recipe(tiny_dir, vworld, tmp_path / "run"), mm=tiny_mm)


def _copy(vworld: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(vworld, tmp_path / "copy"))


def _edited_world(vworld: Path, tmp_path: Path) -> Path:
    bad = _copy(vworld, tmp_path)
    path = bad / "pope" / "video_pope_random.json"
    path.write_text(path.read_text().replace('"label": "yes"', '"label": "no"', 1))
    return bad


def _clip_of_first_question(world: Path) -> Path:
    return world / "clips" / read_video_pope(world / "pope" / "video_pope_random.json")[0].video


@pytest.mark.parametrize(
    "case, message",
    [
        ("unset", "eval.video_pope.video_world: set it to a directory written by the video world generator"),
        ("missing", "is not a directory; write the video world there first"),
        ("not_a_world", "is not a video world (no video_world.json)"),
        ("edited", "is not the question file its video world wrote"),
        ("too_many_frames", "eval.video_pope.num_frames: 9 frames asked, but the clips"),
        ("fps_without_rate", "eval.video_pope.fps: fps sampling needs the clips' frame rate"),
        ("missing_clip", "1 video(s) of this evaluation are missing"),
    ],
)
def test_bad_video_world_or_settings_exit_2(case, message, qwen_dir, vworld, tmp_path, capsys):
    world, task = vworld, {}
    if case == "unset":
        task["video_world"] = None
    elif case == "missing":
        world = tmp_path / "nowhere"
    elif case == "not_a_world":
        world = tmp_path / "empty"
        world.mkdir()
    elif case == "edited":
        world = _edited_world(vworld, tmp_path)
    elif case == "missing_clip":
        world = _copy(vworld, tmp_path)
        for frame in _clip_of_first_question(world).glob("*.png"):
            frame.unlink()
    elif case == "too_many_frames":
        task["num_frames"] = 9
    else:
        task.update(num_frames=None, fps=2.0)
    data = _data(qwen_dir, world, tmp_path / "run", **task)
    cfg = tmp_path / "r.yaml"
    cfg.write_text(json.dumps(data))
    assert main(["-q", "eval", str(cfg)]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_corrupt_frame_is_recorded_as_a_failure_not_an_answer(qwen_mm, qwen_dir, vworld, tmp_path):
    world = _copy(vworld, tmp_path)
    clip = _clip_of_first_question(world)
    (clip / "frame_002.png").write_bytes(b"not a png")
    recipe = _recipe(qwen_dir, world, tmp_path / "run", splits=["random"], batch_size=4)
    recipe = recipe.replace(eval=dataclasses.replace(recipe.eval, max_failures=0.9))
    summary = run_eval(recipe, mm=qwen_mm)
    recs = _lines(tmp_path / "run" / "samples.jsonl")
    bad = [r for r in recs if r["video"] == clip.name]
    assert len(bad) == 6 and all("error" in r and "resps" not in r for r in bad)  # 6 questions per clip
    assert all("error" not in r for r in recs if r["video"] != clip.name)
    assert summary["counts"]["failed"] == 6 and summary["counts"]["finished"] == 6


def test_shipped_video_recipes_run_on_a_tiny_stand_in(qwen_dir, vworld, tmp_path):
    for name in ("video_world_pope", "examples/divprune_video_pope"):
        data = load_recipe(name).to_dict()
        assert data["eval"]["tasks"] == ["video_pope"]
        data["model"].update(name=str(qwen_dir), device="cpu", dtype="float32")
        data["eval"]["video_pope"].update(splits=["random"], max_new_tokens=N_NEW)
        data["output"] = {"dir": str(tmp_path / name)}
        cfg = tmp_path / "r.yaml"
        cfg.write_text(json.dumps(data))
        args = ["-q", "eval", str(cfg), "--limit", "2", "--set", f"eval.video_pope.video_world={vworld}"]
        assert main(args) == 0
        recs = _lines(tmp_path / name / "samples.jsonl")
        assert len(recs) == 2 and all("error" not in r for r in recs)
        if "divprune" in name:  # a quarter of the clip's 4 x 16 = 64 tokens (8 frames)
            assert all(r["n_vision_tokens"] == 16 for r in recs)


@pytest.mark.slow
def test_two_processes_equal_one(qwen_mm, qwen_dir, vworld, tmp_path):
    single = run_eval(_recipe(qwen_dir, vworld, tmp_path / "one", splits=["random"]), limit=6, mm=qwen_mm)
    multi = run_eval(_recipe(qwen_dir, vworld, tmp_path / "two", splits=["random"]), limit=6, num_processes=2)
    assert multi["metrics"] == single["metrics"] and multi["protocol"]["processes"] == 2
    one, two = _answers(tmp_path / "one" / "samples.jsonl"), _answers(tmp_path / "two" / "samples.jsonl")
    assert list(one) == list(two) and one == two


def test_every_family_without_video_input_is_refused(vworld, tmp_path):
    """The refusal reads the families' declared features (plug-ins): LLaVA-1.5 and LLaVA-NeXT here."""
    from mmfast.capabilities import ModelFacts
    from mmfast.errors import IncompatibleRecipeError
    from mmfast.eval.data import resolve_data
    from mmfast.eval.tasks import build_tasks
    from mmfast.models import ADAPTERS

    recipe = _recipe(Path("unused"), vworld, tmp_path / "run")
    (task,) = build_tasks(recipe.eval, resolve_data(recipe.eval, recipe.eval.tasks))
    plan = [(task, task.samples(2))]
    without = {a.family: a for a in ADAPTERS.values() if not a.features.video}
    assert {"llava", "llava_next"} <= set(without)
    for family, adapter in without.items():
        facts = ModelFacts(family, 4, 2, (4, 4), adapter.features)
        with pytest.raises(IncompatibleRecipeError, match=f"is a {family} model, which takes no video input"):
            runner.check_media(recipe, plan, facts)
    with_video = next(a for a in ADAPTERS.values() if a.features.video)
    runner.check_media(recipe, plan, ModelFacts(with_video.family, 4, 2, (4, 4), with_video.features))


@pytest.mark.parametrize(
    "methods, message",
    [
        ({"decoding": {"method": "lqcd"}}, "decoding (lqcd) takes images only"),
        ({"pruning": [{"method": "mustdrop", "budget": {"tokens": 8}}]}, "calibrates its token budget on images"),
    ],
)
def test_methods_that_cannot_take_the_clips_are_refused_before_compute(methods, message, qwen_mm, vworld, tmp_path):
    from mmfast.errors import IncompatibleRecipeError

    data = {**_data(Path("unused"), vworld, tmp_path / "run"), **methods}
    with pytest.raises(IncompatibleRecipeError, match=re.escape(message)):
        run_eval(load_recipe(data), mm=qwen_mm)
    assert not (tmp_path / "run").exists()


def test_a_video_only_method_on_images_is_refused_before_compute(tmp_path):
    from mmfast.errors import IncompatibleRecipeError
    from mmfast.eval.tasks import Sample

    recipe = load_recipe({"pruning": [{"method": "dycoke"}]})
    plan = [(None, [Sample("pope_random/1", "pope_random", tmp_path / "x.png", "p", "yes", 2)])]
    with pytest.raises(IncompatibleRecipeError, match=r"pruning\[0\] \(dycoke\) needs a video"):
        runner.check_media(recipe, plan, None)


def test_a_method_that_takes_videos_only_on_the_model_is_refused_on_images(tmp_path):
    """ToMe takes only videos on OneVision (its image merge needs a CLIP-style tower: ``image_needs``):
    an image evaluation is refused before compute there, and runs on LLaVA."""
    from mmfast.capabilities import ModelFacts
    from mmfast.errors import IncompatibleRecipeError
    from mmfast.eval.tasks import Sample
    from mmfast.models import ADAPTERS

    recipe = load_recipe({"pruning": [{"method": "tome"}]})
    plan = [(None, [Sample("pope_random/1", "pope_random", tmp_path / "x.png", "p", "yes", 2)])]
    by_family = {a.family: a for a in ADAPTERS.values()}
    onevision = ModelFacts("llava_onevision", 4, 2, (27, 27), by_family["llava_onevision"].features)
    with pytest.raises(IncompatibleRecipeError, match=r"pruning\[0\] \(tome\) needs a video on this model"):
        runner.check_media(recipe, plan, onevision)
    runner.check_media(recipe, plan, ModelFacts("llava", 4, 2, (24, 24), by_family["llava"].features))


def test_a_sample_is_an_image_or_a_video(tmp_path):
    from mmfast.eval.tasks import Sample
    from mmfast.video import VideoSampling

    with pytest.raises(ValueError, match="exactly one of image and video"):
        Sample("v/1", "v", None, "p", "yes", 2)
    with pytest.raises(ValueError, match="exactly one of image and video"):
        Sample("v/1", "v", tmp_path / "x.png", "p", "yes", 2, video=tmp_path)
    with pytest.raises(ValueError, match="video_sampling is for a video sample"):
        Sample("v/1", "v", tmp_path / "x.png", "p", "yes", 2, video_sampling=VideoSampling(num_frames=2))
    assert Sample("v/1", "v", None, "p", "yes", 2, video=tmp_path).media == tmp_path


@pytest.mark.parametrize("num_frames", [1, 7])
def test_a_sampling_the_family_rounds_to_no_frame_or_past_the_clip_is_refused_before_compute(
    num_frames, qwen_mm, qwen_dir, vworld, tmp_path
):
    """Qwen-VL rounds num_frames to a multiple of 2: 1 becomes 0 frames; on clips of 7 frames, 7 becomes 8. Each
    would fail every sample at generation (the run used to load, write a failed record per sample and exit 3);
    refused before any compute, naming the clip and the rounding."""
    world = vworld
    if num_frames == 7:  # clips of 7 frames: drop every clip's last frame
        world = _copy(vworld, tmp_path)
        for clip in (world / "clips").iterdir():
            sorted(clip.glob("*.png"))[-1].unlink()
    recipe = _recipe(qwen_dir, world, tmp_path / "run", splits=["random"], num_frames=num_frames)
    with pytest.raises(
        mmfast.errors.InputError,
        match=r"video '.*VWORLD_\d+'.*(leaves no frame|num_frames=7 rounded).*multiple of 2.*every sample",
    ):
        run_eval(recipe, mm=qwen_mm)
    assert not (tmp_path / "run" / "samples.jsonl").exists()
