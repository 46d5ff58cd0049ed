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
