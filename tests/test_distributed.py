"""Data-parallel evaluation (accelerate, 2 CPU processes, gloo) equals a single-process run."""

from __future__ import annotations

import json
import os

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
    assert not list((tmp_path / "two").glob("samples.rank*"))  # merged into samples.jsonl, then removed
    # rerunning does no new work and gives the same summary
    again = run_eval(_recipe(tiny_dir, world, tmp_path / "two"), limit=6, num_processes=2)
    assert again["metrics"] == single["metrics"]
    assert _answers(tmp_path / "two" / "samples.jsonl") == one


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


# -- resume across process counts, in this process: the ranks in the order the barriers impose -------------


def _emulated(monkeypatch, recipe, limit, world_size, mm, merge=True):
    """An N-process run in this process: rank 0 (checks, folds, runs its share), ranks 1.., then rank 0's
    merge (``merge=False``: a run stopped before it). Only ``shard_info`` and ``barrier`` are stood in for."""
    from mmfast.eval import distributed, rundir, runner

    merges = []
    out = runner.output_dir(recipe, None)
    with monkeypatch.context() as m:
        m.setattr(runner, "barrier", lambda: None)
        m.setattr(distributed, "barrier", lambda: None)
        m.setattr(runner, "gather_and_finish", lambda *a: merges.append(a) or {"counts": {"failed": 0}})
        m.setenv(rundir.LOCK_OWNER_ENV, str(os.getpid()))  # the launcher's lock, held here
        with rundir.claim(out):
            for rank in range(world_size):
                m.setattr(runner, "shard_info", lambda r=rank: (r, world_size))
                runner.run_eval(recipe, limit=limit, mm=mm)
            m.setattr(distributed, "shard_info", lambda: (0, world_size))
            return distributed.gather_and_finish(*merges[0]) if merge else None


def _count_batches(monkeypatch):
    from mmfast.eval import runner

    ran: list[str] = []
    real = runner.prepare_batch

    def counted(mm, samples):
        ran.extend(s.doc_id for s in samples)
        return real(mm, samples)

    monkeypatch.setattr(runner, "prepare_batch", counted)
    return ran


def _pope_recipe(tiny_dir, world, out, splits=("random", "adversarial"), **eval_kw):
    return load_recipe(
        {
            "name": "dp",
            "model": {"name": str(tiny_dir), "device": "cpu"},
            "eval": {
                "tasks": ["pope"],
                "data": {"dataset": "world", "root": str(world)},
                "pope": {"max_new_tokens": 2, "splits": list(splits)},
                **eval_kw,
            },
            "output": {"dir": str(out)},
        }
    )


def _random_ids(world, n: int) -> list[str]:
    """The doc_ids of the random split's first ``n`` questions (its plan order)."""
    lines = (world / "pope" / "world_pope_random.json").read_text().splitlines()[:n]
    return [f"pope_random/{json.loads(line)['question_id']}" for line in lines]


def test_a_single_process_run_resumes_with_two_processes_without_recomputing(
    tiny_dir, tiny_mm, world, tmp_path, monkeypatch
):
    out = tmp_path / "run"
    single = run_eval(_pope_recipe(tiny_dir, world, out), limit=5, mm=tiny_mm)
    before = (out / "samples.jsonl").read_text()
    ran = _count_batches(monkeypatch)
    merged = _emulated(monkeypatch, _pope_recipe(tiny_dir, world, out), 5, 2, tiny_mm)
    assert ran == [], "a finished sample was recomputed"
    assert (out / "samples.jsonl").read_text() == before and merged["metrics"] == single["metrics"]
    # a smaller limit on two processes keeps the records past it, and a larger one later reuses them
    _emulated(monkeypatch, _pope_recipe(tiny_dir, world, out), 3, 2, tiny_mm)
    assert ran == [] and sorted((out / "samples.jsonl").read_text().splitlines()) == sorted(before.splitlines())
    again = run_eval(_pope_recipe(tiny_dir, world, out), limit=5, mm=tiny_mm)
    assert ran == [] and again["metrics"] == single["metrics"]


