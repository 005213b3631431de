"""Fault injection for ``mmfast eval``: crashes at random points, damaged record files, inputs
changed under the same path, concurrent runs, stale locks, foreign and unusable output directories,
failed samples, killed data-parallel runs. Each asserts nothing lost, nothing stale, nothing
duplicated, and nothing silent."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mmfast.config import load_recipe
from mmfast.errors import InputError
from mmfast.eval import records as records_mod
from mmfast.eval.records import RecordStore
from mmfast.eval.rundir import LOCK_NAME, OutputLock, OutputLockedError
from mmfast.eval.runner import RunAbortedError, failure_budget, run_eval

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    from mmfast.world import write_world

    root = tmp_path_factory.mktemp("fiworld")
    write_world(root, seed=0, n_train=0, n_val=14, pope_images=14, progress=False)
    return root


def _recipe(tiny_dir, world, out, *, overwrite=False, **eval_over):
    ev = {
        "tasks": ["pope"],
        "data": {"dataset": "world", "root": str(world)},
        "pope": {"max_new_tokens": 2, "splits": ["random", "adversarial"]},
        "chair": {"n_images": 4, "max_new_tokens": 3},
        "batch_size": 4,
    }
    ev.update(eval_over)
    return load_recipe(
        {
            "name": "fi",
            "model": {"name": str(tiny_dir), "device": "cpu"},
            "eval": ev,
            "output": {"dir": str(out), "overwrite": overwrite},
        }
    )


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def _answers(path: Path) -> dict[str, tuple]:
    return {r["doc_id"]: (r["target"], r["resps"], r["fingerprint"]) for r in _lines(path)}


def _assert_complete(path: Path, n: int) -> list[dict]:
    """Exactly ``n`` records, one per doc_id, all successful, all with a fingerprint."""
    recs = _lines(path)
    ids = [r["doc_id"] for r in recs]
    assert len(ids) == len(set(ids)) == n, "records lost or duplicated"
    assert all("error" not in r and r.get("fingerprint") for r in recs)
    return recs


@pytest.fixture(scope="module")
def reference(tiny_dir, tiny_mm, world, tmp_path_factory) -> Path:
    """An uninterrupted run: POPE random + adversarial, 80 questions each (160 records)."""
    out = tmp_path_factory.mktemp("fi") / "ref"
    run_eval(
        _recipe(tiny_dir, world, out, batch_size=16, pope={"max_new_tokens": 1, "splits": ["random", "adversarial"]}),
        limit=80,
        mm=tiny_mm,
    )
    _assert_complete(out / "samples.jsonl", 160)
    return out


class _Crash(BaseException):
    """A simulated kill: not an Exception, so nothing in mmfast may catch it."""


def test_crash_at_random_points_then_resume(tiny_dir, tiny_mm, world, tmp_path, monkeypatch):
    """Crash after a random number of batches (sometimes leaving a half-written line), resume, repeat:
    the final records equal an uninterrupted run's, with no duplicates and nothing quarantined but
    the torn lines."""
    rng = random.Random(1234)
    recipe = _recipe(tiny_dir, world, tmp_path / "crashy", tasks=["pope", "chair"], batch_size=2)
    fresh = run_eval(
        recipe.replace(output=dataclasses.replace(recipe.output, dir=str(tmp_path / "fresh"))), limit=4, mm=tiny_mm
    )
    real_append = RecordStore.append
    torn = 0
    for attempt in range(20):  # noqa: B007 - read after the loop
        budget = rng.randint(0, 3)
        tear = rng.random() < 0.5

        def append(self, recs, _state={"n": 0}, _budget=budget, _tear=tear):  # noqa: B006 - the dict is the call counter
            if _state["n"] >= _budget:
                if _tear:
                    with open(self.path, "ab") as fh:
                        fh.write(b'{"doc_id": "pope_random/1", "resps": [["ye')
                raise _Crash
            _state["n"] += 1
            real_append(self, recs)

        monkeypatch.setattr(RecordStore, "append", append)
        try:
            summary = run_eval(recipe, limit=4, mm=tiny_mm)
            break
        except _Crash:
            torn += tear
            assert not (tmp_path / "crashy" / LOCK_NAME).exists(), "the lock must be released however the run ends"
    else:
        pytest.fail("the run never finished")
    monkeypatch.setattr(RecordStore, "append", real_append)
    assert attempt > 0, "no crash was injected"

    def counts(c):
        return {k: v for k, v in c.items() if k != "quarantined_lines"}

    assert summary["metrics"] == fresh["metrics"] and counts(summary["counts"]) == counts(fresh["counts"])
    got = _answers(tmp_path / "crashy" / "samples.jsonl")
    want = _answers(tmp_path / "fresh" / "samples.jsonl")
    assert got == want  # nothing lost, nothing duplicated, same answers
    q = tmp_path / "crashy" / "samples.quarantine.jsonl"
    assert (len(q.read_bytes().splitlines()) if q.exists() else 0) == torn


@pytest.mark.parametrize(
    "damage", [b'{"doc_id": "pope_random/3", "ta', b"", b'{"doc_id": "\xff\xfe broken"}', b"[1, 2]"]
)
def test_damaged_middle_line_quarantined(damage, reference, tiny_dir, tiny_mm, world, tmp_path, caplog):
    """One damaged line in the middle of a 160-record file: 159 kept byte for byte, 1 recomputed,
    the damaged bytes in samples.quarantine.jsonl, a warning naming the line."""
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    path = out / "samples.jsonl"
    lines = path.read_bytes().splitlines()
    victim = json.loads(lines[79])["doc_id"]
    path.write_bytes(b"\n".join(lines[:79] + [damage] + lines[80:]) + b"\n")
    recipe = _recipe(
        tiny_dir, world, out, batch_size=16, pope={"max_new_tokens": 1, "splits": ["random", "adversarial"]}
    )
    with caplog.at_level(logging.WARNING):
        s = run_eval(recipe, limit=80, mm=tiny_mm)
    assert any("line 80" in r.getMessage() and "quarantine" in r.getMessage() for r in caplog.records)
    after = path.read_bytes().splitlines()
    assert len(after) == 160
    kept = [x for x in after if json.loads(x)["doc_id"] != victim]
    assert kept == lines[:79] + lines[80:]  # every other record untouched
    assert _answers(path) == _answers(reference / "samples.jsonl")  # the victim recomputed, same answer
    assert (out / "samples.quarantine.jsonl").read_bytes() == damage + b"\n"
    assert s["counts"]["finished"] == 160 and s["counts"]["quarantined_lines"] == 1
    assert s["metrics"] == json.loads((reference / "summary.json").read_text())["metrics"]


def test_store_keeps_records_around_several_damaged_lines(tmp_path):
    path = tmp_path / "samples.jsonl"
    good = [json.dumps({"doc_id": f"d{i}", "resps": [["x"]]}).encode() for i in range(6)]
    path.write_bytes(
        b"\n".join([good[0], b"\xc3\x28", good[1], b"   ", good[2], b"{", good[3], good[4], b"null", good[5]])
        + b'\n{"doc'
    )
    store = RecordStore(path)
    assert sorted(store.records) == [f"d{i}" for i in range(6)]
    assert [d.line_no for d in store.quarantined] == [2, 4, 6, 9, 11]
    assert path.read_bytes() == b"".join(g + b"\n" for g in good)
    assert len(path.with_name("samples.quarantine.jsonl").read_bytes().splitlines()) == 5
    assert RecordStore(path).quarantined == []  # clean now


def test_a_whole_last_record_without_its_newline_is_kept_and_ended(tmp_path):
    """A kill between a record's text and its newline: the record is whole, so it is kept, and its line is
    ended before anything is appended, so the next record does not run on from it."""
    path = tmp_path / "samples.jsonl"
    first, second = (json.dumps({"doc_id": d, "resps": [["x"]]}).encode() for d in ("a", "b"))
    path.write_bytes(first + b"\n" + second)
    store = RecordStore(path)
    assert sorted(store.records) == ["a", "b"] and store.quarantined == []
    store.append([{"doc_id": "c", "resps": [["y"]]}])
    again = RecordStore(path)
    assert sorted(again.records) == ["a", "b", "c"] and again.quarantined == []


def test_compressed_records_refused_on_resume_and_resumed_once_decompressed(
    reference, tiny_dir, tiny_mm, world, tmp_path
):
    """A finished run whose records were gzipped (as under benchmarks/) is read by the finished-run
    reader, but resuming into it is refused before anything runs (it would otherwise start afresh
    beside the .gz); once decompressed, it resumes with every record reused."""
    import gzip

    from mmfast.eval.intervals import read_records

    out = tmp_path / "run"
    shutil.copytree(reference, out)
    plain = out / "samples.jsonl"
    packed = out / "samples.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    plain.unlink()
    assert len(read_records(out)) == 160
    recipe = _recipe(
        tiny_dir, world, out, batch_size=16, pope={"max_new_tokens": 1, "splits": ["random", "adversarial"]}
    )
    before = packed.read_bytes()
    with pytest.raises(InputError, match=r"samples\.jsonl\.gz: this run's records are compressed.*gunzip"):
        run_eval(recipe, limit=80, mm=tiny_mm)
    assert not plain.exists() and packed.read_bytes() == before
    plain.write_bytes(gzip.decompress(before))
    packed.unlink()
    s = run_eval(recipe, limit=80, mm=tiny_mm)
    assert plain.read_bytes() == gzip.decompress(before)  # every record reused: nothing appended
    assert s["counts"]["finished"] == 160


def _replace_questions(path: Path) -> list[dict]:
    """Other questions under the same ids (labels flipped, text changed), as a same-path replacement."""
    qs = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    for q in qs:
        q["label"] = "no" if q["label"] == "yes" else "yes"
        q["text"] = q["text"].replace("Is there", "Do you see")
    path.write_text("".join(json.dumps(q) + "\n" for q in qs))
    return qs


def test_changed_question_file_recomputed(tiny_dir, tiny_mm, world, tmp_path, caplog):
    """A POPE file replaced at the same path by other questions reusing the ids: the rerun recomputes
    them, its metrics equal a fresh run's, and the summary's checksum is the data the answers came from."""
    w = tmp_path / "world"
    shutil.copytree(world, w)
    out = tmp_path / "run"
    recipe = _recipe(tiny_dir, w, out, pope={"max_new_tokens": 2, "splits": ["random"]})
    first = run_eval(recipe, limit=12, mm=tiny_mm)
    qfile = w / "pope" / "world_pope_random.json"
    new = _replace_questions(qfile)
    with caplog.at_level(logging.WARNING):
        rerun = run_eval(recipe, limit=12, mm=tiny_mm)
    assert any("12 finished sample(s) were computed from other inputs" in r.getMessage() for r in caplog.records)
    fresh = run_eval(
        recipe.replace(output=dataclasses.replace(recipe.output, dir=str(tmp_path / "fresh"))), limit=12, mm=tiny_mm
    )
    assert rerun["metrics"] == fresh["metrics"]
    recs = _assert_complete(out / "samples.jsonl", 12)
    by_id = {q["question_id"]: q for q in new}
    assert all(r["target"] == by_id[r["meta"]["question_id"]]["label"] for r in recs)
    assert all(r["meta"]["question"] == by_id[r["meta"]["question_id"]]["text"] for r in recs)
    import hashlib

    assert (
        rerun["protocol"]["tasks"]["pope"]["files"]["random"]["sha256"]
        == hashlib.sha256(qfile.read_bytes()).hexdigest()
    )
    assert (
        rerun["protocol"]["samples_digest"]
        == fresh["protocol"]["samples_digest"]
        != first["protocol"]["samples_digest"]
    )


def test_changed_image_recomputed(tiny_dir, tiny_mm, world, tmp_path):
    """An image replaced under the same name: only the samples about it are recomputed."""
    w = tmp_path / "world"
    shutil.copytree(world, w)
    out = tmp_path / "run"
    recipe = _recipe(tiny_dir, w, out, pope={"max_new_tokens": 2, "splits": ["random"]})
    run_eval(recipe, limit=12, mm=tiny_mm)
    before = {r["doc_id"]: r for r in _lines(out / "samples.jsonl")}
    img_name = next(iter(before.values()))["image"]
    victim = w / "images" / "val" / img_name
    other = next(p for p in sorted(victim.parent.iterdir()) if p.name != img_name)
    shutil.copyfile(other, victim)
    run_eval(recipe, limit=12, mm=tiny_mm)
    after = {r["doc_id"]: r for r in _assert_complete(out / "samples.jsonl", 12)}
    changed = {d for d, r in after.items() if r != before[d]}
    assert changed == {d for d, r in after.items() if r["image"] == img_name} and 0 < len(changed) < 12
    assert all(after[d]["fingerprint"] != before[d]["fingerprint"] for d in changed)


def test_concurrent_run_refused_with_owner(tiny_dir, tiny_mm, world, tmp_path):
    out = tmp_path / "run"
    recipe = _recipe(tiny_dir, world, out)
    with OutputLock(out):
        with pytest.raises(OutputLockedError, match=rf"in use by another mmfast run \(pid {os.getpid()} on host"):
            run_eval(recipe, limit=2, mm=tiny_mm)
        from mmfast.cli import main

        cfg = tmp_path / "r.yaml"
        cfg.write_text(json.dumps(recipe.to_dict()))
        assert main(["-q", "eval", str(cfg), "--limit", "2"]) == 2
    assert not (out / "samples.jsonl").exists()  # the refused runs wrote nothing
    run_eval(recipe, limit=2, mm=tiny_mm)  # free again
    _assert_complete(out / "samples.jsonl", 4)


def test_stale_lock_of_dead_process_taken_over(tiny_dir, tiny_mm, world, tmp_path, caplog):
    out = tmp_path / "run"
    out.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (out / LOCK_NAME).write_text(
        json.dumps({"pid": dead.pid, "host": os.uname().nodename, "started": "earlier", "command": "x"})
    )
    with caplog.at_level(logging.WARNING):
        run_eval(_recipe(tiny_dir, world, out), limit=2, mm=tiny_mm)
    assert any("stale lock" in r.getMessage() and f"pid {dead.pid}" in r.getMessage() for r in caplog.records)
    assert not (out / LOCK_NAME).exists()
    _assert_complete(out / "samples.jsonl", 4)


def test_overwrite_removes_only_own_files(tiny_dir, tiny_mm, world, tmp_path):
    out = tmp_path / "run"
    run_eval(_recipe(tiny_dir, world, out, tasks=["pope", "chair"]), limit=2, mm=tiny_mm)
    listed = json.loads((out / "run.json").read_text())["files"]
    assert {"run.json", "summary.json", "samples.jsonl", "chair_image_ids.txt"} <= set(listed)
    (out / "notes.txt").write_text("my notes")
    (out / "plots").mkdir()
    (out / "plots" / "a.png").write_bytes(b"png")
    other = _recipe(tiny_dir, world, out, overwrite=True, batch_size=3)  # another recipe: starts over
    run_eval(other, limit=1, mm=tiny_mm)
    assert (out / "notes.txt").read_text() == "my notes" and (out / "plots" / "a.png").exists()
    assert not (out / "chair_image_ids.txt").exists()  # the earlier run's side file is gone
    _assert_complete(out / "samples.jsonl", 2)
    assert json.loads((out / "run.json").read_text())["recipe_hash"] == other.hash()


@pytest.mark.parametrize("overwrite", [False, True])
def test_foreign_directory_refused(overwrite, tiny_dir, tiny_mm, world, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("precious")
    with pytest.raises(InputError, match="not an mmfast run directory"):
        run_eval(_recipe(tiny_dir, world, out, overwrite=overwrite), limit=1, mm=tiny_mm)
    assert sorted(p.name for p in out.iterdir()) == ["thesis.tex"]


def test_damaged_run_json_is_an_input_error(tiny_dir, tiny_mm, world, tmp_path):
    out = tmp_path / "run"
    run_eval(_recipe(tiny_dir, world, out), limit=1, mm=tiny_mm)
    (out / "run.json").write_text('{"recipe_ha')
    with pytest.raises(InputError, match="run.json is damaged"):
        run_eval(_recipe(tiny_dir, world, out), limit=1, mm=tiny_mm)


def test_unusable_output_paths(tiny_dir, tiny_mm, world, tmp_path):
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    with pytest.raises(InputError, match="is a file, not a directory"):
        run_eval(_recipe(tiny_dir, world, a_file), limit=1, mm=tiny_mm)
    with pytest.raises(InputError, match="cannot create output directory"):
        run_eval(_recipe(tiny_dir, world, a_file / "run"), limit=1, mm=tiny_mm)
    deep = tmp_path / "missing" / "parents" / "run"  # missing parents are created
    run_eval(_recipe(tiny_dir, world, deep), limit=1, mm=tiny_mm)
    _assert_complete(deep / "samples.jsonl", 2)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_output(tiny_dir, tiny_mm, world, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(InputError, match="cannot create output directory"):
            run_eval(_recipe(tiny_dir, world, ro / "run"), limit=1, mm=tiny_mm)
        with pytest.raises(InputError, match="not writable"):
            run_eval(_recipe(tiny_dir, world, ro), limit=1, mm=tiny_mm)
    finally:
        ro.chmod(0o755)


def test_failure_budget():
    assert failure_budget(0.0, 1000) == 0
    assert failure_budget(0.05, 12) == 0
    assert failure_budget(0.05, 100) == 5
    assert failure_budget(1.0, 7) == 7


def test_missing_image_is_loud(tiny_dir, tiny_mm, world, tmp_path, caplog):
    """A missing image: with max_failures 0 the run is refused before the model loads (naming the
    image); a tolerated failure is counted, listed in the summary and the log, and `mmfast eval`
    exits 3 unless --allow-failures."""
    w = tmp_path / "world"
    shutil.copytree(world, w)
    out = tmp_path / "run"
    recipe = _recipe(tiny_dir, w, out, pope={"max_new_tokens": 2, "splits": ["random"]}, batch_size=1, max_failures=0.0)
    qs = _lines(w / "pope" / "world_pope_random.json")[:12]
    gone = qs[8]["image"]
    first_bad = next(i for i, q in enumerate(qs) if q["image"] == gone)
    n_bad = sum(1 for q in qs if q["image"] == gone)
    (w / "images" / "val" / gone).unlink()
    with pytest.raises(
        InputError, match=f"1 image\\(s\\) of this evaluation are missing .*{gone}.*{n_bad} of 12 samples would fail"
    ):
        run_eval(recipe, limit=12, mm=tiny_mm)
    assert not (out / "samples.jsonl").exists()  # refused before anything ran
    assert first_bad < 12
    tolerant = _recipe(
        tiny_dir, w, out, pope={"max_new_tokens": 2, "splits": ["random"]}, batch_size=1, max_failures=0.5
    )
    with caplog.at_level(logging.WARNING):
        s = run_eval(
            tolerant.replace(output=dataclasses.replace(tolerant.output, overwrite=True)), limit=12, mm=tiny_mm
        )
    assert s["counts"]["failed"] == n_bad and s["counts"]["finished"] == 12 - n_bad
    assert {f["doc_id"] for f in s["failures"]} == {r["doc_id"] for r in _lines(out / "samples.jsonl") if "error" in r}
    assert any("samples FAILED" in r.getMessage() for r in caplog.records)
    from mmfast.cli import main

    cfg = tmp_path / "r.yaml"
    cfg.write_text(json.dumps(tolerant.to_dict()))
    assert main(["-q", "eval", str(cfg), "--limit", "12"]) == 3
    assert main(["-q", "eval", str(cfg), "--limit", "12", "--allow-failures"]) == 0


def test_a_failed_batch_retried_one_at_a_time_is_logged(tiny_dir, tiny_mm, world, tmp_path, monkeypatch, caplog):
    """Failures are loud: a batch whose generation raises (e.g. out of memory at that batch size) is
    retried sample by sample, and the batch's error is logged even when every sample then succeeds."""
    from mmfast.eval import runner

    real = runner.prepare_batch

    def prepare(mm, samples):
        if len(samples) > 1:
            raise RuntimeError("out of memory at this batch size")
        return real(mm, samples)

    monkeypatch.setattr(runner, "prepare_batch", prepare)
    recipe = _recipe(tiny_dir, world, tmp_path / "run", pope={"max_new_tokens": 1, "splits": ["random"]})
    with caplog.at_level(logging.WARNING, logger="mmfast.eval.runner"):
        summary = run_eval(recipe, limit=4, mm=tiny_mm)
    assert summary["counts"]["finished"] == 4 and summary["counts"]["failed"] == 0
    assert "out of memory at this batch size" in caplog.text and "one at a time" in caplog.text


