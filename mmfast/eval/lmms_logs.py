"""mmfast's ``logging`` records in lmms-eval's loguru output (used by :mod:`mmfast.eval.lmms_plugin`)."""

from __future__ import annotations

import logging
from typing import Any


class _ToLoguru(logging.Handler):
    """Hands ``logging`` records to loguru, which lmms-eval logs through (with the caller's location)."""

    def __init__(self, sink: Any) -> None:
        super().__init__()
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        frame, depth = logging.currentframe(), 0
        while frame is not None and (depth == 0 or frame.f_code.co_filename == logging.__file__):
            frame, depth = frame.f_back, depth + 1
        try:
            level: str | int = self.sink.level(record.levelname).name
        except ValueError:
            level = record.levelno
        self.sink.opt(depth=depth, exception=record.exc_info).log(level, record.getMessage())


def route_logs_to_lmms_eval() -> bool:
    """Show mmfast's log lines (progress, token counts, warnings) in lmms-eval's loguru output.

    lmms-eval configures loguru only, so ``logging`` records at INFO were dropped and warnings came
    out unformatted. When neither the ``mmfast`` logger (beyond the library's ``NullHandler``) nor the
    root logger has a handler (the application configured no ``logging``), a handler forwarding to
    loguru is added to the ``mmfast`` logger, at INFO unless a level was set. Returns whether it was added
    (once per process).
    """
    pkg = logging.getLogger("mmfast")
    configured = [h for h in pkg.handlers if not isinstance(h, (logging.NullHandler, _ToLoguru))]
    if configured or logging.getLogger().handlers or any(isinstance(h, _ToLoguru) for h in pkg.handlers):
        return False
    try:
        from loguru import logger as sink
    except ImportError:  # pragma: no cover - loguru comes with lmms-eval
        return False
    pkg.addHandler(_ToLoguru(sink))
    if pkg.level == logging.NOTSET:
        pkg.setLevel(logging.INFO)
    return True
