"""An evaluation's output directory: one run at a time (a lock), and only mmfast's own files touched.

* **Lock**: ``.mmfast.lock`` holds the owner's pid, host, start time and command, and an exclusive
  ``flock`` while the run lives (the kernel drops it when the process dies, however it dies). A second
  run into the directory is refused (exit 2) with the owner's details; a lock file left by a dead
  process is taken over with a warning. A data-parallel launcher holds the lock for its workers
  (``MMFAST_LOCK_OWNER`` names it). A directory on a file system without file locks is refused (exit 2).
* **Own files**: ``run.json`` lists every file the run writes (``files``). ``output.overwrite``
  removes only those; a non-empty directory without ``run.json`` is not an mmfast run directory and
  is refused (mmfast neither writes into it nor deletes anything in it).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..errors import InputError
from .records import check_regular_file, quarantine_path, write_atomic

logger = logging.getLogger(__name__)

LOCK_NAME = ".mmfast.lock"
RUN_JSON = "run.json"
SUMMARY_JSON = "summary.json"
SAMPLES = "samples.jsonl"
DP_RECIPE = ".mmfast-dp-recipe.yaml"
LOCK_OWNER_ENV = "MMFAST_LOCK_OWNER"
_IGNORED = {LOCK_NAME, DP_RECIPE}  # present in a directory a run is just starting in


#: flock's errors on a file system that does not support it
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL}


class OutputLockedError(InputError):
    """Another live run holds the output directory's lock."""


def shard_name(rank: int) -> str:
    return f"samples.rank{rank}.jsonl"


def own_files(world: int, side_files: Iterable[str]) -> list[str]:
    """Every file a run with ``world`` processes and these side files writes into its directory."""
    records = [SAMPLES] + [shard_name(r) for r in range(world)] if world > 1 else [SAMPLES]
    names = [RUN_JSON, SUMMARY_JSON, DP_RECIPE]
    for rec in records:
        names += [rec, quarantine_path(Path(rec)).name]
    return names + list(side_files)


def _legacy_files(out: Path) -> list[str]:
    """A ``run.json`` written before runs listed their files: mmfast's fixed names and shards."""
    return own_files(1, []) + [p.name for p in out.glob("samples.rank*.jsonl")] + ["chair_image_ids.txt"]


@dataclass(frozen=True)
class LockInfo:
    pid: int
    host: str
    started: str
    command: str

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host}, started {self.started}: {self.command}"

    @classmethod
    def parse(cls, text: str) -> LockInfo | None:
        try:
            d = json.loads(text)
            return cls(int(d["pid"]), str(d["host"]), str(d["started"]), str(d.get("command", "")))
        except (ValueError, KeyError, TypeError):
            return None


def prepare_dir(out: Path) -> None:
    """Create ``out`` (and parents), or fail with an error naming the path and the fix."""
    if out.exists() and not out.is_dir():
        raise InputError(f"output {out} is a file, not a directory; pass a directory with --output (or output.dir)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(
            f"cannot create output directory {out}: {exc.strerror or exc}; choose another --output"
        ) from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise InputError(f"output directory {out} is not writable; choose another --output or fix its permissions")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class OutputLock:
    """The exclusive lock of one output directory (see the module docstring); a context manager."""

    def __init__(self, out: Path) -> None:
        self.out = Path(out)
        self.path = self.out / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        prepare_dir(self.out)
        for _ in range(5):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                raise InputError(
                    f"cannot create the lock file {self.path}: {exc.strerror or exc}; choose another --output"
                ) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    os.close(fd)
                    if exc.errno in _NO_LOCKS:
                        raise InputError(
                            f"cannot lock {self.path}: {exc.strerror or exc} (its file system does not support file "
                            "locks, e.g. NFS without its lock daemon or Lustre mounted with noflock); choose an "
                            "--output on a file system that does"
                        ) from None
                    raise
                info = LockInfo.parse(os.pread(fd, 65536, 0).decode("utf-8", "replace"))
                os.close(fd)
                who = info.describe() if info else "a process that has not written its details yet"
                raise OutputLockedError(
                    f"output directory {self.out} is in use by another mmfast run ({who}); "
                    f"wait for it to finish, or use another --output"
                ) from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # the previous owner removed the file between our open and our lock
                os.close(fd)
                continue
            self._fd = fd
            self._take_over()
            return
        raise InputError(f"could not lock {self.path} (it keeps being replaced); is another mmfast run starting there?")

    def _take_over(self) -> None:
        fd = self._fd
        assert fd is not None
        old = os.pread(fd, 65536, 0).decode("utf-8", "replace")
        if old.strip():
            info = LockInfo.parse(old)
            if info is None:
                logger.warning("%s: taking over an unreadable lock file left by an earlier run", self.path)
            else:
                state = (
                    "no longer running"
                    if info.host != socket.gethostname() or not _pid_alive(info.pid)
                    else "no longer holding it"
                )
                logger.warning("%s: taking over a stale lock of %s (%s)", self.path, info.describe(), state)
        me = LockInfo(os.getpid(), socket.gethostname(), time.strftime("%Y-%m-%dT%H:%M:%S%z"), " ".join(sys.argv))
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(asdict(me)).encode(), 0)
        os.fsync(fd)

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> OutputLock:
        if self._fd is None:  # claim() returns a lock already held
            self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def claim(out: Path) -> OutputLock:
    """Make ``out`` this run's: create it (or fail naming the fix), refuse it when it is not an mmfast
    run directory, and take its lock (held until :meth:`OutputLock.release`)."""
    prepare_dir(out)
    check_own_files(out, own_files(1, []))
    if read_run_json(out) is None:
        check_recognised(out)
    lock = OutputLock(out)
    lock.acquire()
    return lock


