"""Plots for `vlmserve estimate --plot`: the curves the article's labs draw, and the
simulator's KV occupancy and queue over time."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Curve:
    """One plot panel: y against x, with labelled reference lines."""

    xs: list[float]
    ys: list[float]
    xlabel: str
    ylabel: str
    log_x: bool = True
    log_y: bool = False
    hlines: tuple[tuple[float, str], ...] = ()
    vlines: tuple[tuple[float, str], ...] = ()
    marker: str | None = "o"  # None for dense series (a simulated timeline)


def draw(path: Path, title: str, curves: list[Curve]) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only; never open a window
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(curves), figsize=(max(8.0, 5.5 * len(curves)), 4.5))
    fig.suptitle(title, fontsize=9, wrap=True)
    for ax, c in zip(fig.axes, curves, strict=True):
        ax.plot(c.xs, c.ys, marker=c.marker)
        for y, label in c.hlines:
            ax.axhline(y, ls="--", lw=0.8, color="gray")
            ax.annotate(label, (c.xs[0], y), fontsize=8, va="bottom")
        for x, label in c.vlines:
            ax.axvline(x, ls="-.", lw=0.8, color="black")
            ax.annotate(label, (x, min(c.ys)), rotation=90, fontsize=8)
        if c.log_x:
            ax.set_xscale("log", base=2)
        if c.log_y:
            ax.set_yscale("log")
        ax.set_xlabel(c.xlabel)
        ax.set_ylabel(c.ylabel)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
