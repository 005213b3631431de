"""PNG plots for benchmark and report tables (matplotlib, Agg backend)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

logger = logging.getLogger(__name__)


def _plt():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        return plt
    except ImportError:
        logger.warning("matplotlib is not installed: no plots (pip install matplotlib)")
        return None


def family(name: str) -> str:
    """Variant family for plot lines: 'fastv-64' -> 'fastv'."""
    return name.rsplit("-", 1)[0] if "-" in name and name.rsplit("-", 1)[1][:1].isdigit() else name


def scatter_lines(path: Path, points: Sequence[tuple[str, float, float]], xlabel: str, ylabel: str, title: str, baseline: float | None = None) -> Path | None:
    """One line per variant family through its (x, y) points."""
    plt = _plt()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    fams: dict[str, list[tuple[float, float]]] = {}
    for name, x, y in points:
        if x is None or y is None:
            continue
        fams.setdefault(family(name), []).append((x, y))
    for fam, pts in sorted(fams.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=fam)
    if baseline is not None:
        ax.axhline(baseline, color="gray", linestyle="--", linewidth=1, label="baseline")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def bars(path: Path, labels: Sequence[str], values: Sequence[float], ylabel: str, title: str) -> Path | None:
    plt = _plt()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(max(5, 0.6 * len(labels)), 4), dpi=120)
    ax.bar(range(len(labels)), values, color="#4C72B0")
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
