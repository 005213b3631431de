"""Crash-safe per-sample records (``samples.jsonl``) with resume.

Every finished sample is appended as one JSON line (one ``write`` per line, flushed, and the file
fsynced after each batch), so a killed run loses at most the record being written. On restart the
file is read back line by line: a damaged line anywhere (cut short, blank, invalid UTF-8, not a JSON
object with a ``doc_id``) is moved, byte for byte, to the side file ``samples.quarantine.jsonl``
with a warning naming its line number, and every valid record before and after it is kept. The last
record of each ``doc_id`` wins. A record counts as done only while its ``fingerprint`` (a digest of
the sample's inputs, :mod:`mmfast.eval.fingerprint`) equals the planned sample's: a record whose
inputs changed is recomputed, never reused. Field names follow lmms-eval (``doc_id``, ``target``,
``resps``, ``filtered_resps``) plus mmfast's own (``task``, ``image``, ``prompt``, ``fingerprint``,
accounting).

Finished runs may be stored compressed (``samples.jsonl.gz``, as under ``benchmarks/``); the readers
of finished runs (:func:`mmfast.eval.intervals.read_records`: ``mmfast report``, ``mmfast rerender``)
read either. A run is never resumed from a compressed file: a store whose file exists only as
``.gz`` is refused (:class:`~mmfast.errors.InputError`) rather than silently started afresh beside it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import InputError

logger = logging.getLogger(__name__)


def quarantine_path(path: Path) -> Path:
    """Where damaged lines of record file ``path`` go: ``samples.jsonl`` -> ``samples.quarantine.jsonl``."""
    return path.with_suffix(".quarantine" + path.suffix)


@dataclass(frozen=True)
class DamagedLine:
    """A line of a record file that is not a valid record (1-based ``line_no``, raw bytes, why)."""

    line_no: int
    raw: bytes
    reason: str


def parse_line(line: bytes) -> dict[str, Any] | str:
    """The record on ``line`` (without its newline), or why it is not one."""
    if not line.strip():
        return "blank line"
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"invalid UTF-8 at byte {exc.start}"
    try:
        rec = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"not JSON ({exc.msg} at column {exc.colno})"
    if not isinstance(rec, dict) or not isinstance(rec.get("doc_id"), str):
        return "not a record (a JSON object with a string doc_id)"
    return rec


def check_regular_file(path: Path) -> None:
    """Refuse a path of a run's own file that is a directory, FIFO, socket or device (reading a FIFO
    would hang the run; writing over a directory fails half-way): name it and the fix."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:  # a dangling symlink: written through, as a missing file is
        return
    except OSError as exc:
        raise InputError(f"{path}: {exc.strerror or exc}; remove it or use another --output") from None
    if not stat.S_ISREG(mode):
        kind = (
            "a directory"
            if stat.S_ISDIR(mode)
            else "a FIFO (named pipe)"
            if stat.S_ISFIFO(mode)
            else "a socket"
            if stat.S_ISSOCK(mode)
            else "a device"
            if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "not a regular file"
        )
        raise InputError(f"{path} is {kind}, not mmfast's file of that name; move it away or use another --output")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data``: written to a temporary file, fsynced, renamed over it."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def write_records(path: Path, records: Iterable[dict[str, Any]]) -> None:
    """Replace record file ``path`` (atomically) with ``records``, one line each."""
    write_atomic(path, b"".join((json.dumps(r, ensure_ascii=False) + "\n").encode("utf-8") for r in records))


def record_rank(rec: dict[str, Any], fingerprint: str | None) -> int:
    """How well ``rec`` serves a sample planned with inputs ``fingerprint``: 2 finished from them, 1 failed
    on them, 0 made from other inputs (or not planned)."""
    if fingerprint is None or rec.get("fingerprint") != fingerprint:
        return 0
    return 1 if "error" in rec else 2


def merge_records(
    into: dict[str, dict[str, Any]], records: Iterable[dict[str, Any]], fingerprints: dict[str, str]
) -> None:
    """Fold ``records`` (newer) into ``into`` (doc_id -> record): a newer record replaces an older one
    unless the older serves its planned sample better (:func:`record_rank`), so a stale or failed record
    in another file never displaces a finished one of the planned inputs."""
    for rec in records:
        d = rec["doc_id"]
        old = into.get(d)
        if old is None or record_rank(rec, fingerprints.get(d)) >= record_rank(old, fingerprints.get(d)):
            into[d] = rec


