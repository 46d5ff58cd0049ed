"""The privacy officer's view outside the ledger commands: each silo's epsilon over rounds from
round records (results, status, the coordinator's audit anchors), its plot, the status table
under DP (a DP simulation's ledgers and results: tests/test_deployment.py, beside the
deployment whose ledgers they must equal)."""

import pytest
from matplotlib.ticker import MaxNLocator
from rich.console import Console

from fedsilo.coordinator.engine import RoundRecord
from fedsilo.ops.epsilon import epsilon_by_round, epsilon_figure, ledger_anchors
from fedsilo.ops.plots import pyplot
from fedsilo.ops.status import DeploymentStatus
from fedsilo.ops.status_view import print_status


def record(round_no: int, **privacy: tuple[float, str]) -> RoundRecord:
    return RoundRecord(
        round_no,
        "completed",
        1.0,
        privacy={s: {"epsilon": e, "ledger_head": h} for s, (e, h) in privacy.items()},
    )


def test_each_silos_epsilon_per_round_and_its_last_head_come_from_the_round_records() -> None:
    records = [
        RoundRecord(0, "completed", 1.0),  # setup: nothing reported
        record(1, a=(1.5, "a1"), b=(1.5, "b1")),
        record(2, a=(2.5, "a2")),  # b dropped out of round 2
        record(2, a=(2.75, "a3"), b=(2.0, "b3")),  # the final evaluation after round 2
    ]
    assert epsilon_by_round(records) == {"a": [(1, 1.5), (2, 2.75)], "b": [(1, 1.5), (2, 2.0)]}
    assert ledger_anchors(records) == {"a": (2, "a3"), "b": (2, "b3")}


def test_the_epsilon_plot_has_a_panel_per_silo_with_the_cap_and_integer_rounds() -> None:
    panels = {"silo-0": {"ε": [(1, 1.0), (2, 2.0)]}, "silo-1": {"ε": [(1, 1.0), (2, 2.0)]}}
    fig = epsilon_figure(panels, 8.0, "title")
    try:
        shown = [ax for ax in fig.axes if ax.get_visible()]
        assert [ax.get_title() for ax in shown] == ["silo-0", "silo-1"]
        for ax in shown:
            labels = [line.get_label() for line in ax.get_lines()]
            assert labels == ["ε", "cap 8"]
            assert list(ax.get_lines()[1].get_ydata()) == [8.0, 8.0]
            assert isinstance(ax.xaxis.get_major_locator(), MaxNLocator)
            assert all(float(t).is_integer() for t in ax.get_xticks())
    finally:
        pyplot().close(fig)


def status(**overrides: object) -> DeploymentStatus:
    fields: dict = {
        "deployment": "heart-dp-1234abcd",
        "rounds_planned": 5,
        "last_round": 2,
        "last_status": "completed",
        "participants": {
            "silo-0": ("accepted", ""),
            "silo-1": ("retired", "budget_exhausted: this task would bring epsilon to 8.5"),
        },
        "last_evaluation": {"silo-0": {"accuracy": 0.8125}},
        "evaluated_round": 2,
        "dropouts": {},
        "failed_rounds": 0,
        "epsilon": {"silo-0": 3.14159, "silo-1": 7.9},
        "epsilon_cap": 8.0,
        "noised": True,
    }
    return DeploymentStatus(**{**fields, **overrides})


def rendered(report: DeploymentStatus, width: int = 100) -> str:
    console = Console(width=width, record=True)
    print_status(console, report, ["silo-0", "silo-1"])
    return console.export_text()


def test_status_under_dp_shows_each_silos_epsilon_and_marks_the_metrics_noised() -> None:
    text = rendered(status())
    assert "ε (cap 8)" in text
    assert "accuracy (noised)" in text
    assert "reported with Gaussian noise (DP)" in text
    (row,) = [line for line in text.splitlines() if "silo-0" in line]
    assert "3.14" in row and "0.812" in row


def test_status_without_dp_has_no_epsilon_column_nor_noise_mark() -> None:
    text = rendered(status(epsilon={}, epsilon_cap=None, noised=False))
    assert "ε" not in text and "noised" not in text


def test_status_before_any_evaluation_says_so_instead_of_none() -> None:
    text = rendered(status(last_evaluation={}, evaluated_round=None))
    assert "no round evaluated yet" in text
    assert "None" not in text


@pytest.mark.parametrize("width", [80, 100])
def test_status_wraps_a_reason_between_words_never_inside_one(width: int) -> None:
    text = rendered(status(), width)
    cells = " ".join(
        line.split("│")[2].strip() for line in text.splitlines() if line.count("│") > 3
    )
    for word in ("budget_exhausted:", "epsilon"):
        assert word in cells.split(), text
