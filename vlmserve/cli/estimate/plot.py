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


def draw_gantt(path: Path, schedule) -> None:
    """A schedule (search.nanoflow.schedule.Schedule) as NanoFlow's Figure 6: one row per stream,
    each nano-operation a bar labelled with its op and rows, its share R in the label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    streams = sorted({(n.stream, n.resource) for n in schedule.nano_ops})
    ops = sorted({n.op for n in schedule.nano_ops}, key=[n.op for n in schedule.nano_ops].index)
    colour = {op: plt.get_cmap("tab20")(i % 20) for i, op in enumerate(ops)}
    fig, ax = plt.subplots(figsize=(14, 1.2 + 0.9 * len(streams)))
    for y, (stream, _) in enumerate(streams):
        for n in (m for m in schedule.nano_ops if m.stream == stream):
            ax.broken_barh(
                [(n.start_us, n.duration_us)], (y - 0.4, 0.8), color=colour[n.op], ec="black"
            )
            label = f"{n.op}\n{n.row_start}:{n.row_end}" + (
                f" R{n.share:.2f}" if n.share < 1 else ""
            )
            ax.text(n.start_us + n.duration_us / 2, y, label, ha="center", va="center", fontsize=6)
    ax.set_yticks(range(len(streams)), [f"{r} ({s})" for s, r in streams])
    ax.invert_yaxis()
    ax.set_xlabel("time within one layer (us)")
    ax.set_title(
        f"{schedule.model} on {schedule.device}, dense batch {schedule.dense_batch}: "
        f"{schedule.makespan_us:,.0f} us vs {schedule.sequential_us:,.0f} us in order",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
