"""mmfast eval: per-sample records, resume after a killed run, failures recorded, summary layout."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mmfast.config import load_recipe
from mmfast.errors import InputError
from mmfast.eval.runner import RunAbortedError, run_eval


@pytest.fixture(scope="module")
def small_world(tmp_path_factory) -> Path:
    from mmfast.world import write_world

    root = tmp_path_factory.mktemp("world")
    write_world(root, seed=0, n_train=0, n_val=12, pope_images=10, progress=False)
    return root


def _recipe(tiny_dir, world, out, **eval_over):
    ev = {
        "tasks": ["pope", "chair"],
        "data": {"dataset": "world", "root": str(world)},
        "pope": {"max_new_tokens": 3, "splits": ["random", "adversarial"]},
        "chair": {"n_images": 5, "max_new_tokens": 6},
        "batch_size": 2,
    }
    ev.update(eval_over)
    return load_recipe(
        {"name": "t", "model": {"name": str(tiny_dir), "device": "cpu"}, "eval": ev, "output": {"dir": str(out)}}
    )


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_summary_layout_and_records(tiny_dir, tiny_mm, small_world, tmp_path):
    out = tmp_path / "run"
    s = run_eval(_recipe(tiny_dir, small_world, out), limit=4, mm=tiny_mm)
    pope = s["metrics"]["pope"]
    for split in ("random", "adversarial"):
        assert set(pope[split]) >= {"accuracy", "precision", "recall", "f1", "yes_ratio", "n"}
        assert pope[split]["n"] == 4
        lo, hi = pope[split]["f1_ci95"]  # every figure carries its n and 95% interval
        assert lo <= pope[split]["f1"] <= hi
    assert "mean_f1" in pope and pope["n"] == 8
    assert pope["mean_f1_ci95"][0] <= pope["mean_f1"] <= pope["mean_f1_ci95"][1]
    assert set(s["metrics"]["chair"]) == {
        "chair_s",
        "chair_i",
        "recall",
        "len",
        "n",
        "chair_s_ci95",
        "chair_i_ci95",
        "recall_ci95",
        "n_mentions",
        "n_gt_objects",
        "n_degenerate",
        "ci_method",
    }
    assert s["metrics"]["chair"]["n"] == 4 and 0 <= s["metrics"]["chair"]["n_degenerate"] <= 4
    assert pope["n_units"] <= 8 and pope["ci_method"] == s["metrics"]["chair"]["ci_method"]  # POPE resampled by image
    assert s["protocol"]["tasks"]["chair"]["intervals"]["resamples"] == 10_000
    assert s["protocol"]["tasks"]["pope"]["files"]["random"]["sha256"]
    assert s["protocol"]["recipe_hash"] and s["protocol"]["versions"]["transformers"]
    recs = _lines(out / "samples.jsonl")
    assert len(recs) == 12 and len({r["doc_id"] for r in recs}) == 12
    assert {"doc_id", "target", "resps", "filtered_resps"} <= set(recs[0])
    ids = (out / "chair_image_ids.txt").read_text().split()
    assert len(ids) == 5 and ids == sorted(ids, key=lambda _: 0)  # saved in sampling order


def test_resume_skips_finished(tiny_dir, tiny_mm, small_world, tmp_path):
    out = tmp_path / "run"
    recipe = _recipe(tiny_dir, small_world, out)
    run_eval(recipe, limit=2, mm=tiny_mm)
    first = _lines(out / "samples.jsonl")
    # a torn last line, as left by a kill during a write
    with open(out / "samples.jsonl", "a") as fh:
        fh.write('{"doc_id": "pope_random/9", "task"')
    run_eval(recipe, limit=4, mm=tiny_mm)
    recs = _lines(out / "samples.jsonl")
    by_id = {r["doc_id"]: r for r in recs}
    assert all(by_id[r["doc_id"]] == r for r in first)  # finished samples untouched (now in plan order)
    assert len(recs) == 12 and len(by_id) == 12


def test_overwrite_run_resumes_without_the_flag(tiny_dir, tiny_mm, small_world, tmp_path):
    """A run started with output.overwrite (replacing old results) and interrupted resumes under the
    same command without the flag: where results go is not part of what they are."""
    out = tmp_path / "run"
    recipe = _recipe(tiny_dir, small_world, out)
    run_eval(recipe.replace(output=dataclasses.replace(recipe.output, overwrite=True)), limit=2, mm=tiny_mm)
    first = _lines(out / "samples.jsonl")
    run_eval(recipe, limit=4, mm=tiny_mm)
    recs = _lines(out / "samples.jsonl")
    assert [r for r in recs if r in first] == first and len(recs) == 12


def test_other_recipe_refused(tiny_dir, tiny_mm, small_world, tmp_path):
    out = tmp_path / "run"
    run_eval(_recipe(tiny_dir, small_world, out), limit=1, mm=tiny_mm)
    with pytest.raises(InputError, match="another recipe"):
        run_eval(_recipe(tiny_dir, small_world, out, chair={"n_images": 5, "max_new_tokens": 7}), limit=1, mm=tiny_mm)
    # batch_size and max_failures change no answer: the same run, resumed (issue 29)
    run_eval(_recipe(tiny_dir, small_world, out, batch_size=3, max_failures=0.5), limit=1, mm=tiny_mm)


def test_other_weights_refused(tiny_dir, tiny_mm, small_world, tmp_path):
    """Same recipe, retrained weights under the same path: resuming would mix two models' answers."""
    import torch

    out = tmp_path / "run"
    run_eval(_recipe(tiny_dir, small_world, out), limit=1, mm=tiny_mm)
    w = tiny_mm.model.lm_head.weight
    saved = w.detach().clone()
    try:
        with torch.no_grad():
            w.add_(0.5)
        with pytest.raises(InputError, match="other model weights"):
            run_eval(_recipe(tiny_dir, small_world, out), limit=1, mm=tiny_mm)
    finally:
        with torch.no_grad():
            w.copy_(saved)
    run_eval(_recipe(tiny_dir, small_world, out), limit=1, mm=tiny_mm)  # the original weights resume fine


