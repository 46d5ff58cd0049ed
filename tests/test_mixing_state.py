"""A mixing schedule's state between rounds (coordinator/strategies/mixing_state.py): typed,
stored as JSON in the server state, read back exactly, anything unknown refused."""

from __future__ import annotations

import json

import pytest

from fedsilo.coordinator.strategies.base import MIXING, mixing_weights
from fedsilo.coordinator.strategies.mixing_state import MixingState

STATE = MixingState(
    silos=("a", "b"),
    lam=(0.25, 0.75),
    loss_cap=2.5,
    counts=((10.0, float("nan")), (12.0, 8.0)),
    domains=("female", "male"),
    omega={"female": 1.2, "male": 0.8},
    aaggff={"weights": [0.5, 0.5], "alpha": 4.0},
    weights={"a": 0.4, "b": 0.6},
)


def test_a_state_survives_json_both_ways() -> None:
    text = json.dumps(STATE.to_json())
    again = MixingState.from_json(json.loads(text))
    assert json.dumps(again.to_json()) == text
    assert again.lam == STATE.lam and again.counts is not None and again.counts[1] == (12.0, 8.0)


def test_a_fresh_state_holds_the_sorted_silos_and_nothing_else() -> None:
    fresh = MixingState.of({}, MIXING, ("b", "a"))
    assert fresh.to_json() == {"silos": ["a", "b"]}
    assert MixingState.of({MIXING: STATE.to_json()}, MIXING, ("c",)).silos == ("a", "b")


def test_the_round_record_reads_the_weights_of_the_last_mean() -> None:
    assert mixing_weights({MIXING: STATE.to_json()}) == {"a": 0.4, "b": 0.6}
    assert mixing_weights({}) is None
    assert mixing_weights({MIXING: {"silos": ["a"]}}) is None


def test_an_unknown_key_is_refused() -> None:
    with pytest.raises(ValueError, match=r"a mixing state has no \['lambda'\]"):
        MixingState.from_json({"silos": ["a"], "lambda": [1.0]})