def test_corrupt_image_stops_at_the_first_failure(tiny_dir, tiny_mm, world, tmp_path):
    """An image that exists but cannot be read fails its samples while running: with max_failures 0
    the run stops at the first one, keeping every record finished before it."""
    w = tmp_path / "world"
    shutil.copytree(world, w)
    out = tmp_path / "run"
    recipe = _recipe(tiny_dir, w, out, pope={"max_new_tokens": 2, "splits": ["random"]}, batch_size=1, max_failures=0.0)
    qs = _lines(w / "pope" / "world_pope_random.json")[:12]
    bad = qs[8]["image"]
    first_bad = next(i for i, q in enumerate(qs) if q["image"] == bad)
    (w / "images" / "val" / bad).write_bytes(b"not an image")
    with pytest.raises(RunAbortedError, match="1 of 12 samples failed, more than eval.max_failures=0.0 allows"):
        run_eval(recipe, limit=12, mm=tiny_mm)
    recs = _lines(out / "samples.jsonl")
    assert len(recs) == first_bad + 1 and "error" in recs[-1] and "cannot be read" in recs[-1]["error"]


@pytest.mark.parametrize("bad", ["0", "-3", "x"])
def test_bad_limit_exits_2(bad, capsys):
    from mmfast.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["eval", "recipe.yaml", "--limit", bad])
    assert exc.value.code == 2 and "--limit" in capsys.readouterr().err
    with pytest.raises(InputError, match="limit must be a whole number >= 1"):
        run_eval(load_recipe({"eval": {"tasks": ["pope"]}}), limit=int(bad) if bad != "x" else 0)


