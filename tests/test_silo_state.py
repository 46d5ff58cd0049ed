"""A silo's local state: a task of round t reads the newest version written before round t, on
disk or in memory alike; the last versions are kept and older ones removed; names are checked."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedsilo.silo.state import KEEP, LocalState


@pytest.mark.parametrize("on_disk", [True, False], ids=["disk", "memory"])
def test_a_round_reads_the_newest_version_written_before_it(tmp_path: Path, on_disk: bool) -> None:
    state = LocalState(tmp_path if on_disk else None, deployment="consortium/a")
    assert state.latest("local", 5) is None
    state.save("local", 2, {"w": torch.tensor([2.0])})
    state.save("local", 4, {"w": torch.tensor([4.0])})
    assert state.latest("local", 2) is None
    assert torch.equal(state.latest("local", 3)["w"], torch.tensor([2.0]))
    assert torch.equal(state.latest("local", 9)["w"], torch.tensor([4.0]))
    state.save("local", 4, {"w": torch.tensor([5.0])})  # round 4 run again
    assert torch.equal(state.latest("local", 5)["w"], torch.tensor([5.0]))


def test_versions_outlive_the_object_and_only_the_last_few_are_kept(tmp_path: Path) -> None:
    for round_no in range(1, KEEP + 3):
        LocalState(tmp_path, "d").save("local", round_no, {"w": torch.full((2,), float(round_no))})
    files = sorted(p.name for p in (tmp_path / "d").iterdir())
    assert files == [f"local.r{r:06d}.safetensors" for r in range(3, KEEP + 3)]
    assert torch.equal(
        LocalState(tmp_path, "d").latest("local", 99)["w"], torch.full((2,), float(KEEP + 2))
    )
    assert LocalState(tmp_path, "other").latest("local", 99) is None  # per deployment


def test_a_name_that_is_not_a_plain_word_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="local state names are letters"):
        LocalState(tmp_path).save("../escape", 1, {"w": torch.zeros(1)})
