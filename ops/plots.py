"""matplotlib for the reports: headless, and imported on the first plot, so the services that
never plot start faster."""

from __future__ import annotations

from typing import Any


def pyplot() -> Any:
    """matplotlib, headless, imported on first plot (services that never plot start faster)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def integer_ticks(ax: Any) -> None:
    """Round numbers on `ax`'s x axis only at integers (a 5-round run shows no round 2.5)."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
