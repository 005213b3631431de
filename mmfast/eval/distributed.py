"""Data-parallel evaluation: shards, per-shard resume, one merged result, a clean process lifecycle.

``mmfast eval --num-processes N`` starts N worker processes (``python -m mmfast eval`` with the
``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` / ``MASTER_*`` variables ``torchrun`` would set; accelerate's
``PartialState`` then picks nccl on GPUs and gloo on CPUs). ``accelerate launch --num_processes N -m
mmfast eval RECIPE`` and ``torchrun --nproc_per_node N -m mmfast eval RECIPE`` work too. Process
``r`` takes every N-th of the planned samples that ``samples.jsonl`` holds no finished record of (the work
left, split evenly however far a stopped run got) and writes ``samples.rank{r}.jsonl``; after a barrier the
main process merges the shards into ``samples.jsonl`` (in plan order) and writes the single ``summary.json``.
A run resumes from ``samples.jsonl`` whichever process count wrote it: before a run starts, the main process
folds into it the shards a stopped run left (:func:`fold_shards`), so a shard only ever holds records of the
current run, and a stale or failed record never displaces a finished record of the planned inputs. ``eval.max_failures`` holds for the whole run:
a process that records a failure counts the other shards' too. Because mmfast's answers do not depend on
batch composition, the merged answers and metrics equal a single-process run's.

Lifecycle: the launcher holds the output directory's lock for its workers and keeps them in its own
process group (never in new sessions), so a signal to the group reaches every worker. Each worker
also dies with the launcher (``PR_SET_PDEATHSIG`` on Linux, and a watchdog polling its parent pid
everywhere), so even a ``SIGKILL`` of the launcher alone stops them. On ``SIGINT`` / ``SIGTERM`` /
``SIGHUP`` the launcher stops the workers, removes its temporary recipe and exits ``128 + signal``
(130 for Ctrl-C) with one line; when one worker fails, the others are stopped.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from ..errors import MMFastError, RunAbortedError
from . import rundir
from .records import RecordStore, merge_records, record_problem, write_atomic, write_records

logger = logging.getLogger(__name__)

PARENT_ENV = "MMFAST_PARENT_PID"
_PR_SET_PDEATHSIG = 1
_STOP_GRACE_S = 5.0


class Terminated(BaseException):
    """The launcher received a termination signal (its workers are stopped and cleaned up)."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"terminated by {signal.Signals(signum).name}")


class WorkerError(MMFastError):
    """A worker of a data-parallel run failed; ``exit_code`` is what ``mmfast eval`` exits with."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _libc_prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def watch_parent() -> None:
    """In a worker started by :func:`launch_data_parallel`: die when the launcher dies. Checks at once
    (the launcher may be gone already), then a watchdog thread polls the parent pid."""
    expected = os.environ.get(PARENT_ENV)
    if not expected:
        return
    expected_pid = int(expected)
    if os.getppid() != expected_pid:
        os._exit(143)

    def poll() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != expected_pid:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(_STOP_GRACE_S)
                os._exit(143)

    threading.Thread(target=poll, name="mmfast-parent-watchdog", daemon=True).start()


def is_worker() -> bool:
    """Whether this process is a worker of mmfast's data-parallel launcher."""
    return bool(os.environ.get(PARENT_ENV))


def shard_info() -> tuple[int, int]:
    """(rank, world size) of this process; (0, 1) outside a distributed launch."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 0, 1
    state = _state()
    return state.process_index, state.num_processes


def _state():
    import torch
    from accelerate import PartialState

    # on CPU-only machines accelerate picks gloo only when asked for the CPU explicitly
    return PartialState(cpu=not torch.cuda.is_available())


def barrier() -> None:
    _state().wait_for_everyone()


def launch_data_parallel(recipe, *, limit: int | None, out: Path, num_processes: int) -> dict[str, Any]:
    """Run this evaluation in ``num_processes`` worker processes writing to ``out``; return the merged summary."""
    with rundir.claim(out):
        recipe_path = out / rundir.DP_RECIPE
        recipe_path.write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))
        # the workers log as the launcher does: quiet only when it is (their progress lines are the run's)
        quiet = [] if logging.getLogger("mmfast").isEnabledFor(logging.INFO) else ["-q"]
        cmd = [sys.executable, "-m", "mmfast", *quiet, "eval", str(recipe_path)]
        cmd += ["--output", str(out), "--allow-failures"]
        if limit:
            cmd += ["--limit", str(limit)]
        port = _free_port()
        base = dict(
            os.environ,
            OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
            WORLD_SIZE=str(num_processes),
            LOCAL_WORLD_SIZE=str(num_processes),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            **{PARENT_ENV: str(os.getpid()), rundir.LOCK_OWNER_ENV: str(os.getpid())},
        )
        logger.info("launching %d processes: %s", num_processes, " ".join(cmd))
        procs: list[subprocess.Popen] = []
        try:
            with _signals_raise():
                for rank in range(num_processes):
                    env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0")
                    procs.append(spawn_worker(cmd, env))
                codes, first_failed = _wait(procs)
        finally:
            _stop(procs)
            recipe_path.unlink(missing_ok=True)
    if first_failed is not None:
        rank, code = first_failed, codes[first_failed]
        where = f"finished samples are kept per shard in {out}; fix the cause (the worker's message is above) and rerun to resume"
        if code == 3:
            raise RunAbortedError(
                f"data-parallel evaluation stopped: too many samples failed in process {rank}; {where}"
            )
        raise WorkerError(
            f"data-parallel evaluation failed: process {rank} exited with {code}; {where}",
            exit_code=2 if code == 2 else 1,
        )
    return json.loads((out / rundir.SUMMARY_JSON).read_text())


def spawn_worker(cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    """Start one worker in the launcher's process group, set to get SIGTERM when the launcher dies
    (``PR_SET_PDEATHSIG``; the worker's own watchdog, :func:`watch_parent`, is the second guard)."""
    return subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent(_libc_prctl()))