def test_doc_id_reaches_the_session(tiny_dir, tiny_mm, world, tmp_path, monkeypatch):
    from mmfast.pipeline import Session

    seen: list[str] = []
    real_run = Session.run

    def run(self, batch, **kw):
        seen.extend(m["doc_id"] for m in batch.meta)
        return real_run(self, batch, **kw)

    monkeypatch.setattr(Session, "run", run)
    run_eval(_recipe(tiny_dir, world, tmp_path / "run"), limit=2, mm=tiny_mm)
    assert seen == [r["doc_id"] for r in _lines(tmp_path / "run" / "samples.jsonl")]


# -- data-parallel lifecycle (real processes) --------------------------------------------------------


def _dp_cmd(tiny_dir, world, tmp_path, out) -> tuple[list[str], dict]:
    cfg = tmp_path / "dp.yaml"
    cfg.write_text(
        json.dumps(
            {
                "name": "dpfi",
                "model": {"name": str(tiny_dir), "device": "cpu"},
                "eval": {
                    "tasks": ["pope"],
                    "data": {"dataset": "world", "root": str(world)},
                    "pope": {"max_new_tokens": 8, "splits": ["random"]},
                    "batch_size": 1,
                },
                "output": {"dir": str(out)},
            }
        )
    )
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), PYTHONUNBUFFERED="1"
    )
    return [sys.executable, "-m", "mmfast", "-q", "eval", str(cfg), "--num-processes", "2", "--limit", "24"], env


