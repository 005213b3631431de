"""Evaluation tasks as a registry: names validated like methods, and a third benchmark is one class.

The ``echo`` task below is the whole of a new benchmark: exact match of a fixed target over the
images of the POPE ``random`` split, with its own options section (``eval.echo``), its own input
file, its own side file, run end to end by ``run_eval`` through the registry.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from mmfast.cli import main
from mmfast.config import EvalConfig, load_recipe, opt
from mmfast.errors import ConfigError, InputError
from mmfast.eval.data import EvalData
from mmfast.eval.runner import check_plan, run_eval
from mmfast.eval.tasks import Sample, Task, build_tasks
from mmfast.eval.tasks.chair import ChairTask
from mmfast.eval.tasks.pope import PopeTask
from mmfast.registry import TASKS

# --------------------------------------------------------------------------- the third benchmark


@dataclass(frozen=True)
class EchoConfig:
    target: str = opt("yes", doc="the answer every sample expects")
    prompt: str = "Answer with one word: yes."
    n_images: int = opt(3, lo=1, doc="distinct images taken from the POPE random split, in file order")
    max_new_tokens: int = opt(2, lo=1, hi=64)


class EchoTask(Task):
    """Exact match of a fixed target over the POPE images (a test task)."""

    Config = EchoConfig
    needs = frozenset({"images"})
    files_help = {"coco": "the POPE random split: https://github.com/RUCAIBox/POPE"}

    @classmethod
    def required_files(cls, cfg: EvalConfig, data: EvalData) -> dict[str, Path]:
        prefix = "coco" if data.dataset == "coco" else "world"
        return {"questions": data.root / "pope" / f"{prefix}_pope_random.json"}

    def __init__(self, cfg: EvalConfig, data: EvalData, cache_dir: Path | None = None) -> None:
        from mmfast.eval.pope import load_pope_questions

        super().__init__(cfg, data, cache_dir)
        names = dict.fromkeys(q.image for q in load_pope_questions(self.files["questions"]))
        self.images = list(names)[: self.options.n_images]

    def samples(self, limit: int | None) -> list[Sample]:
        o = self.options
        images = self.images[:limit] if limit else self.images
        return [
            Sample(f"echo/{name}", "echo", self.data.image_dir / name, o.prompt, o.target, o.max_new_tokens, {"n": i})
            for i, name in enumerate(images)
        ]

    def filter_response(self, text: str, sample: Sample) -> str:
        return text.strip().lower().rstrip(".")

    def metrics(self, records: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
        recs = records.get("echo", [])
        if not recs:
            return {}
        return {"exact_match": sum(r["filtered_resps"][0] == r["target"] for r in recs) / len(recs), "n": len(recs)}

    def protocol(self) -> dict[str, Any]:
        return {"target": self.options.target, "prompt": self.options.prompt, "images": self.images}

    def side_files(self) -> dict[str, str]:
        return {"echo_images.txt": "\n".join(self.images) + "\n"}


@pytest.fixture
def echo():
    TASKS.register("echo")(EchoTask)
    yield EchoTask
    TASKS._entries.pop("echo", None)


@pytest.fixture(scope="module")
def small_world(tmp_path_factory) -> Path:
    from mmfast.world import write_world

    root = tmp_path_factory.mktemp("world")
    write_world(root, seed=0, n_train=0, n_val=12, pope_images=10, progress=False)
    return root


def _recipe(tiny_dir, world, out, **eval_over):
    ev = {
        "tasks": ["pope", "echo"],
        "data": {"dataset": "world", "root": str(world)},
        "pope": {"max_new_tokens": 3, "splits": ["random"]},
        "echo": {"n_images": 4, "target": "yes"},
        "batch_size": 2,
    }
    ev.update(eval_over)
    return load_recipe(
        {"name": "t", "model": {"name": str(tiny_dir), "device": "cpu"}, "eval": ev, "output": {"dir": str(out)}}
    )


# --------------------------------------------------------------------------- tests


def test_builtin_tasks_are_registered():
    assert {"pope", "chair"} <= set(TASKS.names())
    assert TASKS.get("pope").cls is PopeTask and TASKS.get("chair").cls is ChairTask
    assert TASKS.get("pope").config_cls is type(EvalConfig().pope)
    assert PopeTask.needs == {"images"} and ChairTask.needs == {"images", "annotations"}


def test_unknown_task_names_the_entry_and_suggests():
    with pytest.raises(
        ConfigError, match=r"^eval\.tasks\[1\]: unknown evaluation task 'chiar'; did you mean 'chair'\?"
    ):
        load_recipe({"eval": {"tasks": ["pope", "chiar"]}})
    with pytest.raises(ConfigError, match=r"^eval\.tasks\[1\]: task 'pope' is listed twice"):
        load_recipe({"eval": {"tasks": ["pope", "pope"]}})
    with pytest.raises(ConfigError, match=r"^eval\.echo: unknown key"):  # not registered here: no section either
        load_recipe({"eval": {"echo": {}}})


def test_task_section_validated_by_its_config(echo):
    r = load_recipe({"eval": {"tasks": ["echo"], "echo": {"target": "no"}}})
    assert r.eval.task_config("echo") == EchoConfig(target="no")
    assert load_recipe({"eval": {"tasks": ["echo"]}}).eval.task_config("echo") == EchoConfig()  # defaults
    with pytest.raises(ConfigError, match=r"^eval\.echo\.targt: unknown key; did you mean 'target'"):
        load_recipe({"eval": {"echo": {"targt": "no"}}})
    with pytest.raises(ConfigError, match=r"^eval\.echo\.n_images: 0 is out of range"):
        load_recipe({"eval": {"echo": {"n_images": 0}}})
    with pytest.raises(ConfigError, match=r"^eval\.ecko: unknown key; did you mean 'echo'"):
        load_recipe({"eval": {"ecko": {}}})
    again = load_recipe(r.to_dict())  # written back as eval.echo
    assert r.to_dict()["eval"]["echo"] == {
        "target": "no",
        "prompt": EchoConfig.prompt,
        "n_images": 3,
        "max_new_tokens": 2,
    }
    assert again.eval == r.eval and again.hash() == r.hash()
    # a recipe without a plugin section dumps (and hashes) exactly as before the registry
    assert list(load_recipe({}).to_dict()["eval"]) == [
        "tasks",
        "data",
        "pope",
        "chair",
        "batch_size",
        "limit",
        "max_failures",
    ]


def test_third_task_runs_end_to_end(echo, tiny_dir, tiny_mm, small_world, tmp_path):
    out = tmp_path / "run"
    s = run_eval(_recipe(tiny_dir, small_world, out), limit=3, mm=tiny_mm)
    assert set(s["metrics"]) == {"pope", "echo"}
    assert s["metrics"]["echo"]["n"] == 3 and 0.0 <= s["metrics"]["echo"]["exact_match"] <= 1.0
    assert s["metrics"]["pope"]["random"]["n"] == 3
    proto = s["protocol"]["tasks"]["echo"]
    assert proto["target"] == "yes" and len(proto["images"]) == 4
    recs = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    echo_recs = [r for r in recs if r["task"] == "echo"]
    assert [r["doc_id"] for r in echo_recs] == [f"echo/{n}" for n in proto["images"][:3]]
    assert all(
        r["target"] == "yes" and r["filtered_resps"][0] == r["resps"][0][0].strip().lower().rstrip(".")
        for r in echo_recs
    )
    assert (out / "echo_images.txt").read_text().split() == proto["images"]
    assert not (out / "chair_image_ids.txt").exists()  # only the tasks that ran write side files
    # resuming with more samples runs only the new ones
    s2 = run_eval(_recipe(tiny_dir, small_world, out), limit=4, mm=tiny_mm)
    assert s2["metrics"]["echo"]["n"] == 4
    recs2 = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert [r for r in recs2 if r in recs] == recs and len(recs2) == 8  # the finished ones kept as they were


def test_task_files_checked_before_the_model(echo, tmp_path):
    """A task's own required file is listed with where to get it, before any model is loaded."""
    (tmp_path / "val2014").mkdir()
    recipe = load_recipe({"eval": {"tasks": ["echo"], "data": {"dataset": "coco", "root": str(tmp_path)}}})
    with pytest.raises(InputError) as exc:
        run_eval(recipe)
    msg = str(exc.value)
    assert "coco_pope_random.json" in msg and "RUCAIBox/POPE" in msg
    assert "instances_val2014.json" not in msg  # echo does not need the annotations