def check_held_by_launcher(out: Path) -> bool:
    """In a worker of mmfast's data-parallel launcher: whether the launcher holds ``out``'s lock."""
    owner = os.environ.get(LOCK_OWNER_ENV)
    if not owner:
        return False
    try:
        info = LockInfo.parse((out / LOCK_NAME).read_text())
    except OSError:
        info = None
    if info is None or str(info.pid) != owner:
        raise InputError(f"{out / LOCK_NAME} is not held by the launcher (pid {owner}); start the run again")
    return True


def read_run_json(out: Path) -> dict[str, Any] | None:
    """``out/run.json`` (None when absent); a damaged one is an error naming the fix."""
    path = out / RUN_JSON
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(
            f"cannot read {path}: {exc}; delete it (and the results next to it) or use another --output"
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        data = exc
    if not isinstance(data, dict) or not isinstance(data.get("recipe_hash"), str):
        raise InputError(
            f"{path} is damaged (not mmfast's run description); "
            "delete it (and the results next to it) or use another --output"
        )
    return data


def check_recognised(out: Path) -> None:
    """Refuse a non-empty ``out`` that is not an mmfast run directory (no ``run.json``)."""
    if not out.is_dir() or (out / RUN_JSON).exists():
        return
    foreign = sorted(p.name for p in out.iterdir() if p.name not in _IGNORED)
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise InputError(
            f"output directory {out} is not empty ({shown}) and has no run.json, so it is not an mmfast run "
            "directory; mmfast neither writes into nor deletes from such a directory: use another --output "
            "(or an empty directory)"
        )


def check_own_files(out: Path, names: Iterable[str]) -> None:
    """Each of the run's own files that exists in ``out`` is a regular file (not a directory or FIFO)."""
    for name in names:
        if os.path.lexists(out / name):
            check_regular_file(out / name)


def listed_files(run: dict[str, Any], out: Path) -> list[str]:
    files = run.get("files")
    if not isinstance(files, list):
        return _legacy_files(out)
    return [f for f in files if isinstance(f, str) and Path(f).name == f]


def remove_own(out: Path, run: dict[str, Any]) -> None:
    """Remove the files ``run.json`` lists (output.overwrite), and its record files gzipped since (as under
    ``benchmarks/``: a run refuses to start beside them); anything else in ``out`` is kept."""
    removed = []
    listed = [n for n in listed_files(run, out) if n != LOCK_NAME]
    for name in listed + [f"{n}.gz" for n in listed if n.endswith(".jsonl")]:
        p = out / name
        if p.is_file() or p.is_symlink():
            p.unlink()
            removed.append(name)
    others = sorted(p.name for p in out.iterdir() if p.name not in _IGNORED and p.name != RUN_JSON)
    (out / RUN_JSON).unlink(missing_ok=True)
    logger.warning(
        "output.overwrite: removed %d file(s) of the earlier run from %s%s",
        len(removed),
        out,
        f"; kept {len(others)} file(s) mmfast did not write: {', '.join(others[:5])}" if others else "",
    )


def write_run_json(out: Path, run: dict[str, Any]) -> None:
    write_atomic(out / RUN_JSON, json.dumps(run, indent=1).encode("utf-8"))
