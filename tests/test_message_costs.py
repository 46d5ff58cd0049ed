"""The per-message breakdown (bench/message_costs.py) times every step it names, each on real
work: frames that read back, files that are on disk. Its times are the bench's to report;
nothing here asserts a duration."""

from __future__ import annotations

from pathlib import Path

from bench.message_costs import STEPS, costs


def test_every_step_is_timed_on_a_model_and_leaves_its_durable_writes_on_disk(
    tmp_path: Path,
) -> None:
    measured = costs(parameters=1000, repeats=3, folder=tmp_path)
    assert list(measured) == list(STEPS)
    assert all(0 < step["ms_p10"] <= step["ms"] <= step["ms_p90"] for step in measured.values())
    assert len(list((tmp_path / "answers").iterdir())) == 4  # the warm-up and three repeats
    assert len(list((tmp_path / "checkpoints").glob("*.safetensors"))) == 4  # a new model each
    assert len((tmp_path / "ledger.jsonl").read_text().splitlines()) == 4
