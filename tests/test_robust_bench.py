"""bench/robust.py on its tiny `--quick` configuration: every rule runs clean and against the
attack, the faulty sites are drawn among the consortium, and nothing is written. Nothing here
judges an accuracy."""

from __future__ import annotations

import pytest

from bench import robust


def test_quick_runs_every_rule_clean_and_attacked_and_writes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_write(*_: object) -> None:
        raise AssertionError("--quick writes nothing")

    monkeypatch.setattr(robust, "write", no_write)
    document = robust.main(["--quick"])
    runs = document["runs"]
    assert {(r["rule"], r["attack"], r["faulty"]) for r in runs} == {
        (rule, attack, faulty)
        for rule in robust.RULES
        for attack, faulty in (("none", 0), ("scaled", 1))
    }
    for run in runs:
        assert len(run["faulty_sites"]) == run["faulty"]
        assert 0.0 <= run["accuracy"] <= 1.0
    (norm_bounded,) = [r for r in runs if r["rule"] == "norm_bounded" and r["faulty"] == 1]
    (clean,) = [r for r in runs if r["rule"] == "fedavg" and r["faulty"] == 0]
    assert norm_bounded["max_norm"] == clean["honest_update_norm"] > 0
    assert {row["rule"] for row in document["summary"]} == set(robust.RULES)