def test_a_stopped_runs_shards_never_override_the_current_inputs_records(
    tiny_dir, tiny_mm, world, tmp_path, monkeypatch
):
    """Two processes stop before their merge; a question's text then changes, and the run resumes with
    another --limit (so samples change shards) and another process count: the stale record in the old
    shard neither wins the merge nor hides the recomputed one (as one process on the same inputs)."""
    import shutil

    w = tmp_path / "world"
    shutil.copytree(world, w)
    out, ref = tmp_path / "run", tmp_path / "ref"
    _emulated(monkeypatch, _pope_recipe(tiny_dir, w, out), 4, 2, tiny_mm, merge=False)
    assert {p.name for p in out.glob("samples.rank*")} == {"samples.rank0.jsonl", "samples.rank1.jsonl"}
    qfile = w / "pope" / "world_pope_adversarial.json"
    lines = [json.loads(line) for line in qfile.read_text().splitlines()]
    lines[1]["text"] = lines[1]["text"].replace("Is there", "Do you see")
    qfile.write_text("".join(json.dumps(q) + "\n" for q in lines))
    for world_size in (3, 2):  # the first folds the stopped run's shards, the second resumes from it
        resumed = _emulated(monkeypatch, _pope_recipe(tiny_dir, w, out), 5, world_size, tiny_mm)
    single = run_eval(_pope_recipe(tiny_dir, w, ref), limit=5, mm=tiny_mm)
    assert resumed["counts"] == single["counts"] and resumed["counts"]["not_run"] == 0
    assert resumed["metrics"] == single["metrics"]
    assert _answers(out / "samples.jsonl") == _answers(ref / "samples.jsonl")
    prompts = {r["doc_id"]: r["prompt"] for r in map(json.loads, (out / "samples.jsonl").read_text().splitlines())}
    assert any("Do you see" in p for p in prompts.values())


def _failing(monkeypatch, doc_ids: set[str], message: str) -> None:
    """Samples ``doc_ids`` raise when their batch is prepared (as a corrupt input would)."""
    from mmfast.eval import runner

    real = runner.prepare_batch

    def prepare(mm, samples):
        if any(s.doc_id in doc_ids for s in samples):
            raise RuntimeError(message)
        return real(mm, samples)

    monkeypatch.setattr(runner, "prepare_batch", prepare)


def test_the_failure_budget_is_the_whole_runs_in_every_process(tiny_dir, tiny_mm, world, tmp_path, monkeypatch):
    """Two failures among 10 samples with max_failures 0.1 (1 allowed): one process stops, and so do two
    processes that each see one of them."""
    from mmfast.errors import RunAbortedError

    _failing(monkeypatch, set(_random_ids(world, 2)), "broken input")  # sample 0 on rank 0, sample 1 on rank 1
    for out, processes in ((tmp_path / "one", 1), (tmp_path / "two", 2)):
        recipe = _pope_recipe(tiny_dir, world, out, splits=["random"], max_failures=0.1, batch_size=1)
        with pytest.raises(RunAbortedError, match="2 of 10 samples failed"):
            if processes == 1:
                run_eval(recipe, limit=10, mm=tiny_mm)
            else:
                _emulated(monkeypatch, recipe, 10, 2, tiny_mm)


def test_old_failures_waiting_for_their_retry_are_not_this_runs(tiny_dir, tiny_mm, world, tmp_path, monkeypatch):
    """A run that accepted two failures is rerun with max_failures 0 once their cause is fixed: it retries
    both and finishes, instead of stopping on the second's old error before retrying it."""
    out = tmp_path / "run"
    ids = _random_ids(world, 10)
    with monkeypatch.context() as m:
        _failing(m, {ids[2], ids[5]}, "transient")
        loose = _pope_recipe(tiny_dir, world, out, splits=["random"], max_failures=1.0, batch_size=1)
        assert run_eval(loose, limit=10, mm=tiny_mm)["counts"]["failed"] == 2
    ran = _count_batches(monkeypatch)
    strict = _pope_recipe(tiny_dir, world, out, splits=["random"], max_failures=0.0, batch_size=1)
    again = run_eval(strict, limit=10, mm=tiny_mm)
    assert sorted(ran) == sorted([ids[2], ids[5]]) and again["counts"]["failed"] == 0


def test_the_samples_left_are_shared_evenly_however_the_earlier_run_progressed(
    tiny_dir, tiny_mm, world, tmp_path, monkeypatch
):
    """A resumed run splits the samples left to do among its processes, not the planned ones: when an earlier
    run finished every other sample (here: its odd ones failed), two processes get half the retries each
    instead of one doing them all while the other waits at the barrier (whose timeout ends a long run)."""
    from mmfast.eval import runner

    out = tmp_path / "run"
    ids = _random_ids(world, 10)
    with monkeypatch.context() as m:
        _failing(m, set(ids[1::2]), "transient")
        loose = _pope_recipe(tiny_dir, world, out, splits=["random"], max_failures=1.0, batch_size=1)
        assert run_eval(loose, limit=10, mm=tiny_mm)["counts"]["failed"] == 5
    by_rank: dict[int, list[str]] = {}
    real = runner.prepare_batch

    def counted(mm, samples):
        by_rank.setdefault(runner.shard_info()[0], []).extend(s.doc_id for s in samples)
        return real(mm, samples)

    monkeypatch.setattr(runner, "prepare_batch", counted)
    merged = _emulated(monkeypatch, loose, 10, 2, tiny_mm)
    ran = [by_rank.get(rank, []) for rank in (0, 1)]
    assert sorted(ran[0] + ran[1]) == sorted(ids[1::2]) and merged["counts"]["failed"] == 0
    assert sorted(map(len, ran)) == [2, 3], f"rank 0 ran {ran[0]}, rank 1 ran {ran[1]}"