def test_corrupt_image_recorded_not_empty(tiny_dir, tiny_mm, small_world, tmp_path):
    world = tmp_path / "world"
    shutil.copytree(small_world, world)
    from mmfast.eval.chair import sample_image_ids

    first = sample_image_ids(list(range(1, 13)), 5, 0)[0]  # the CHAIR sample's first image
    victim = world / "images" / "val" / f"WORLD_val_{first:012d}.png"
    victim.write_bytes(b"garbage")
    out = tmp_path / "run"
    s = run_eval(_recipe(tiny_dir, world, out, tasks=["chair"], max_failures=0.9), limit=5, mm=tiny_mm)
    failed = [r for r in _lines(out / "samples.jsonl") if "error" in r]
    assert failed and all("cannot be read" in r["error"] and "resps" not in r for r in failed)
    assert s["counts"]["failed"] == len(failed) and s["metrics"]["chair"]["n"] == 5 - len(failed)
    with pytest.raises(RunAbortedError, match="max_failures"):
        victim2 = sorted((world / "images" / "val").iterdir())
        for v in victim2:
            v.write_bytes(b"garbage")
        run_eval(_recipe(tiny_dir, world, tmp_path / "run2", tasks=["chair"]), limit=5, mm=tiny_mm)


def test_missing_coco_files_listed(tmp_path, monkeypatch):
    monkeypatch.delenv("MMFAST_COCO_ROOT", raising=False)
    monkeypatch.chdir(tmp_path)
    recipe = load_recipe({"eval": {"tasks": ["pope", "chair"], "data": {"dataset": "coco"}}})
    with pytest.raises(InputError, match="MMFAST_COCO_ROOT"):
        run_eval(recipe)
    (tmp_path / "val2014").mkdir()
    recipe = load_recipe({"eval": {"tasks": ["pope", "chair"], "data": {"dataset": "coco", "root": str(tmp_path)}}})
    with pytest.raises(InputError) as exc:
        run_eval(recipe)
    msg = str(exc.value)
    assert "instances_val2014.json" in msg and "coco_pope_adversarial.json" in msg and "cocodataset.org" in msg


def test_killed_run_resumes(tiny_dir, small_world, tmp_path):
    """SIGKILL a real `mmfast eval` process mid-run; rerunning completes without loss or duplicates."""
    out = tmp_path / "run"
    cfg = tmp_path / "r.yaml"
    cfg.write_text(
        json.dumps(
            {
                "name": "kill",
                "model": {"name": str(tiny_dir), "device": "cpu"},
                "eval": {
                    "tasks": ["pope"],
                    "data": {"dataset": "world", "root": str(small_world)},
                    "pope": {"max_new_tokens": 8},
                    "batch_size": 1,
                    "limit": 8,  # per split: 24 samples, time to be killed after 3
                },
                "decoding": {"max_new_tokens": 8},
                "output": {"dir": str(out)},
            }
        )
    )
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "mmfast", "-q", "eval", str(cfg)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    samples = out / "samples.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if samples.exists() and len(samples.read_text().splitlines()) >= 3:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = samples.read_text().splitlines()
    assert 3 <= len(before) < 24, "the run must have been interrupted mid-way"
    assert subprocess.run(cmd, env=env, capture_output=True).returncode == 0
    after = samples.read_text().splitlines()
    assert after[: len(before)] == before
    ids = [json.loads(x)["doc_id"] for x in after]
    assert len(ids) == len(set(ids)) == 24  # 3 splits x 8 questions
    assert json.loads((out / "summary.json").read_text())["counts"]["finished"] == 24


def test_output_dir_under_the_home_directory(tiny_dir, tiny_mm, small_world, tmp_path, monkeypatch):
    """``output.dir: ~/runs/{name}`` (as eval.data.root and model.name, a recipe's ~ is the home directory):
    the run goes there, not into a directory named ``~`` under the working directory."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir(), cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    run_eval(_recipe(tiny_dir, small_world, "~/runs/{name}", tasks=["pope"]), limit=1, mm=tiny_mm)
    assert (home / "runs" / "t" / "summary.json").is_file() and not (cwd / "~").exists()


def test_git_sha_is_mmfast_s_own_not_an_enclosing_repository_s(tmp_path):
    """mmfast installed (not a checkout) in a venv inside a user's project repository recorded the
    project's HEAD as the run's ``protocol.git_sha``: ``git rev-parse`` ran in the package directory and
    found the enclosing repository. A sha is only mmfast's when the repository's top holds this package."""
    from mmfast.eval import runner

    if shutil.which("git") is None:
        pytest.skip("no git")
    repo = tmp_path / "project"
    pkg = repo / ".venv" / "lib" / "site-packages" / "mmfast" / "eval"
    pkg.mkdir(parents=True)
    git = ["git", "-c", "user.email=a@b", "-c", "user.name=a"]
    subprocess.run([*git, "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "-C", str(repo), "commit", "-q", "--allow-empty", "-m", "x"], check=True)
    assert runner.git_sha(pkg / "runner.py") is None
    checkout = repo / "mmfast" / "eval"
    checkout.mkdir(parents=True)  # a source checkout: the repository's top holds the package
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert runner.git_sha(checkout / "runner.py") == head