def _die_with_parent(prctl):
    """``preexec_fn``: the child gets SIGTERM when the launcher dies (Linux)."""
    if prctl is None:
        return None

    def set_pdeathsig() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)

    return set_pdeathsig


@contextmanager
def _signals_raise() -> Iterator[None]:
    """While workers run, SIGTERM and SIGHUP raise :class:`Terminated` (SIGINT: KeyboardInterrupt) so
    the launcher stops them and removes its files before exiting."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Terminated(signum)

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def _wait(procs: list[subprocess.Popen]) -> tuple[list[int], int | None]:
    """Wait for every worker; when one fails, stop the others (they would wait for it forever).
    Returns the exit codes and the rank that failed first (None when all succeeded)."""
    while True:
        codes = [p.poll() for p in procs]
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            _stop(procs)
            return [p.wait() for p in procs], failed[0]
        if all(c is not None for c in codes):
            return [int(c) for c in codes], None
        time.sleep(0.1)


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every live worker, SIGKILL those still alive after a grace period, reap them all."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        p.terminate()
    deadline = time.monotonic() + _STOP_GRACE_S
    for p in live:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shard_files(out: Path) -> list[Path]:
    """The record shards (``samples.rank{r}.jsonl``) in ``out``, by rank."""
    shards = [(int(m.group(1)), p) for p in out.glob("samples.rank*.jsonl") if (m := _SHARD.fullmatch(p.name))]
    return [p for _, p in sorted(shards)]


_SHARD = re.compile(r"samples\.rank(\d+)\.jsonl")


def fold_shards(out: Path, fingerprints: dict[str, str]) -> RecordStore:
    """The run's ``samples.jsonl`` with every record shard in ``out`` folded into it (a data-parallel run's,
    whichever its process count, left by a run that stopped before its merge), the shards then removed: the
    main process does this before a run starts, so every process of the run (one or N) resumes from one
    file and a shard holds only records of the current run. A record of the planned inputs is never
    displaced by a stale or failed one (:func:`~mmfast.eval.records.merge_records`). The store's
    ``quarantined`` counts the damaged lines of every file read."""
    store = RecordStore(out / rundir.SAMPLES, check=record_problem)
    shards = shard_files(out)
    if not shards:
        return store
    records, quarantined = dict(store.records), list(store.quarantined)
    for path in shards:
        shard = RecordStore(path, check=record_problem)
        quarantined += shard.quarantined
        merge_records(records, shard.records.values(), fingerprints)
    write_records(store.path, records.values())  # first: a crash before the shards go folds them again
    for path in shards:
        path.unlink()
    store.records, store.n_lines, store.quarantined = records, len(records), quarantined
    return store


def gather_and_finish(
    out: Path, fingerprints: dict[str, str], finish: Callable[[RecordStore], dict[str, Any]]
) -> dict[str, Any]:
    """Barrier, then the main process folds this run's shards into ``samples.jsonl`` (:func:`fold_shards`;
    records of samples not planned now are kept for a later run) and writes the summary with
    ``finish(store)`` (the runner's, which puts the scored records first in plan order: passed in, so this
    module imports no runner). Every process returns the summary."""
    rank, world = shard_info()
    barrier()
    if rank == 0:
        summary = finish(fold_shards(out, fingerprints))
        summary["protocol"]["processes"] = world
        write_atomic(out / rundir.SUMMARY_JSON, json.dumps(summary, indent=2).encode("utf-8"))
    barrier()
    return json.loads((out / rundir.SUMMARY_JSON).read_text())
