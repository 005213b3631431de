"""``python -m lmms_eval --model mmfast`` end to end, one process and two (``torchrun --nproc_per_node 2``, CPU),
and on a video task (``video_pope`` through the shipped ``video_world_pope`` recipe).

Runs only where lmms-eval is installed (CI's venv does not have it; see docs/scaling.md for the
manual commands on the embedded world). The task is the one ``mmfast lmms-task`` writes, on a small
generated world; the model is the tiny random LLaVA with a FastV recipe, given as ``pretrained=`` plus
a ``recipe=`` and a dotted override. Both runs must give, document by document, the answers mmfast's
own session gives for the same prompt and image, and lmms-eval's metrics must be mmfast's POPE scores
of those answers. The video run (a tiny random Qwen2.5-VL, a tiny video world) must give, question by
question, ``mmfast eval``'s answers, and per split ``mmfast eval``'s figures.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("lmms_eval") is None, reason="lmms-eval is not installed")

LIMIT = 3  # per split; odd, so the two ranks' shards differ in length and lmms-eval pads one
SPLITS = ("random", "adversarial")


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_dir):
    from mmfast.cli import main
    from mmfast.world import write_world

    tmp = tmp_path_factory.mktemp("lmms_e2e")
    write_world(tmp / "world", seed=0, n_train=0, n_val=8, pope_images=6, progress=False)
    recipe = tmp / "recipe.yaml"
    recipe.write_text(
        "model: {name: no/such-model, device: cpu}\n"
        "pruning: [{method: fastv, params: {keep: 12}}]\n"
        f"eval: {{tasks: [pope], data: {{dataset: world, root: {tmp / 'world'}}},\n"
        f'       pope: {{splits: [{", ".join(SPLITS)}], max_new_tokens: 4, prompt: "{{question}} Answer yes or no."}}}}\n'
    )
    assert main(["-q", "lmms-task", str(recipe), "--output", str(tmp / "task"), "--name", "tw_pope"]) == 0
    return tmp, recipe


def _lmms_eval(
    tmp: Path,
    recipe: Path | str,
    tiny_dir: Path,
    out: str,
    launcher: list[str],
    extra_args: str = ",pruning.0.params.keep=5",
    group: str = "tw_pope",
    limit: int = LIMIT,
) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HOME": str(tmp / "hf"),
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    cmd = launcher + [
        "-m",
        "lmms_eval",
        "--model",
        "mmfast",
        "--model_args",
        f"pretrained={tiny_dir},recipe={recipe}{extra_args}",
        "--include_path",
        str(tmp / "task"),
        "--tasks",
        group,
        "--limit",
        str(limit),
        "--batch_size",
        "2",
        "--log_samples",
        "--output_path",
        str(tmp / out),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    # lmms-eval logs some failures (an import error, an unknown task) and still exits 0
    if not list((tmp / out).rglob("*_results.json")) or not _samples(tmp / out, group):
        pytest.fail(
            f"lmms-eval exited 0 but wrote no results or samples under {tmp / out} (an error it logged and "
            "swallowed; with filelock>=4 it cannot import filelock._api: pip install 'filelock<4'):\n"
            + proc.stdout[-3000:]
            + proc.stderr[-6000:]
        )
    return proc


def _samples(out: Path, group: str = "tw_pope") -> dict[tuple[str, int], dict]:
    rows = {}
    for f in out.rglob(f"*_samples_{group}_*.jsonl"):
        split = f.name.rsplit(f"_samples_{group}_", 1)[1][: -len(".jsonl")]
        for r in map(json.loads, f.read_text().splitlines()):
            rows[(split, r["pope_f1"]["question_id"])] = r
    return rows


def _results(out: Path) -> dict:
    (f,) = out.rglob("*_results.json")
    return json.loads(f.read_text())["results"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_lmms_eval_one_and_two_processes(setup, tiny_dir):
    from PIL import Image

    import mmfast
    from mmfast.config import load_recipe
    from mmfast.eval.pope import load_pope_questions, score_pope
    from mmfast.model import load_model

    tmp, recipe = setup
    one = _lmms_eval(tmp, recipe, tiny_dir, "one", [sys.executable])
    # torchrun: on a machine without CUDA `accelerate launch --num_processes 2 --cpu` starts one process
    two = _lmms_eval(
        tmp,
        recipe,
        tiny_dir,
        "two",
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port())],
    )
    # mmfast's own log lines reach lmms-eval's (loguru) output: rank announcements and token summaries
    logs_one, logs_two = one.stdout + one.stderr, two.stdout + two.stderr
    assert "mmfast rank 1 of 2 on cpu (data parallel)" in logs_two and "rank 0 of" not in logs_one
    assert "rank 0 generate_until:" in logs_one and "rank 1 generate_until:" in logs_two

    a, b = _samples(tmp / "one"), _samples(tmp / "two")
    assert len(a) == len(SPLITS) * LIMIT and a.keys() == b.keys()
    assert {k: r["filtered_resps"] for k, r in a.items()} == {k: r["filtered_resps"] for k, r in b.items()}
    assert all(r["token_counts"][0]["output_tokens"] >= 1 for r in a.values())

    # the answers are mmfast's own for the same recipe (with the override), prompt and image
    r = load_recipe(str(recipe), [f"model.name={tiny_dir}", "pruning[0].params.keep=5"])
    world = tmp / "world"
    with mmfast.apply(load_model(r.model), r) as s:
        for split in SPLITS:
            for q in load_pope_questions(world / "pope" / f"world_pope_{split}.json")[:LIMIT]:
                row = a[(split, q.question_id)]
                prompt = f"{q.text} Answer yes or no."
                assert row["input"] == prompt
                batch = s.mm.prepare([[Image.open(world / "images" / "val" / q.image).convert("RGB")]], [prompt])
                # no stop string (the task says until: [], as mmfast eval), so the whole answer
                assert row["filtered_resps"] == s.run(batch, max_new_tokens=4)[0].text

    # lmms-eval's metrics are mmfast's POPE scores of those answers, in both runs
    for out in ("one", "two"):
        res = _results(tmp / out)
        for split in SPLITS:
            recs = [
                {"label": row["target"], "answer": row["filtered_resps"]} for (sp, _), row in a.items() if sp == split
            ]
            want = score_pope(recs, "pope")
            got = res[f"tw_pope_{split}"]
            assert got["pope_f1,none"] == pytest.approx(want.f1) and got["pope_accuracy,none"] == pytest.approx(
                want.accuracy
            )
            assert got["pope_yes_ratio,none"] == pytest.approx(want.yes_ratio)


def test_lmms_eval_video_pope_reports_mmfast_evals_figures(tmp_path_factory):
    """``mmfast lmms-task`` + ``python -m lmms_eval --model mmfast --model_args recipe=video_world_pope``
    answers each clip's questions as ``mmfast eval`` of the same recipe does (the clip's frames as one
    video, 8 of 8 sampled by the recipe's num_frames), and reports its per-split figures."""
    from mmfast.cli import main
    from mmfast.models.factory import random_qwen_vl, save_model
    from mmfast.world.video import write_video_world
    from mmfast.world.video_render import VideoConfig

    tmp = tmp_path_factory.mktemp("lmms_video_e2e")
    write_video_world(
        tmp / "vworld", seed=0, n_clips=3, pope_clips=2, config=VideoConfig(frames=8, image_size=32), progress=False
    )
    qwen = save_model(*random_qwen_vl("qwen2_5_vl", seed=1), tmp / "qwen")
    sets = [f"eval.video_pope.video_world={tmp / 'vworld'}", "eval.video_pope.num_frames=4", "model.device=cpu"]
    set_args = [a for kv in sets for a in ("--set", kv)]
    assert main(["-q", "lmms-task", "video_world_pope", *set_args, "--output", str(tmp / "task"), "--name", "tv"]) == 0
    run = tmp / "mmfast_eval"
    assert (
        main(
            ["-q", "eval", "video_world_pope", *set_args, "--set", f"model.name={qwen}", "--limit", "2"]
            + ["--output", str(run)]
        )
        == 0
    )
    # the recipe's model is the 7B checkpoint: pretrained= points it at the tiny one, as in mmfast eval
    _lmms_eval(tmp, "video_world_pope", qwen, "lmms", [sys.executable], ",model.device=cpu", group="tv", limit=2)

    records = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    mine = {(r["task"].removeprefix("video_pope_"), r["meta"]["question_id"]): r for r in records}
    theirs = _samples(tmp / "lmms", "tv")
    assert len(theirs) == 3 * 2 and theirs.keys() == mine.keys()
    for key, row in theirs.items():
        assert row["filtered_resps"] == mine[key]["resps"][0][0] and row["target"] == mine[key]["target"]
    summary = json.loads((run / "summary.json").read_text())["metrics"]["video_pope"]
    res = _results(tmp / "lmms")
    for split in ("random", "popular", "adversarial"):
        for m in ("accuracy", "precision", "recall", "f1", "yes_ratio"):
            assert res[f"tv_{split}"][f"pope_{m},none"] == pytest.approx(summary[split][m]), (split, m)
