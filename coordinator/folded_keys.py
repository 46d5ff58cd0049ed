"""The keys silos folded into their unmask answers, held for the masked aggregations they
were made for.

A masked aggregation (secure_sum.py) of a phase asks each silo, with its unmask task, to
advertise its keys for the next aggregation of the same phase (`advertise_next`), so that one
starts at its share step: a masked round takes four round trips instead of five. The next one
is the phase's next weighted mean in the algorithm's silo contract
(policies/algorithms/contract.py `SiloContract.next_aggregation`: FedAvg's next round, FedDC's
next aggregation round), the only one a silo folds keys for. An aggregation for which the
engine holds keys from none or only some of its silos (the first, a silo that dropped, a new
member of a round's cohort) runs the advertise step for the others; keys folded for an
aggregation that never comes (a round that trains no one) are never used.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from fedsilo.coordinator.replies import Accepted
from fedsilo.wire.tasks import NextAggregation
from fedsilo.wire.tasks.tensor_names import ADVERTISEMENT


@dataclass
class FoldedKeys:
    """The unmask answers carrying keys, by the (round, phase) they were made for, held between
    the aggregations of one deployment (in memory: a restarted coordinator runs the advertise
    step again, and silos repeat the keys they folded but have not shared). `next_aggregation`:
    the round of a phase's next weighted mean after a round (None: none before the last)."""

    next_aggregation: Callable[[int, str], int | None]
    held: dict[tuple[int, str], dict[str, Accepted]] = field(default_factory=dict)

    def take(self, round_no: int, phase: str) -> dict[str, Accepted]:
        """The answers carrying keys for the aggregation of `phase` in round `round_no`, which
        starts now; keys held for an earlier round are let go."""
        found = self.held.pop((round_no, phase), {})
        self.held = {label: got for label, got in self.held.items() if label[0] >= round_no}
        return found

    def next_after(self, round_no: int, phase: str) -> NextAggregation | None:
        """The aggregation to fold keys for: the phase's next one (None past the last round)."""
        later = self.next_aggregation(round_no, phase)
        return None if later is None else NextAggregation(round=later, phase=phase)

    def keep(self, made_for: NextAggregation, replies: Mapping[str, Accepted]) -> None:
        """Hold the answers among `replies` that carry keys for `made_for`."""
        self.held[(made_for.round, made_for.phase)] = {
            s: r for s, r in replies.items() if ADVERTISEMENT in r.result.tensors
        }