def _workers_of(pid: int) -> list[int]:
    import psutil

    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    import psutil

    deadline = time.monotonic() + timeout
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.1)
    return alive


def _wait_shards(out: Path, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    shards = [out / "samples.rank0.jsonl", out / "samples.rank1.jsonl"]
    while time.monotonic() < deadline and proc.poll() is None:
        if all(s.exists() and s.stat().st_size for s in shards):
            return
        time.sleep(0.05)
    raise AssertionError(f"the workers did not start writing (exit {proc.poll()})")


@pytest.mark.slow
def test_data_parallel_killed_launcher_stops_workers_and_resumes(tiny_dir, tiny_mm, world, tmp_path):
    """SIGKILL the launcher alone mid-run: both workers die with it (nothing keeps writing); the
    rerun completes, equal to a single-process run, nothing lost or duplicated."""
    out = tmp_path / "dp"
    cmd, env = _dp_cmd(tiny_dir, world, tmp_path, out)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _wait_shards(out, proc)
    workers = _workers_of(proc.pid)
    assert len(workers) == 2
    proc.kill()
    proc.wait()
    assert _wait_gone(workers, 15) == [], "workers outlived the launcher"
    sizes = [(out / f"samples.rank{r}.jsonl").stat().st_size for r in range(2)]
    time.sleep(1.0)
    assert sizes == [(out / f"samples.rank{r}.jsonl").stat().st_size for r in range(2)], (
        "a shard is still being written"
    )
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "stale lock" in done.stderr
    assert not (out / ".mmfast-dp-recipe.yaml").exists() and not (out / LOCK_NAME).exists()
    recs = _assert_complete(out / "samples.jsonl", 24)
    spec = json.loads((tmp_path / "dp.yaml").read_text())
    single = run_eval(load_recipe({**spec, "output": {"dir": str(tmp_path / "one")}}), limit=24, mm=tiny_mm)
    assert {r["doc_id"]: r["resps"] for r in recs} == {
        r["doc_id"]: r["resps"] for r in _lines(tmp_path / "one" / "samples.jsonl")
    }
    assert json.loads((out / "summary.json").read_text())["metrics"] == single["metrics"]


@pytest.mark.slow
def test_data_parallel_progress_shows_in_the_log(tiny_dir, world, tmp_path):
    """Progress shows in logs: a data-parallel run logged to a file (no terminal, no -q) logs every
    process's progress lines, as a single-process run logs its own."""
    out = tmp_path / "dp"
    cmd, env = _dp_cmd(tiny_dir, world, tmp_path, out)
    cmd = [c for c in cmd if c != "-q"]
    cmd[cmd.index("--limit") + 1] = "4"
    env["MMFAST_PROGRESS_EVERY"] = "0"
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    for rank in range(2):
        assert f"pope [rank {rank}]: 2/2 samples (100%)" in done.stderr, done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_data_parallel_interrupt_is_clean(sig, code, tiny_dir, world, tmp_path):
    """Ctrl-C / SIGTERM to the launcher: every worker stops, the temporary recipe and the lock are
    removed, the exit status is 128 + signal, and stderr is one line (no traceback)."""
    out = tmp_path / "dp"
    cmd, env = _dp_cmd(tiny_dir, world, tmp_path, out)
    # the launcher starts as from a terminal: a suite run as a background job (`make test &`, a CI step)
    # passes SIGINT on as ignored, and a process started that way rightly keeps ignoring Ctrl-C
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    _wait_shards(out, proc)
    workers = _workers_of(proc.pid)
    assert proc.poll() is None, "the run ended before the signal: nothing was interrupted"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code
    assert _wait_gone(workers, 10) == []
    assert not (out / ".mmfast-dp-recipe.yaml").exists() and not (out / LOCK_NAME).exists()
    said = [x for x in err.splitlines() if "mmfast" in x or "Error" in x]  # (model-loading progress bars aside)
    assert said == [err.splitlines()[-1]] and said[0].startswith("mmfast: ") and "Traceback" not in err, err


def test_records_module_keeps_fsync(tmp_path, monkeypatch):
    """Each append reaches the disk before the next batch starts (fsync per call)."""
    calls = []
    real = os.fsync
    monkeypatch.setattr(records_mod.os, "fsync", lambda fd: (calls.append(fd), real(fd)))
    store = RecordStore(tmp_path / "s.jsonl")
    store.append([{"doc_id": "a"}, {"doc_id": "b"}])
    store.append([{"doc_id": "c"}])
    assert len(calls) == 2 and [r["doc_id"] for r in _lines(tmp_path / "s.jsonl")] == ["a", "b", "c"]


# -- run identity (issue 29) ---------------------------------------------------------------------------


def test_weights_changed_past_the_first_values_is_another_run(tiny_dir, world, tmp_path):
    """Two lm_head rows swapped (e.g. "Yes" and "No"), every value past the first ones: the weights
    fingerprint changes, so a rerun into the same folder is refused instead of reusing the answers."""
    import torch

    import mmfast
    from mmfast.eval.runner import weights_fingerprint

    mm = mmfast.load(tiny_dir, device="cpu", dtype="float32")
    out = tmp_path / "run"
    recipe = _recipe(tiny_dir, world, out, pope={"max_new_tokens": 1, "splits": ["random"]})
    run_eval(recipe, limit=2, mm=mm)
    before = weights_fingerprint(mm.model)
    w = mm.model.get_output_embeddings().weight
    assert w.shape[1] * 5 >= 64, "rows 5 and 7 must lie past the first 64 values"
    with torch.no_grad():
        w[[5, 7]] = w[[7, 5]].clone()
    assert weights_fingerprint(mm.model) != before
    with pytest.raises(InputError, match="results of other model weights"):
        run_eval(recipe, limit=2, mm=mm)


def test_weights_changed_in_place_through_data_are_another_run(tiny_dir, world, tmp_path):
    """``.data`` writes bump no version counter that a cached fingerprint could watch: a rerun on the same
    model object after such a change is refused, not served the earlier answers."""
    import mmfast

    mm = mmfast.load(tiny_dir, device="cpu", dtype="float32")
    recipe = _recipe(tiny_dir, world, tmp_path / "run", pope={"max_new_tokens": 1, "splits": ["random"]})
    run_eval(recipe, limit=2, mm=mm)
    mm.model.get_output_embeddings().weight.data.mul_(0.5)
    with pytest.raises(InputError, match="results of other model weights"):
        run_eval(recipe, limit=2, mm=mm)


def test_model_files_changed_besides_the_weights_are_another_run(tiny_dir, world, tmp_path):
    """A changed model must not reuse old records: the model directory's chat template edited under the same
    path (same weights, same recipe) is refused as another model's results, as changed weights are;
    output.overwrite starts over, and the answers then equal a fresh run's with the edited model."""
    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    out = tmp_path / "run"

    def recipe(where, overwrite=False):
        r = _recipe(tiny_dir, world, where, overwrite=overwrite, pope={"max_new_tokens": 4, "splits": ["random"]})
        return r.replace(model=dataclasses.replace(r.model, name=str(model)))

    run_eval(recipe(out), limit=3)
    before = _answers(out / "samples.jsonl")
    template = model / "chat_template.jinja"
    template.write_text("SYSTEM: answer in French.\n" + template.read_text())
    with pytest.raises(InputError, match="another config, processor, chat template or tokenizer"):
        run_eval(recipe(out), limit=3)
    assert _answers(out / "samples.jsonl") == before  # refused before anything was written
    run_eval(recipe(out, overwrite=True), limit=3)
    run_eval(recipe(tmp_path / "fresh"), limit=3)
    after = _answers(out / "samples.jsonl")
    assert after == _answers(tmp_path / "fresh" / "samples.jsonl") and after != before


def test_resume_with_looser_max_failures_and_another_batch_size(tiny_dir, tiny_mm, world, tmp_path, monkeypatch):
    """A run stopped by eval.max_failures resumes with a looser max_failures and another batch_size:
    neither changes an answer, so neither is another recipe; only the failed sample is retried."""
    w = tmp_path / "world"
    shutil.copytree(world, w)
    out = tmp_path / "run"
    strict = _recipe(tiny_dir, w, out, pope={"max_new_tokens": 2, "splits": ["random"]}, batch_size=1, max_failures=0.0)
    qs = _lines(w / "pope" / "world_pope_random.json")[:12]
    img = w / "images" / "val" / qs[8]["image"]
    good = img.read_bytes()
    img.write_bytes(b"not an image")
    with pytest.raises(RunAbortedError):
        run_eval(strict, limit=12, mm=tiny_mm)
    img.write_bytes(good)
    kept = {r["doc_id"]: r for r in _lines(out / "samples.jsonl") if "error" not in r}
    assert kept
    redone: list[str] = []
    real_append = RecordStore.append
    monkeypatch.setattr(
        RecordStore, "append", lambda self, recs: (redone.extend(r["doc_id"] for r in recs), real_append(self, recs))
    )
    loose = _recipe(tiny_dir, w, out, pope={"max_new_tokens": 2, "splits": ["random"]}, batch_size=4, max_failures=0.5)
    summary = run_eval(loose, limit=12, mm=tiny_mm)
    assert not set(redone) & set(kept), "finished samples were recomputed"
    assert summary["counts"]["finished"] == 12
    recs = {r["doc_id"]: r for r in _assert_complete(out / "samples.jsonl", 12)}
    assert all(recs[d]["fingerprint"] == r["fingerprint"] and recs[d]["resps"] == r["resps"] for d, r in kept.items())


def test_recipe_limit_changed_is_refused_naming_the_limit_flag(tiny_dir, tiny_mm, world, tmp_path, monkeypatch):
    """eval.limit is part of a run's identity (every record's fingerprint holds it), so a rerun with another one is
    refused, but the refusal says only the limit differs and how to resume: keep the recipe's limit and pass
    ``--limit N``, which then computes only the new sample (no record redone or lost)."""
    from mmfast.eval import runner

    out = tmp_path / "run"
    pope = {"max_new_tokens": 2, "splits": ["random"]}
    run_eval(_recipe(tiny_dir, world, out, pope=pope, limit=2), mm=tiny_mm)
    before = _answers(out / "samples.jsonl")
    with pytest.raises(InputError, match=r"only eval.limit differs \(2 -> 3\).*keep eval.limit: 2 and pass --limit N"):
        run_eval(_recipe(tiny_dir, world, out, pope=pope, limit=3), mm=tiny_mm)
    with pytest.raises(InputError, match="another recipe") as exc:  # another change too: no such advice
        run_eval(_recipe(tiny_dir, world, out, pope={**pope, "max_new_tokens": 3}, limit=3), mm=tiny_mm)
    assert "eval.limit" not in str(exc.value)
    ran: list[str] = []
    real = runner.prepare_batch
    monkeypatch.setattr(runner, "prepare_batch", lambda mm, ss: ran.extend(s.doc_id for s in ss) or real(mm, ss))
    summary = run_eval(_recipe(tiny_dir, world, out, pope=pope, limit=2), limit=3, mm=tiny_mm)
    after = _answers(out / "samples.jsonl")
    assert summary["counts"]["finished"] == 3 and len(ran) == 1 and ran[0] not in before
    assert {d: after[d] for d in before} == before


def test_calibrated_budget_resumed_with_another_limit(tiny_dir, tiny_mm, world, tmp_path):
    """ZipVL's tau (as MustDrop's thresholds) is calibrated on a spread of the planned samples, so another
    --limit is another calibration: a resumed run recomputes every sample, and equals a fresh run at that limit."""
    stage = {"method": "zipvl", "budget": {"tokens": 6}}
    out = tmp_path / "run"
    base = _recipe(tiny_dir, world, out, pope={"max_new_tokens": 1, "splits": ["random"]})
    recipe = load_recipe({**base.to_dict(), "pruning": [stage]})
    run_eval(recipe, limit=6, mm=tiny_mm)
    first = {r["doc_id"]: r["fingerprint"] for r in _lines(out / "samples.jsonl")}
    resumed = run_eval(recipe, limit=3, mm=tiny_mm)
    fresh_recipe = recipe.replace(output=dataclasses.replace(recipe.output, dir=str(tmp_path / "fresh")))
    fresh = run_eval(fresh_recipe, limit=3, mm=tiny_mm)
    recs = {r["doc_id"]: r for r in _lines(out / "samples.jsonl")}
    fresh_recs = {r["doc_id"]: r for r in _lines(tmp_path / "fresh" / "samples.jsonl")}
    assert all(recs[d]["fingerprint"] != first[d] for d in fresh_recs), "records of the limit-6 calibration reused"
    assert {d: recs[d]["resps"] for d in fresh_recs} == {d: r["resps"] for d, r in fresh_recs.items()}
    assert resumed["metrics"] == fresh["metrics"] and resumed["accounting"] == fresh["accounting"]
    assert (
        resumed["counts"]["finished"] == 3 and resumed["accounting"]["mean_flops_prefill"] > 0
    )  # what the pruning bench reports


@pytest.mark.parametrize(
    "name, kind",
    [
        ("samples.jsonl", "dir"),
        ("samples.jsonl", "fifo"),
        ("summary.json", "dir"),
        ("samples.quarantine.jsonl", "fifo"),
    ],
)
def test_own_file_that_is_not_a_file(name, kind, tiny_dir, tiny_mm, world, tmp_path):
    """A directory or a FIFO under one of the run's own names: exit-2 error naming it (a FIFO named
    samples.jsonl hung the run; a directory was a traceback), before anything is written."""
    import threading

    out = tmp_path / "run"
    recipe = _recipe(tiny_dir, world, out, pope={"max_new_tokens": 1, "splits": ["random"]})
    run_eval(recipe, limit=2, mm=tiny_mm)
    (out / name).unlink(missing_ok=True)
    os.mkdir(out / name) if kind == "dir" else os.mkfifo(out / name)
    result: list = []
    t = threading.Thread(
        target=lambda: result.append(_catch(lambda: run_eval(recipe, limit=2, mm=tiny_mm))), daemon=True
    )
    t.start()
    t.join(30)
    assert not t.is_alive(), "the run hangs on the FIFO"
    exc = result[0]
    what = "a directory" if kind == "dir" else "a FIFO (named pipe)"
    assert isinstance(exc, InputError) and f"{out / name} is {what}, not mmfast's file" in str(exc), exc


def _catch(fn):
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 -- handed to the test thread's assertion
        return exc
    return None


@pytest.mark.parametrize("drop", ["task", "fingerprint", "resps", "meta", "target"])
def test_record_missing_a_field_is_quarantined_and_recomputed(drop, tiny_dir, tiny_mm, world, tmp_path, caplog):
    out = tmp_path / "run"
    recipe = _recipe(tiny_dir, world, out, pope={"max_new_tokens": 1, "splits": ["random"]})
    first = run_eval(recipe, limit=4, mm=tiny_mm)
    path = out / "samples.jsonl"
    recs = _lines(path)
    del recs[1][drop]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    with caplog.at_level(logging.WARNING):
        again = run_eval(recipe, limit=4, mm=tiny_mm)
    assert any("line 2: a record without " + drop in r.getMessage() for r in caplog.records)
    assert again["metrics"] == first["metrics"] and again["counts"]["finished"] == 4
    _assert_complete(path, 4)


def test_label_is_part_of_the_input_fingerprint(tiny_dir, tiny_mm, world, tmp_path):
    """Only the labels of a question file change (same ids, same text, same images): every sample is
    recomputed and scored against its new label."""
    w = tmp_path / "world"
    shutil.copytree(world, w)
    out = tmp_path / "run"
    recipe = _recipe(tiny_dir, w, out, pope={"max_new_tokens": 1, "splits": ["random"]})
    first = run_eval(recipe, limit=6, mm=tiny_mm)
    qfile = w / "pope" / "world_pope_random.json"
    qs = _lines(qfile)
    for q in qs:
        q["label"] = "no" if q["label"] == "yes" else "yes"
    qfile.write_text("".join(json.dumps(q) + "\n" for q in qs))
    again = run_eval(recipe, limit=6, mm=tiny_mm)
    by_id = {q["question_id"]: q["label"] for q in qs}
    recs = _assert_complete(out / "samples.jsonl", 6)
    assert all(r["target"] == by_id[r["meta"]["question_id"]] for r in recs)
    assert again["metrics"]["pope"]["random"]["accuracy"] == pytest.approx(
        1 - first["metrics"]["pope"]["random"]["accuracy"]
    )


class _SummaryWriteWatch:
    """Fails the test when ``summary.json`` itself is opened for writing (an atomic write writes a
    temporary file and renames it over ``summary.json``; a reader never sees half a summary)."""

    active = False
    hits: list[str] = []

    @classmethod
    def hook(cls, event, args):
        if not cls.active or event != "open" or not args or not str(args[0]).endswith("summary.json"):
            return
        mode, flags = args[1], args[2]
        writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR)
        )
        if writes:
            cls.hits.append(str(args[0]))


