"""``mmfast lmms-task``: the local lmms-eval POPE task (runs without lmms-eval; the end-to-end run with
lmms-eval is tests/test_lmms_eval_e2e.py)."""

from __future__ import annotations

import importlib.util
import json
import logging

import pytest
import yaml

from mmfast.cli import main
from mmfast.config import load_recipe
from mmfast.errors import InputError
from mmfast.eval.pope import load_pope_questions, score_pope


class _Loader(yaml.SafeLoader):
    """YAML with lmms-eval's ``!function module.name`` tags, kept as strings."""


_Loader.add_constructor("!function", lambda loader, node: f"!function {loader.construct_scalar(node)}")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from mmfast.world import write_world

    root = tmp_path_factory.mktemp("lmmsworld")
    write_world(root, seed=0, n_train=0, n_val=8, pope_images=6, progress=False)
    return root


def _recipe(world, **pope):
    return {
        "model": {"name": "unused"},
        "eval": {
            "tasks": ["pope"],
            "data": {"dataset": "world", "root": str(world)},
            "pope": {"prompt": "Q: {question}\nA (yes/no):", "max_new_tokens": 3, "parser": "lmms", **pope},
        },
    }


def test_written_task_mirrors_the_recipe(world, tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(_recipe(world, splits=["random", "popular"])))
    assert main(["-q", "lmms-task", str(recipe), "--output", str(tmp_path / "task")]) == 0
    out = capsys.readouterr().out
    task_dir = (tmp_path / "task").resolve()
    assert f"--include_path {task_dir} --tasks mmfast_world_pope" in out
    group = yaml.load((task_dir / "mmfast_world_pope.yaml").read_text(), Loader=_Loader)
    assert group["group"] == "mmfast_world_pope"
    assert group["task"] == ["mmfast_world_pope_random", "mmfast_world_pope_popular"]
    assert {m["metric"] for m in group["aggregate_metric_list"]} == {"pope_f1", "pope_accuracy"}
    assert all(m["weight_by_size"] is False for m in group["aggregate_metric_list"])

    for split in ("random", "popular"):
        cfg = yaml.load((task_dir / f"mmfast_world_pope_{split}.yaml").read_text(), Loader=_Loader)
        jsonl = task_dir / "data" / f"{split}.jsonl"
        assert cfg["dataset_path"] == "json" and cfg["dataset_kwargs"] == {"data_files": {split: str(jsonl)}}
        assert cfg["test_split"] == split and cfg["output_type"] == "generate_until"
        assert cfg["generation_kwargs"]["max_new_tokens"] == 3 and cfg["generation_kwargs"]["do_sample"] is False
        assert cfg["generation_kwargs"]["until"] == []  # no stop string, as mmfast eval (lmms-eval's default: "\n\n")
        kw = cfg["lmms_eval_specific_kwargs"]["default"]
        assert (kw["pre_prompt"], kw["post_prompt"]) == ("Q: ", "\nA (yes/no):")
        assert [m["metric"] for m in cfg["metric_list"]] == [
            "pope_accuracy",
            "pope_precision",
            "pope_recall",
            "pope_f1",
            "pope_yes_ratio",
        ]
        rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
        questions = load_pope_questions(world / "pope" / f"world_pope_{split}.json")
        assert [(r["question_id"], r["question"], r["answer"]) for r in rows] == [
            (q.question_id, q.text, q.label) for q in questions
        ]
        assert all(r["image"] == str((world / "images" / "val" / q.image).resolve()) for r, q in zip(rows, questions))
        assert {r["split"] for r in rows} == {split} and {r["parser"] for r in rows} == {"lmms"}
    assert not (task_dir / "data" / "adversarial.jsonl").exists()


