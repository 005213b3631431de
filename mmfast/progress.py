"""Progress for long loops: a bar on a terminal, periodic log lines everywhere else.

Evaluations run for hours under nohup, SLURM or CI, where a tqdm bar prints nothing useful. A
:class:`Progress` shows tqdm's bar when stderr is a terminal (and this is the process that reports),
and otherwise logs ``what: done/total (pct), rate/s, ETA`` at most every ``MMFAST_PROGRESS_EVERY``
seconds (default 30) and once at the end.
"""

from __future__ import annotations

import logging
import os
import sys
import time

from tqdm import tqdm

logger = logging.getLogger(__name__)


def log_every_s() -> float:
    try:
        return max(0.0, float(os.environ.get("MMFAST_PROGRESS_EVERY", "30")))
    except ValueError:
        return 30.0


def _fmt_eta(seconds: float) -> str:
    if seconds == float("inf"):
        return "?"
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class Progress:
    """``update(n)`` after each chunk of ``total`` items; ``close()`` at the end (also a context manager)."""

    def __init__(self, total: int, what: str, *, report: bool = True, unit: str = "samples") -> None:
        self.total, self.what, self.unit, self.report = total, what, unit, report
        self.done = 0
        self.t0 = self.last = time.monotonic()
        self.every = log_every_s()
        self.bar = tqdm(total=total, desc=what, disable=not (report and total and sys.stderr.isatty()))

    def update(self, n: int) -> None:
        self.done += n
        self.bar.update(n)
        now = time.monotonic()
        if self.report and self.bar.disable and (now - self.last >= self.every or self.done >= self.total):
            self.last = now
            self.log(now)

    def log(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        rate = self.done / max(now - self.t0, 1e-9)
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        pct = 100.0 * self.done / self.total if self.total else 100.0
        logger.info(
            "%s: %d/%d %s (%.0f%%), %.2f/s, ETA %s",
            self.what,
            self.done,
            self.total,
            self.unit,
            pct,
            rate,
            _fmt_eta(eta),
        )

    def close(self) -> None:
        self.bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