def count_failures(path: Path, fingerprints: dict[str, str]) -> int:
    """Failed records of planned inputs in record file ``path``, which another process may be appending
    to: read only, a line it has not finished is skipped."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return 0
    latest: dict[str, dict[str, Any]] = {}
    for line in raw.split(b"\n"):
        rec = parse_line(line)
        if not isinstance(rec, str):
            latest[rec["doc_id"]] = rec
    return sum(record_rank(r, fingerprints.get(d)) == 1 for d, r in latest.items())


def digest_of(fingerprints: Iterable[str]) -> str:
    """One digest over the fingerprints of the scored records (in plan order): the exact data of a summary."""
    h = hashlib.sha256()
    for fp in fingerprints:
        h.update(fp.encode() + b"\n")
    return h.hexdigest()[:24]


class RecordStore:
    """Append-only JSONL store keyed by ``doc_id``; damaged lines are quarantined, never dropped."""

    def __init__(self, path: str | os.PathLike, check: Callable[[dict[str, Any]], str | None] | None = None) -> None:
        """``check(record)``: why a parsed record is not usable (e.g. a missing field), or None; such
        lines are quarantined as damaged ones are."""
        self.path = Path(path)
        self.records: dict[str, dict[str, Any]] = {}
        self.quarantined: list[DamagedLine] = []
        self.n_lines = 0  # valid lines in the file (superseded records included)
        self._check = check
        packed = self.path.with_name(self.path.name + ".gz")
        if not os.path.lexists(self.path) and packed.exists():
            raise InputError(
                f"{packed}: this run's records are compressed, and a run does not resume from a compressed "
                f"file; to resume it, decompress them first (gunzip {packed}); to start over, remove it or "
                "use another --output"
            )
        if os.path.lexists(self.path):
            check_regular_file(self.path)
            self._load()

    @property
    def quarantine_path(self) -> Path:
        return quarantine_path(self.path)

    def _load(self) -> None:
        raw = self.path.read_bytes()
        lines = raw.split(b"\n")
        if lines and lines[-1] == b"":
            lines.pop()  # the file ends with a newline, as it should
        kept: list[bytes] = []
        damaged: list[DamagedLine] = []
        for no, line in enumerate(lines, start=1):
            parsed = parse_line(line)
            if not isinstance(parsed, str) and self._check is not None:
                parsed = self._check(parsed) or parsed
            if isinstance(parsed, str):
                torn = no == len(lines) and not raw.endswith(b"\n")
                damaged.append(
                    DamagedLine(no, line, parsed + (" (cut short: the last write did not finish)" if torn else ""))
                )
                continue
            self.records[parsed["doc_id"]] = parsed
            kept.append(line)
        self.n_lines = len(kept)
        if damaged:
            self._quarantine(damaged, kept)
        elif raw and not raw.endswith(b"\n"):  # a whole last record cut before its newline: end its line,
            with open(self.path, "ab") as fh:  # or the next append would run on from it and lose both
                fh.write(b"\n")
                fh.flush()
                os.fsync(fh.fileno())

    def _quarantine(self, damaged: list[DamagedLine], kept: list[bytes]) -> None:
        """Move the damaged lines to the quarantine file (first, fsynced), then rewrite the record file
        with the valid ones (atomically): a crash in between only quarantines a line twice."""
        q = self.quarantine_path
        with open(q, "ab") as fh:
            for d in damaged:
                fh.write(d.raw + b"\n")
            fh.flush()
            os.fsync(fh.fileno())
        write_atomic(self.path, b"".join(line + b"\n" for line in kept))
        for d in damaged:
            logger.warning(
                "%s line %d: %s; moved to %s (the sample will be recomputed)", self.path, d.line_no, d.reason, q
            )
        self.quarantined.extend(damaged)

    def done(self, doc_id: str, fingerprint: str | None = None) -> bool:
        """Whether ``doc_id`` has a successful record (of inputs ``fingerprint``, when given)."""
        rec = self.records.get(doc_id)
        if rec is None or "error" in rec:
            return False
        return fingerprint is None or rec.get("fingerprint") == fingerprint

    def stale(self, doc_id: str, fingerprint: str) -> bool:
        """Whether ``doc_id`` has a record made from other inputs than ``fingerprint``."""
        rec = self.records.get(doc_id)
        return rec is not None and rec.get("fingerprint") != fingerprint

    def failed(self) -> list[dict[str, Any]]:
        return [r for r in self.records.values() if "error" in r]

    def append(self, records: Iterable[dict[str, Any]]) -> None:
        """Append records, one ``write`` per line, flushed per line and fsynced per call."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "ab") as fh:
            for rec in records:
                fh.write((json.dumps(rec, ensure_ascii=False) + "\n").encode("utf-8"))
                fh.flush()
                self.records[str(rec["doc_id"])] = rec
                self.n_lines += 1
            os.fsync(fh.fileno())

    def compact(self) -> int:
        """Rewrite the file (atomically) with one line per ``doc_id``, its latest record at the place of
        its first line, when superseded lines exist (retried or recomputed samples); returns how many
        lines were dropped."""
        extra = self.n_lines - len(self.records)
        if extra <= 0:
            return 0
        write_records(self.path, self.records.values())
        self.n_lines = len(self.records)
        return extra

    def arrange(self, first: list[str]) -> None:
        """Rewrite the file (atomically, only when it is not so already) with the records of ``first`` (doc_ids
        it holds, in that order) leading, then the others: a finished run keeps its scored records first,
        in plan order, so a reader can tell them from those it kept for another run
        (:func:`mmfast.eval.intervals.read_records`)."""
        if list(self.records)[: len(first)] == first:
            return
        leading = set(first)
        rest = [d for d in self.records if d not in leading]
        self.records = {d: self.records[d] for d in [*first, *rest]}
        write_records(self.path, self.records.values())
        self.n_lines = len(self.records)

    def successful(self, task: str | None = None) -> list[dict[str, Any]]:
        return [r for r in self.records.values() if "error" not in r and (task is None or r.get("task") == task)]


def record_problem(rec: dict[str, Any]) -> str | None:
    """Why a parsed line of ``samples.jsonl`` is not a usable record (a missing or mistyped field; e.g.
    edited by hand), or None. Such lines are quarantined and their samples recomputed."""
    missing = [k for k in ("task", "target", "fingerprint", "meta") if k not in rec]
    if "error" not in rec:
        missing += [k for k in ("resps", "filtered_resps") if k not in rec]
    if missing:
        return f"a record without {', '.join(missing)}"
    if "error" not in rec:
        resps = rec["resps"]
        if not (
            isinstance(resps, list)
            and resps
            and isinstance(resps[0], list)
            and resps[0]
            and isinstance(resps[0][0], str)
        ):
            return "a record whose resps is not [[answer text]]"
    if not isinstance(rec["meta"], dict) or not isinstance(rec["task"], str):
        return "a record whose meta is not a mapping or whose task is not a string"
    return None
