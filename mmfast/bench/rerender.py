"""``mmfast rerender``: rewrite a finished bench directory's ``results.md``, side tables and plots from
its ``summary.json`` and per-variant records, or a finished eval run's intervals in its ``summary.json``,
without running anything.

It sits above the bench runners (it dispatches to their ``write_*_report``), so that
:mod:`.render`, which they all use, imports none of them.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from ..errors import InputError
from ..eval.intervals import refresh_intervals
from .decoding import write_decoding_report
from .pruning import write_pruning_report
from .render import bench_kind
from .speculative import write_speculative_report

logger = logging.getLogger(__name__)


def recorded_command(bench_dir: Path) -> str:
    """The command a bench directory's ``results.md`` records (its first ``Command:`` line)."""
    md = Path(bench_dir) / "results.md"
    if md.is_file():
        m = re.search(r"^Command: `(.*)`$", md.read_text(), flags=re.M)
        if m:
            return m.group(1)
    return f"mmfast bench ... --output {bench_dir}"


def rerender_bench(bench_dir: str | Path) -> Path:
    """Rewrite ``results.md`` (with n and 95% intervals), the side tables and the plots of an existing
    bench directory from its ``summary.json`` and ``variants/*/samples.jsonl``; nothing is run. The
    intervals and the unparsed-answer counts are added to ``summary.json`` (``results.<variant>.intervals``,
    ``.unparsed``), and each variant's own ``summary.json`` gets today's intervals where an older method
    recorded them (:func:`~mmfast.eval.intervals.refresh_intervals`); nothing else changes. An eval run
    directory (``mmfast eval``) gets the latter only; its ``summary.json`` is returned."""
    out = Path(bench_dir)
    path = out / "summary.json"
    if not path.is_file():
        raise InputError(
            f"{out}: no summary.json (re-rendering needs a finished `mmfast bench` or `mmfast eval` directory)"
        )
    result = json.loads(path.read_text())
    if "metrics" in result and "results" not in result:  # an eval run: its intervals only
        refresh_intervals(out)
        return path
    kind = bench_kind(result)
    if kind in ("gpu_speed", "video_cost"):  # their rows resume: the recorded command re-renders without running any
        raise InputError(
            f"{out} is a {kind} bench: run its recorded command again (results.md's 'Command:'); every finished "
            "row with the same settings is kept, so it only rewrites results.md and summary.json"
        )
    for variant in sorted((out / "variants").glob("*/summary.json")):
        refresh_intervals(variant.parent)
    command = recorded_command(out)
    logger.info("re-rendering the %s bench in %s", kind, out)
    if kind == "pruning":
        write_pruning_report(result, out, command)
    elif kind == "decoding":
        write_decoding_report(result, out, command)
    else:
        write_speculative_report(result, out, command)
    return out / "results.md"
