"""PNG plots for benchmark and report tables (matplotlib, Agg backend)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)


def plot_title(path: Path) -> str | None:
    """The title a plot of this module stored in its PNG (``Title`` text chunk)."""
    from PIL import Image

    with Image.open(path) as im:
        return im.info.get("Title")


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


#: matplotlib's ten default colours (tab10); a series past the tenth keeps its colour's hue but changes
#: line style and marker, so no two of up to 10 x len(MARKERS) series look alike (16 pruning families did)
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
MARKERS = "osD^vP*Xh<>"
LINESTYLES = ("-", "--", ":", "-.")


def series_style(i: int) -> dict[str, str]:
    """The colour, marker and line style of the ``i``-th series of a plot: distinct for every ``i`` below
    ``len(COLOURS) * len(MARKERS)``."""
    cycle, colour = divmod(i, len(COLOURS))
    return {
        "color": COLOURS[colour],
        "marker": MARKERS[(colour + cycle * 3) % len(MARKERS)],
        "linestyle": LINESTYLES[cycle % len(LINESTYLES)],
    }


def _save(plt, fig, path: Path, title: str) -> Path:
    """Write ``fig`` to ``path`` as a PNG holding ``title`` (:func:`plot_title` reads it back) and close it."""
    fig.tight_layout()
    fig.savefig(path, metadata={"Title": title})
    plt.close(fig)
    return path


def scatter_lines(
    path: Path,
    points: Sequence[tuple[str, float, float]],
    xlabel: str,
    ylabel: str,
    title: str,
    baseline: float | None = None,
) -> Path | None:
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
    for i, (fam, pts) in enumerate(sorted(fams.items())):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=fam, **series_style(i))
    if baseline is not None:
        ax.axhline(baseline, color="gray", linestyle="--", linewidth=1, label="baseline")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(plt, fig, path, title)


def bars(
    path: Path,
    labels: Sequence[str],
    values: Sequence[float],
    ylabel: str,
    title: str,
    intervals: Sequence[tuple[float, float] | None] | None = None,
    baseline: float | None = None,
    series: str | None = None,
) -> Path | None:
    """One bar per label, with 95% intervals as error bars where given; the legend names the series
    (``series``, else ``ylabel``), the intervals and the baseline line."""
    plt = _plt()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(max(5, 0.6 * len(labels)), 4), dpi=120)
    xs = range(len(labels))
    ax.bar(xs, values, color="#4C72B0", label=series or ylabel)
    if intervals and any(iv is not None for iv in intervals):
        pts = [(x, v, iv) for x, v, iv in zip(xs, values, intervals) if iv is not None]
        ax.errorbar(
            [p[0] for p in pts],
            [p[1] for p in pts],
            yerr=[[p[1] - p[2][0] for p in pts], [p[2][1] - p[1] for p in pts]],
            fmt="none",
            ecolor="black",
            capsize=3,
            linewidth=1,
            label="95% interval",
        )
    if baseline is not None:
        ax.axhline(baseline, color="gray", linestyle="--", linewidth=1, label="baseline")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    return _save(plt, fig, path, title)


def labelled_points(
    path: Path,
    points: Sequence[tuple[str, float, float, tuple[float, float] | None, tuple[float, float] | None]],
    xlabel: str,
    ylabel: str,
    title: str,
) -> Path | None:
    """One marker per labelled point ``(label, x, y, x_interval, y_interval)``, with 95% intervals as
    error bars where given; every point in the legend (e.g. CHAIR_i against recall per decoder)."""
    plt = _plt()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4.5), dpi=120)
    for i, (label, x, y, xiv, yiv) in enumerate(points):
        if x is None or y is None:
            continue
        xerr = [[x - xiv[0]], [xiv[1] - x]] if xiv else None
        yerr = [[y - yiv[0]], [yiv[1] - y]] if yiv else None
        style = series_style(i)
        ax.errorbar(
            [x],
            [y],
            xerr=xerr,
            yerr=yerr,
            fmt=style["marker"],
            color=style["color"],
            capsize=2,
            linewidth=0.8,
            label=label,
        )
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if points:
        ax.legend(fontsize=6, ncol=2 if len(points) > 10 else 1)
    return _save(plt, fig, path, title)