def test_task_functions_score_like_mmfast(world, tmp_path):
    from mmfast.eval.lmms_tasks import write_lmms_task

    task = write_lmms_task(load_recipe(_recipe(world)), tmp_path / "t", name="w_pope")
    assert task.tasks == ("w_pope_random", "w_pope_popular", "w_pope_adversarial") and task.group == "w_pope"
    spec = importlib.util.spec_from_file_location("written_utils", task.directory / "utils.py")
    utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(utils)  # the file lmms-eval loads for `!function utils.*`
    docs = [json.loads(line) for line in (task.directory / "data" / "adversarial.jsonl").read_text().splitlines()]
    assert (
        utils.doc_to_text(docs[0], {"pre_prompt": "Q: ", "post_prompt": "\nA (yes/no):"})
        == f"Q: {docs[0]['question']}\nA (yes/no):"
    )
    (im,) = utils.doc_to_visual(docs[0])
    assert im.mode == "RGB" and im.size == (192, 192)
    answers = ["Yes.", "no", "maybe", "No, there is not.", "yes"] * (len(docs) // 5 + 1)
    per_metric: dict[str, list] = {}
    for doc, answer in zip(docs, answers):
        for metric, rec in utils.process_results(doc, [answer]).items():
            per_metric.setdefault(metric, []).append(rec)
    want = score_pope([{"label": d["answer"], "answer": a} for d, a in zip(docs, answers)], "lmms")
    assert want.counts.n_unscored > 0  # the lmms parser leaves "maybe" unscored
    for m in ("accuracy", "precision", "recall", "f1", "yes_ratio"):
        assert getattr(utils, f"aggregate_{m}")(per_metric[f"pope_{m}"]) == getattr(want, m)
    with pytest.raises(InputError, match="different parsers"):
        utils.aggregate_f1([{"label": "yes", "answer": "yes", "parser": p} for p in ("pope", "lmms")])


def test_bad_task_name(world, tmp_path):
    from mmfast.eval.lmms_tasks import write_lmms_task

    with pytest.raises(InputError, match="letters, digits and underscores"):
        write_lmms_task(load_recipe(_recipe(world)), tmp_path, name="my-task")


def test_logs_route_to_loguru_only_without_logging_config(monkeypatch):
    from mmfast.eval import lmms_plugin

    class Sink:  # loguru's interface as the handler uses it
        def __init__(self) -> None:
            self.lines: list[tuple] = []

        def level(self, name):
            if name not in ("INFO", "WARNING"):
                raise ValueError(name)
            return type("Level", (), {"name": name})

        def opt(self, depth, exception):
            return type("Bound", (), {"log": lambda _, level, msg: self.lines.append((level, msg, depth))})()

    sink = Sink()
    pkg, root = logging.getLogger("mmfast"), logging.getLogger()
    monkeypatch.setattr(root, "handlers", [logging.NullHandler()])
    monkeypatch.setitem(__import__("sys").modules, "loguru", type("M", (), {"logger": sink}))
    assert lmms_plugin.route_logs_to_lmms_eval() is False  # the application configured logging
    monkeypatch.setattr(root, "handlers", [])
    monkeypatch.setattr(pkg, "handlers", [logging.NullHandler()])
    level = pkg.level
    pkg.setLevel(logging.NOTSET)
    try:
        assert lmms_plugin.route_logs_to_lmms_eval() is True and pkg.level == logging.INFO
        assert lmms_plugin.route_logs_to_lmms_eval() is False  # once
        logging.getLogger("mmfast.eval.somewhere").info("done %d/%d", 3, 4)
        logging.getLogger("mmfast.eval.somewhere").debug("hidden")
    finally:
        pkg.setLevel(level)
    assert [(lv, msg) for lv, msg, _ in sink.lines] == [("INFO", "done 3/4")]
    assert sink.lines[0][2] >= 1  # points past logging's own frames, at the caller


def test_prompt_parts_follow_the_template(world, tmp_path):
    from mmfast.eval.lmms_tasks import write_lmms_task

    task = write_lmms_task(load_recipe(_recipe(world, prompt="{{note}} {question} ok?")), tmp_path / "t", name="b")
    cfg = yaml.load((task.directory / "b_random.yaml").read_text(), Loader=_Loader)
    kw = cfg["lmms_eval_specific_kwargs"]["default"]
    assert (kw["pre_prompt"], kw["post_prompt"]) == ("{note} ", " ok?")  # str.format's literal braces
    with pytest.raises(InputError, match=r"holds \{question\} 2 times"):
        write_lmms_task(load_recipe(_recipe(world, prompt="{question} {question}")), tmp_path / "t2")


# -- video_pope -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vworld(tmp_path_factory):
    from mmfast.world.video import write_video_world
    from mmfast.world.video_render import VideoConfig

    root = tmp_path_factory.mktemp("lmmsvworld")
    write_video_world(
        root, seed=0, n_clips=3, pope_clips=2, config=VideoConfig(frames=8, image_size=32), progress=False
    )
    return root


def _video_recipe(vworld, **opts):
    return {
        "model": {"name": "unused"},
        "eval": {
            "tasks": ["video_pope"],
            "video_pope": {"video_world": str(vworld), "prompt": "{question} Answer:", "max_new_tokens": 5, **opts},
        },
    }


def test_video_pope_task_holds_mmfast_evals_samples(vworld, tmp_path, capsys):
    """Each row is a sample ``mmfast eval`` plans (question, label, clip, sampling); the visual is the clip
    as a video dict the plugin opens with that sampling."""
    from mmfast.eval.data import resolve_data
    from mmfast.eval.tasks.video_pope import VideoPopeTask
    from mmfast.video import open_video

    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(_video_recipe(vworld, num_frames=4, splits=["random", "adversarial"])))
    assert main(["-q", "lmms-task", str(recipe), "--output", str(tmp_path / "task")]) == 0
    task_dir = (tmp_path / "task").resolve()
    assert f"--include_path {task_dir} --tasks mmfast_video_pope" in capsys.readouterr().out
    group = yaml.load((task_dir / "mmfast_video_pope.yaml").read_text(), Loader=_Loader)
    assert group["task"] == ["mmfast_video_pope_random", "mmfast_video_pope_adversarial"]

    r = load_recipe(str(recipe))
    samples = VideoPopeTask(r.eval, resolve_data(r.eval, ["video_pope"])).samples(None)
    spec = importlib.util.spec_from_file_location("written_vutils", task_dir / "utils.py")
    utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(utils)
    from mmfast.eval._lmms_visuals import sort_visuals

    rows = []
    for split in ("random", "adversarial"):
        cfg = yaml.load((task_dir / f"mmfast_video_pope_{split}.yaml").read_text(), Loader=_Loader)
        assert cfg["generation_kwargs"]["max_new_tokens"] == 5 and cfg["generation_kwargs"]["until"] == []
        kw = cfg["lmms_eval_specific_kwargs"]["default"]
        split_rows = [json.loads(x) for x in (task_dir / "data" / f"{split}.jsonl").read_text().splitlines()]
        for row in split_rows:
            assert utils.doc_to_text(row, kw) == f"{row['question']} Answer:"
        rows += split_rows
    assert len(rows) == len(samples) == 2 * 2 * 6  # 2 splits x 2 clips x 6 questions
    for row, s in zip(rows, samples):
        assert s.task == f"video_pope_{row['split']}" and s.meta["question_id"] == row["question_id"]
        assert (row["question"], row["answer"], row["parser"]) == (s.meta["question"], s.target, "pope")
        (visual,) = utils.doc_to_visual(row)
        ref = sort_visuals([visual], "doc").video
        assert ref.source == s.video.resolve() and ref.sampling == s.video_sampling
        assert open_video(ref.source, ref.sampling).indices == [0, 2, 4, 6]


