"""The three kinds of figure the benchmarks draw (matplotlib, Agg backend: no display needed)."""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Optional, Sequence, Tuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
from matplotlib.ticker import MaxNLocator  # noqa: E402

Series = Tuple[Sequence[float], Sequence[float]]


def grouped_bars(path: Path, title: str, panels: Mapping[str, Mapping[str, float]], ylabel: str,
                 reference: Optional[float] = None) -> Path:
    """One bar per entry of each panel (``panels[panel][bar] = height``), panels side by side;
    ``reference`` draws a horizontal dashed line (e.g. 1.0 for "as fast as dense")."""
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4.2), squeeze=False, sharey=True)
    for ax, (panel, bars) in zip(axes[0], panels.items()):
        ax.bar(range(len(bars)), list(bars.values()), color="tab:blue")
        ax.set_xticks(range(len(bars)), list(bars), rotation=60, ha="right", fontsize=8)
        ax.set_title(panel, fontsize=10)
        if reference is not None:
            ax.axhline(reference, color="gray", linestyle="--", linewidth=1)
    axes[0][0].set_ylabel(ylabel)
    fig.suptitle(title)
    return _save(fig, path)


def curves(path: Path, title: str, panels: Mapping[str, Mapping[str, Series]], xlabel: str, ylabel: str) -> Path:
    """One line per series of each panel (``panels[panel][label] = (xs, ys)``), panels side by side,
    one legend for all (a label keeps its colour in every panel; ``none*``, dense, is dashed)."""
    labels = list(dict.fromkeys(label for series in panels.values() for label in series))
    colours = {label: plt.cm.tab20(i % 20) for i, label in enumerate(labels)}
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels) + 2.5, 4.2), squeeze=False, sharey=True)
    for ax, (panel, series) in zip(axes[0], panels.items()):
        for label, (xs, ys) in series.items():
            ax.plot(xs, ys, marker="o", markersize=3, label=label, color=colours[label],
                    linestyle="--" if label.startswith("none") else "-")
        ax.set_title(panel, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(ylabel)
    handles, names = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, names, loc="center right", fontsize=7)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 1 - 2.3 / fig.get_figwidth(), 1))
    return _save(fig, path, layout=False)


def scatter(path: Path, title: str, points: Mapping[str, Tuple[float, float]], xlabel: str, ylabel: str) -> Path:
    """One labelled point per entry (``points[label] = (x, y)``), x on a log scale."""
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, (x, y) in points.items():
        ax.scatter([x], [y], color="tab:gray" if label.startswith("none") else "tab:blue", s=18)
        ax.annotate(label, (x, y), xytext=(4, 3), textcoords="offset points", fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    fig.suptitle(title)
    return _save(fig, path)


def _save(fig: "plt.Figure", path: Path, layout: bool = True) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if layout:
        fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
