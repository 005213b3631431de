"""Crash-safe per-sample records (``samples.jsonl``) with resume.

Every finished sample is appended as one JSON line and flushed to disk before the next batch starts,
so a killed run loses at most the batch in flight. On restart the file is read back: a torn last line
(the process died mid-write) is cut off, the last record of each ``doc_id`` wins, successful samples
are skipped, failed ones are retried. Field names follow lmms-eval (``doc_id``, ``target``, ``resps``,
``filtered_resps``) plus mmfast's own (``task``, ``image``, ``prompt``, ``pred``, accounting).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Iterable

logger = logging.getLogger(__name__)


class RecordStore:
    """Append-only JSONL store keyed by ``doc_id``."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.records: dict[str, dict[str, Any]] = {}
        if self.path.exists():
            self._load()

    def _load(self) -> None:
        raw = self.path.read_bytes()
        good_end = 0
        for line in raw.splitlines(keepends=True):
            if not line.endswith(b"\n"):
                break  # torn write at the end
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                break
            self.records[str(rec["doc_id"])] = rec
            good_end += len(line)
        if good_end < len(raw):
            logger.warning("%s: dropping a partially written last record (%d bytes)", self.path, len(raw) - good_end)
            with open(self.path, "r+b") as fh:
                fh.truncate(good_end)

    def done(self, doc_id: str) -> bool:
        rec = self.records.get(doc_id)
        return rec is not None and "error" not in rec

    def failed(self) -> list[dict[str, Any]]:
        return [r for r in self.records.values() if "error" in r]

    def append(self, records: Iterable[dict[str, Any]]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as fh:
            for rec in records:
                fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
                self.records[str(rec["doc_id"])] = rec
            fh.flush()
            os.fsync(fh.fileno())

    def successful(self, task: str | None = None) -> list[dict[str, Any]]:
        return [r for r in self.records.values() if "error" not in r and (task is None or r.get("task") == task)]