def test_video_pope_or_pope_is_picked(vworld, world, tmp_path):
    from mmfast.eval.lmms_tasks import write_lmms_task

    both = _video_recipe(vworld)
    both["eval"]["tasks"] = ["pope", "video_pope"]
    both["eval"]["data"] = {"dataset": "world", "root": str(world)}
    with pytest.raises(InputError, match="lists both pope and video_pope; pick one with --task"):
        write_lmms_task(load_recipe(both), tmp_path / "x")
    assert write_lmms_task(load_recipe(both), tmp_path / "v", task="video_pope").group == "mmfast_video_pope"
    assert write_lmms_task(load_recipe(both), tmp_path / "p", task="pope").group == "mmfast_world_pope"
    with pytest.raises(InputError, match="writes pope or video_pope"):
        write_lmms_task(load_recipe(both), tmp_path / "c", task="chair")
    missing = _video_recipe(vworld)
    missing["eval"]["video_pope"]["video_world"] = str(tmp_path / "nowhere")
    with pytest.raises(InputError, match="is not a directory; write the video world there first"):
        write_lmms_task(load_recipe(missing), tmp_path / "m")


def test_prompt_text_round_trips_through_the_task_yaml(world, tmp_path):
    """The prompts were written with json.dumps: a character outside the BMP became a JSON surrogate pair,
    which YAML reads as two lone surrogates, and a YAML line break (U+0085, U+2028) was folded into a space."""
    from mmfast.eval.lmms_tasks import write_lmms_task

    prompt = "Look \U0001f600 here:\u2028{question}\x85ok?"
    task = write_lmms_task(load_recipe(_recipe(world, prompt=prompt)), tmp_path / "t", name="u")
    cfg = yaml.load((task.directory / "u_random.yaml").read_text(encoding="utf-8"), Loader=_Loader)
    kw = cfg["lmms_eval_specific_kwargs"]["default"]
    assert (kw["pre_prompt"], kw["post_prompt"]) == ("Look \U0001f600 here:\u2028", "\x85ok?")