sys.addaudithook(_SummaryWriteWatch.hook)


def test_summary_json_is_written_atomically(tiny_dir, tiny_mm, world, tmp_path, monkeypatch):
    """Single process and the data-parallel merge (its rank-0 step, run in-process on two shards)."""
    from mmfast.eval import distributed, runner
    from mmfast.eval.data import cache_root, resolve_data
    from mmfast.eval.tasks import build_tasks

    out = tmp_path / "run"
    recipe = _recipe(tiny_dir, world, out, pope={"max_new_tokens": 1, "splits": ["random"]})
    monkeypatch.setattr(_SummaryWriteWatch, "hits", [])
    monkeypatch.setattr(_SummaryWriteWatch, "active", True)
    single = run_eval(recipe, limit=4, mm=tiny_mm)
    recs = (out / "samples.jsonl").read_text().splitlines(keepends=True)
    for r in range(2):
        (out / f"samples.rank{r}.jsonl").write_text("".join(recs[r::2]))
    (out / "samples.jsonl").unlink()  # the merge makes it from the shards
    monkeypatch.setattr(distributed, "shard_info", lambda: (0, 2))
    monkeypatch.setattr(distributed, "barrier", lambda: None)
    plan = [
        (t, t.samples(4))
        for t in build_tasks(recipe.eval, resolve_data(recipe.eval, recipe.eval.tasks), cache_dir=cache_root())
    ]
    weights = runner.weights_fingerprint(tiny_mm.model)
    fps = runner.planned_fingerprints(recipe, plan, weights)
    merged = distributed.gather_and_finish(
        out, fps, lambda store: runner.finish(recipe, out, plan, store, tiny_mm, 0.0, fps, weights, 0)
    )
    monkeypatch.setattr(_SummaryWriteWatch, "active", False)
    assert _SummaryWriteWatch.hits == [], "summary.json was written in place, not replaced atomically"
    assert merged["metrics"] == single["metrics"] and merged["protocol"]["processes"] == 2
    assert (out / "samples.jsonl").read_text().splitlines(keepends=True) == recs  # plan order
    assert not list(out.glob("samples.rank*.jsonl"))