def test_colliding_plans_refused(echo, small_world):
    cfg = load_recipe(
        {
            "eval": {
                "tasks": ["pope", "echo"],
                "data": {"dataset": "world", "root": str(small_world)},
                "pope": {"splits": ["random"]},
            }
        }
    ).eval
    from mmfast.eval.data import resolve_data

    pope, echo_task = build_tasks(cfg, resolve_data(cfg, cfg.tasks))
    check_plan([(pope, pope.samples(2)), (echo_task, echo_task.samples(2))])
    clash = [Sample("pope_random/1", "echo", Path("x.png"), "p", "yes", 2)]
    with pytest.raises(InputError, match="planned twice"):
        check_plan([(pope, pope.samples(2)), (echo_task, clash)])
    clash = [Sample("echo/x", "pope_random", Path("x.png"), "p", "yes", 2)]
    with pytest.raises(InputError, match="record group 'pope_random'"):
        check_plan([(pope, pope.samples(2)), (echo_task, clash)])


def test_task_needs_only_shared_inputs():
    with pytest.raises(TypeError, match="shared inputs"):

        class Bad(Task):  # noqa: F841
            needs = frozenset({"images", "questions"})


def test_cli_lists_tasks(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    tasks = out[out.index("tasks:") :]
    assert "pope " in tasks and "chair " in tasks
