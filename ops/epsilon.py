"""Each silo's epsilon over rounds, as an operator or privacy officer sees it: read from the
round records (what each silo reported with its answers, `RoundRecord.privacy`, in a
simulation's results and a deployment's history.json alike) or from ledgers (`fedsilo privacy
report`), summarised for results.json and plotted one panel per silo with the cap drawn.

One panel per silo (not one axis) because silos under one policy usually spend exactly the
same epsilon, so their lines would hide each other; the panels share both axes, so they
compare at a glance."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from fedsilo.coordinator.engine import RoundRecord
from fedsilo.ops.plots import integer_ticks, pyplot
from fedsilo.policies.privacy import PrivacyConfig

Series = list[tuple[int, float]]  # (round, cumulative epsilon at the round's end)
PANEL_COLUMNS = 3


def epsilon_by_round(records: Iterable[RoundRecord]) -> dict[str, Series]:
    """Per silo that reported an epsilon: (round, its epsilon after its last answer of the
    round), in round order; a record read later (the final evaluation) supersedes an earlier
    one of the same round."""
    by_silo: dict[str, dict[int, float]] = {}
    for record in records:
        for silo, reported in (record.privacy or {}).items():
            if reported.get("epsilon") is not None:
                by_silo.setdefault(silo, {})[record.round] = float(reported["epsilon"])
    return {silo: sorted(rounds.items()) for silo, rounds in sorted(by_silo.items())}


def ledger_anchors(records: Iterable[RoundRecord]) -> dict[str, tuple[int, str]]:
    """Per silo: the round and ledger head it reported last, the anchor `fedsilo privacy audit
    --anchor` holds its ledger to (in history.json under `rounds[-1].privacy.<silo>.ledger_head`,
    or `final.privacy` when the final evaluation ran after the last round)."""
    anchors: dict[str, tuple[int, str]] = {}
    for record in records:
        for silo, reported in (record.privacy or {}).items():
            if reported.get("ledger_head"):
                anchors[silo] = (record.round, str(reported["ledger_head"]))
    return dict(sorted(anchors.items()))


def privacy_summary(privacy: PrivacyConfig, series: Mapping[str, Series]) -> dict[str, Any]:
    """results.json's `privacy`: the accounting, the policy's cap, each silo's final epsilon
    and its epsilon per round."""
    return {
        "delta": privacy.delta,
        "accountant": privacy.accountant,
        "epsilon_cap": privacy.epsilon_cap,
        "epsilon": final_epsilons(series),
        "epsilon_per_round": {silo: [list(p) for p in points] for silo, points in series.items()},
    }


def plot_epsilon(
    path: Path,
    panels: Mapping[str, Mapping[str, Series]],
    cap: float | None,
    title: str = "cumulative ε per silo",
) -> None:
    """`epsilon_figure` written to `path` (PNG)."""
    fig = epsilon_figure(panels, cap, title)
    try:
        fig.savefig(path, dpi=120)
    finally:
        pyplot().close(fig)


def epsilon_figure(
    panels: Mapping[str, Mapping[str, Series]], cap: float | None, title: str
) -> Any:
    """One panel per silo (`panels`: silo -> line label -> series), titled with the silo's
    name, shared axes, integer round ticks, the cap as a dashed red line in every panel;
    unbounded epsilon is left out. The caller closes the figure."""
    plt = pyplot()
    count = max(1, len(panels))
    columns = min(PANEL_COLUMNS, count)
    rows = math.ceil(count / columns)
    fig, axes = plt.subplots(
        rows,
        columns,
        figsize=(3.2 * columns + 0.6, 2.6 * rows + 0.6),
        sharex=True,
        sharey=True,
        squeeze=False,
    )
    flat = [ax for row in axes for ax in row]
    for ax, (silo, lines) in zip(flat, panels.items(), strict=False):
        for label, points in lines.items():
            rounds = [r for r, _ in points]
            spent = [eps if math.isfinite(eps) else math.nan for _, eps in points]
            ax.step(rounds, spent, where="post", marker="o", markersize=3, label=label)
        if cap is not None:
            ax.axhline(cap, color="tab:red", linestyle="--", linewidth=1, label=f"cap {cap:g}")
        ax.set_title(silo, fontsize=9)
        ax.grid(alpha=0.3)
        integer_ticks(ax)
        ax.legend(fontsize=7)
    for ax in flat[len(panels) :]:
        ax.set_visible(False)
    flat[0].set_ylim(bottom=0)
    for ax in flat[max(0, len(panels) - columns) : len(panels)]:  # the lowest in each column
        ax.xaxis.set_tick_params(labelbottom=True)
        ax.set_xlabel("round")
    for row in axes:
        row[0].set_ylabel("cumulative ε")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def single_lines(series: Mapping[str, Series], label: str = "ε") -> dict[str, dict[str, Series]]:
    """`plot_epsilon`'s panels for one line per silo."""
    return {silo: {label: points} for silo, points in series.items()}


def fmt_epsilon(value: float | None) -> str:
    """Epsilon for a table: "-" where none is booked, "inf" without noise, else 3 significant
    digits."""
    if value is None:
        return "-"
    return "inf" if value == math.inf else f"{value:.3g}"


def final_epsilons(series: Mapping[str, Sequence[tuple[int, float]]]) -> dict[str, float]:
    """Each silo's last reported epsilon."""
    return {silo: points[-1][1] for silo, points in series.items() if points}