# -- data-parallel workers die with their launcher (fast: stand-in processes, no model) --------------------

_LAUNCHER = """
import os, subprocess, sys, time
from mmfast.eval.distributed import PARENT_ENV, spawn_worker
env = dict(os.environ, **{PARENT_ENV: str(os.getpid())})
child = [sys.executable, "-c", sys.argv[2]]
p = spawn_worker(child, env) if sys.argv[1] == "spawn_worker" else subprocess.Popen(child, env=env)
print(p.pid, flush=True)
time.sleep(120)
"""


def _orphan_after_launcher_killed(how: str, child_code: str) -> list[int]:
    """Start a stand-in launcher that starts one worker (``how``), SIGKILL the launcher, and return the
    worker's pid if it is still running 8 s later."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    launcher = subprocess.Popen(
        [sys.executable, "-c", _LAUNCHER, how, child_code], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        worker = int(launcher.stdout.readline())
        time.sleep(1.5)  # the worker is up (its watchdog started)
        assert _wait_gone([worker], 0) == [worker], "the worker did not start"
    finally:
        launcher.kill()
        launcher.wait()
    alive = _wait_gone([worker], 8)
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    return alive


def test_worker_started_by_the_launcher_dies_with_it():
    """PR_SET_PDEATHSIG set by spawn_worker: a worker that never checks its parent still dies."""
    assert _orphan_after_launcher_killed("spawn_worker", "import time; time.sleep(120)") == [], "worker orphaned"


def test_worker_watchdog_stops_an_orphaned_worker():
    """The worker's own guard (mmfast.cli.main -> watch_parent): started without PR_SET_PDEATHSIG, an
    mmfast command in a worker stops once its launcher is gone."""
    code = "import time, mmfast.cli as c; c.COMMANDS['list'] = lambda a: time.sleep(120); c.main(['-q', 'list'])"
    assert _orphan_after_launcher_killed("popen", code) == [], "worker orphaned"


def test_run_of_an_older_mmfast_is_not_resumed(tiny_dir, tiny_mm, world, tmp_path):
    """A run.json without run_identity was fingerprinted from the first values of each tensor only: its
    records cannot be matched to these weights, so the directory is refused with the fix (overwrite)."""
    out = tmp_path / "run"
    recipe = _recipe(tiny_dir, world, out, pope={"max_new_tokens": 1, "splits": ["random"]})
    run_eval(recipe, limit=2, mm=tiny_mm)
    run = json.loads((out / "run.json").read_text())
    del run["run_identity"]
    (out / "run.json").write_text(json.dumps(run))
    with pytest.raises(InputError, match="results of an older mmfast.*set output.overwrite: true to start over"):
        run_eval(recipe, limit=2, mm=tiny_mm)
    again = run_eval(
        _recipe(tiny_dir, world, out, overwrite=True, pope={"max_new_tokens": 1, "splits": ["random"]}),
        limit=2,
        mm=tiny_mm,
    )
    assert again["counts"]["finished"] == 2


def test_pruning_bench_counts_tokens_over_the_scored_samples_only(tiny_dir, tiny_mm, world, tmp_path):
    """A bench variant resumed at a smaller --limit: the token counts are means over the samples its
    metrics score, not over every record an earlier, larger run left in the folder."""
    from mmfast.bench.pruning import _accounting

    out = tmp_path / "run"
    recipe = load_recipe(
        {
            **_recipe(tiny_dir, world, out, pope={"max_new_tokens": 1, "splits": ["random"]}).to_dict(),
            "pruning": [{"method": "fastv", "params": {"k": 2, "drop_ratio": 0.5}}],
        }
    )
    run_eval(recipe, limit=8, mm=tiny_mm)
    small = run_eval(recipe, limit=2, mm=tiny_mm)
    assert len(_lines(out / "samples.jsonl")) == 8
    fresh_out = tmp_path / "fresh"
    fresh = run_eval(recipe.replace(output=dataclasses.replace(recipe.output, dir=str(fresh_out))), limit=2, mm=tiny_mm)
    scored = _lines(fresh_out / "samples.jsonl")
    everything = _lines(out / "samples.jsonl")
    assert small["counts"]["finished"] == 2 and _accounting(small) == _accounting(fresh)
    for key in ("flops_prefill", "n_vision_tokens", "kv_bytes_prefill"):
        assert _accounting(small)[key] == pytest.approx(sum(r[key] for r in scored) / 2, rel=1e-6)
    assert sum(r["flops_prefill"] for r in everything) / 8 != pytest.approx(_accounting(small)["flops_prefill"])


def test_a_bench_variant_with_a_failed_sample_stops_the_bench(tiny_dir, tiny_mm, world, tmp_path, monkeypatch):
    """A bench compares variants on identical samples: a variant whose evaluation lost one sample stops it
    (exit 3, the variant and the error named) instead of entering its tables on fewer samples; the rerun
    retries that sample only."""
    from mmfast.bench.common import Variant, evaluate_variant
    from mmfast.errors import SamplesFailedError
    from mmfast.eval import runner

    recipe = _recipe(tiny_dir, world, tmp_path / "unused", pope={"max_new_tokens": 1, "splits": ["random"]})
    recipe = load_recipe({**recipe.to_dict(), "eval": {**recipe.to_dict()["eval"], "max_failures": 1.0}})
    variant, out = Variant("baseline", recipe), tmp_path / "bench"
    real = runner.prepare_batch
    ran: list[str] = []
    tries = []

    def flaky(mm, samples):
        ran.extend(s.doc_id for s in samples)
        if any(s.doc_id == "pope_random/2" for s in samples) and len(tries) < 2:  # its batch, then alone
            tries.append(1)
            raise RuntimeError("CUDA error: an illegal memory access (simulated)")
        return real(mm, samples)

    monkeypatch.setattr(runner, "prepare_batch", flaky)
    with pytest.raises(
        SamplesFailedError, match="bench variant 'baseline': 1 of 4 samples failed.*illegal memory"
    ) as exc:
        evaluate_variant(variant, out, 4, tiny_mm)
    assert exc.value.exit_code == 3
    ran.clear()
    summary = evaluate_variant(variant, out, 4, tiny_mm)
    assert ran == ["pope_random/2"] and summary["counts"]["failed"] == 0 and summary["counts"]["finished"] == 4


def test_records_read_for_a_report_are_the_ones_its_summary_scored(tiny_dir, tiny_mm, world, tmp_path, caplog):
    """A run resumed with a smaller --limit keeps the records past it for a later run; the report's counts
    and intervals read only the ones its summary scored (checked by protocol.samples_digest)."""
    from mmfast.eval.intervals import read_records

    out = tmp_path / "run"
    recipe = _recipe(tiny_dir, world, out, pope={"max_new_tokens": 1, "splits": ["random", "adversarial"]})
    run_eval(recipe, limit=6, mm=tiny_mm)
    assert len(read_records(out)) == 12
    small = run_eval(recipe, limit=3, mm=tiny_mm)
    assert len(_lines(out / "samples.jsonl")) == 12  # kept for a later run
    scored = read_records(out)
    assert sorted(r["doc_id"] for r in scored) == sorted(
        f"pope_{split}/{q['question_id']}"
        for split in ("random", "adversarial")
        for q in _lines(world / "pope" / f"world_pope_{split}.json")[:3]
    )
    assert small["metrics"]["pope"]["random"]["n"] == 3
    assert "do not match" not in caplog.text
    (out / "summary.json").write_text(
        (out / "summary.json").read_text().replace(small["protocol"]["samples_digest"], "0" * 24)
    )
    assert len(read_records(out)) == 12 and "do not match what summary.json scored" in caplog.text


def test_overwrite_starts_over_from_a_run_whose_records_were_compressed(reference, tiny_dir, tiny_mm, world, tmp_path):
    """output.overwrite removes the earlier run's own files, its gzipped records too (as under benchmarks/):
    the new run starts over instead of being refused for records it was told to replace."""
    import gzip

    out = tmp_path / "run"
    shutil.copytree(reference, out)
    (out / "samples.jsonl.gz").write_bytes(gzip.compress((out / "samples.jsonl").read_bytes()))
    (out / "samples.jsonl").unlink()
    other = _recipe(tiny_dir, world, out, overwrite=True, pope={"max_new_tokens": 1, "splits": ["random"]})
    s = run_eval(other, limit=2, mm=tiny_mm)
    assert s["counts"]["finished"] == 2 and not (out / "samples.jsonl.gz").exists()
    _assert_complete(out / "samples.jsonl", 2)


@pytest.mark.parametrize("code", ["ENOLCK", "EOPNOTSUPP", "ENOSYS"])
def test_output_on_a_file_system_without_locks_is_an_input_error(code, tmp_path, monkeypatch):
    """A file system mounted without flock support (NFS without its lock daemon, Lustre with noflock) refuses
    the lock: exit 2 naming the directory and the fix, not an internal error."""
    import errno

    from mmfast.eval import rundir

    def flock(fd, op):
        raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))

    monkeypatch.setattr(rundir.fcntl, "flock", flock)
    with pytest.raises(InputError, match=r"does not support file locks.*--output"):
        rundir.claim(tmp_path / "out")


def test_calibration_image_changed_recomputes_every_sample(tiny_dir, tiny_mm, world, tmp_path):
    """A calibrated budget's thresholds are fitted on images of the evaluation: one of them replaced under the
    same name is another calibration, so every sample is recomputed, not only those about that image (their
    reused answers were made with the old thresholds)."""
    w = tmp_path / "world"
    shutil.copytree(world, w)
    out = tmp_path / "run"
    base = _recipe(tiny_dir, w, out, pope={"max_new_tokens": 1, "splits": ["random"]})
    recipe = load_recipe({**base.to_dict(), "pruning": [{"method": "zipvl", "budget": {"tokens": 6}}]})
    run_eval(recipe, limit=12, mm=tiny_mm)
    before = {r["doc_id"]: r for r in _lines(out / "samples.jsonl")}
    img_name = next(iter(before.values()))["image"]
    assert {r["image"] for r in before.values()} != {img_name}  # other samples are about other images
    victim = w / "images" / "val" / img_name
    shutil.copyfile(next(p for p in sorted(victim.parent.iterdir()) if p.name != img_name), victim)
    run_eval(recipe, limit=12, mm=tiny_mm)
    after = {r["doc_id"]: r for r in _assert_complete(out / "samples.jsonl", 12)}
    reused = sorted(d for d in after if after[d]["fingerprint"] == before[d]["fingerprint"])
    assert not reused, f"answers of the old calibration reused: {reused}"


def test_method_weights_retrained_under_the_same_path_are_recomputed(tiny_dir, tiny_mm, world, tmp_path):
    """Dynamic-LLaVA's predictors retrained into the same directory change the answers: a resumed run
    recomputes every sample (as for the model's own weights), and equals a fresh run with the new predictors."""
    from mmfast.pruning._dynamic_llava_modules import random_predictors, save_predictors

    hidden = tiny_mm.model.config.text_config.hidden_size
    pred = tmp_path / "predictors"
    save_predictors(random_predictors(hidden, seed=0), pred, {"sparse_layer": 2})
    stage = {"method": "dynamic_llava", "params": {"predictors": str(pred), "vision_keep_rate": 0.3}}
    base = _recipe(tiny_dir, world, tmp_path / "run", pope={"max_new_tokens": 2, "splits": ["random"]})
    recipe = load_recipe({**base.to_dict(), "pruning": [stage]})
    run_eval(recipe, limit=6, mm=tiny_mm)
    before = _answers(tmp_path / "run" / "samples.jsonl")
    save_predictors(random_predictors(hidden, seed=7), pred, {"sparse_layer": 2})  # retrained, same path
    resumed = run_eval(recipe, limit=6, mm=tiny_mm)
    after = _answers(tmp_path / "run" / "samples.jsonl")
    assert not [d for d in after if after[d][2] == before[d][2]], "records of the old predictors reused"
    fresh = run_eval(
        recipe.replace(output=dataclasses.replace(recipe.output, dir=str(tmp_path / "fresh"))), limit=6, mm=tiny_mm
    )
    assert after == _answers(tmp_path / "fresh" / "samples.jsonl") and resumed["metrics"] == fresh["metrics"]
