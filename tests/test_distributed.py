"""Data-parallel evaluation (accelerate, 2 CPU processes, gloo) equals a single-process run."""

from __future__ import annotations

import json

import pytest

from mmfast.config import load_recipe
from mmfast.eval.runner import run_eval


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from mmfast.world import write_world

    root = tmp_path_factory.mktemp("dpworld")
    write_world(root, seed=0, n_train=0, n_val=8, pope_images=6, progress=False)
    return root


def _recipe(tiny_dir, world, out, methods=None):
    return load_recipe(
        {
            "name": "dp",
            **(methods or {}),
            "model": {"name": str(tiny_dir), "device": "cpu"},
            "eval": {
                "tasks": ["pope", "chair"],
                "data": {"dataset": "world", "root": str(world)},
                "pope": {"max_new_tokens": 4, "splits": ["random", "adversarial"]},
                "chair": {"n_images": 5, "max_new_tokens": 8},
                "batch_size": 3,
            },
            "output": {"dir": str(out)},
        }
    )


def _answers(path):
    return {r["doc_id"]: (r["resps"], r["filtered_resps"]) for r in map(json.loads, path.read_text().splitlines())}


@pytest.mark.slow
def test_two_processes_equal_one(tiny_dir, tiny_mm, world, tmp_path):
    single = run_eval(_recipe(tiny_dir, world, tmp_path / "one"), limit=6, mm=tiny_mm)
    multi = run_eval(_recipe(tiny_dir, world, tmp_path / "two"), limit=6, num_processes=2)
    assert multi["metrics"] == single["metrics"]
    assert multi["protocol"]["processes"] == 2
    one, two = _answers(tmp_path / "one" / "samples.jsonl"), _answers(tmp_path / "two" / "samples.jsonl")
    assert list(one) == list(two) and one == two  # same samples, same order, same answers
    assert (tmp_path / "two" / "samples.rank0.jsonl").exists() and (tmp_path / "two" / "samples.rank1.jsonl").exists()
    # resume per shard: rerunning does no new work and gives the same summary
    again = run_eval(_recipe(tiny_dir, world, tmp_path / "two"), limit=6, num_processes=2)
    assert again["metrics"] == single["metrics"]


# every kind of method: a pruner with per-image decisions and a branch decoder that re-encodes, a
# sampling decoder with a trained-style draft, and the transformed-image branch decoder
STACKS = {
    "mustdrop+vcd": {
        "pruning": [
            {
                "method": "mustdrop",
                "params": {
                    "window": 2,
                    "layer_mapping": "proportional",
                    "sim_threshold": -1.0,
                    "lambda_g": 0.2,
                    "lambda_i": 1.0,
                },
            }
        ],
        "decoding": {"method": "vcd"},
    },
    "sample+msd": {"decoding": {"method": "sample"}, "speculative": {"method": "msd"}},
    "ritual": {"decoding": {"method": "ritual"}},
}


@pytest.mark.slow
@pytest.mark.parametrize("stack", list(STACKS))
def test_two_processes_equal_one_for_every_method_kind(stack, tiny_dir, tiny_mm, world, tmp_path):
    """Per-sample randomness and per-image decisions: the shard a sample lands in never matters."""
    if stack == "sample+msd":
        from mmfast.speculative._eagle_model import _model_dir, write_random_draft

        d = _model_dir(tiny_mm)
        if not (d / "msd").exists():
            write_random_draft(tiny_mm, "msd", d / "msd")
    methods = STACKS[stack]
    single = run_eval(_recipe(tiny_dir, world, tmp_path / "one", methods), limit=4, mm=tiny_mm)
    multi = run_eval(_recipe(tiny_dir, world, tmp_path / "two", methods), limit=4, num_processes=2)
    assert multi["protocol"]["processes"] == 2
    assert _answers(tmp_path / "one" / "samples.jsonl") == _answers(tmp_path / "two" / "samples.jsonl")
    assert multi["metrics"] == single["metrics"]
