"""bench/lineage.py on its tiny `--quick` configuration: the shape of what it reports, and that
masked FedAvg with and without model lineage gives bit-identical global models. Nothing here
judges a time."""

from __future__ import annotations

import pytest

from bench import lineage
from bench.secagg import NO_LINEAGE, bench_policy


def test_bench_methods_turn_lineage_on_and_off_and_secaggs_masking_keeps_the_default() -> None:
    with_lineage = bench_policy("masking", [8], 3, 2, "trained")
    without = bench_policy(NO_LINEAGE, [8], 3, 2, "trained")
    assert with_lineage.secure_aggregation.lineage is None and with_lineage.uses_lineage
    assert without.secure_aggregation.method == "masking" and not without.uses_lineage
    assert bench_policy("sparse", [8], 10, 2).secure_aggregation.neighbours == 4


def test_quick_reports_both_deployments_their_ratios_and_bit_identical_models(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_write(*_: object) -> None:
        raise AssertionError("--quick writes nothing")

    monkeypatch.setattr(lineage, "write", no_write)
    document = lineage.main(["--quick"])
    assert document["settings"]["rounds"] == 3 and document["settings"]["repeats"] == 2
    assert document["models_bit_identical"] is True
    [row] = document["rows"]
    assert (row["label"], row["silos"]) == ("1e4", 3)
    assert row["models_bit_identical"] and row["models_identical_across_repeats"]
    runs = row["repeats"]
    assert [run["order"] for run in runs] == [["masking", NO_LINEAGE], [NO_LINEAGE, "masking"]]
    for run in runs:
        assert run["models_bit_identical_by_round"] == [True, True, True]
        assert len(run["with"]["per_round"]) == len(run["without"]["per_round"]) == 3
        # the evidence: each silo downloads the survivors' masked inputs beside the model
        assert run["ratio"]["bytes_down_per_silo"] > 2
        assert 0.9 < run["ratio"]["bytes_up_per_silo"] < 1.1
        assert run["lineage_check"]["cpu_seconds_per_silo"] > 0
        assert run["checks_without_lineage"] > 0  # the other deployment's silos ran none
    summary = row["summary"]
    for side in ("with", "without", "ratio"):
        for key in lineage.COMPARED:
            stats = summary[side][key]
            assert stats["min"] <= stats["median"] <= stats["max"]
            assert len(stats["by_repeat"]) == 2
    assert set(summary["lineage_check"]) == {
        "cpu_seconds_per_silo",
        "wall_seconds_per_silo",
        "cpu_seconds_max_silo",
    }
    assert set(summary["mask_step_silo_cpu_seconds_per_silo"]) == {
        "with",
        "without",
        "difference",
    }
    assert lineage.silo_lineage.refusal.__name__ == "refusal"  # the timing wrapper is gone
    assert lineage.silo_lineage.refusal.__module__ == "fedsilo.silo.lineage"
