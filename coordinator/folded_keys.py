"""The keys silos folded into their unmask answers, held for the masked aggregations they
were made for.

A masked aggregation (secure_sum.py) of a phase asks each silo, with its unmask task, to
advertise its keys for the next aggregation of the same phase (`advertise_next`), so that one
starts at its share step: a masked round takes four round trips instead of five. The next one
is expected as many rounds later as the last two of that phase were apart (a round later until
two have run: FedAvg's every round from the second on, FedDC's every b rounds from its third
aggregation on). A strategy whose rounds take several masked means folds each phase's keys for
that phase's next aggregation. An aggregation for which the engine holds keys from
none or only some of its silos (the first, a phase the last round did not run, a silo that
dropped, a new member of a round's cohort) runs the advertise step for the others; keys folded
for an aggregation that never comes are never used.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from fedsilo.coordinator.replies import Accepted
from fedsilo.wire.tasks import NextAggregation
from fedsilo.wire.tasks.tensor_names import ADVERTISEMENT


@dataclass
class FoldedKeys:
    """The unmask answers carrying keys, by the (round, phase) they were made for, held between
    the aggregations of one deployment (in memory: a restarted coordinator runs the advertise
    step again, and silos repeat the keys they folded but have not shared)."""

    total_rounds: int
    held: dict[tuple[int, str], dict[str, Accepted]] = field(default_factory=dict)
    last_round: dict[str, int] = field(default_factory=dict)  # phase -> its last aggregation's
    gap: dict[str, int] = field(default_factory=dict)  # phase -> rounds between its last two

    def take(self, round_no: int, phase: str) -> dict[str, Accepted]:
        """The answers carrying keys for the aggregation of `phase` in round `round_no`, which
        starts now; keys held for an earlier round are let go."""
        if phase in self.last_round and round_no > self.last_round[phase]:
            self.gap[phase] = round_no - self.last_round[phase]
        self.last_round[phase] = round_no
        found = self.held.pop((round_no, phase), {})
        self.held = {label: got for label, got in self.held.items() if label[0] >= round_no}
        return found

    def next_after(self, round_no: int, phase: str) -> NextAggregation | None:
        """The aggregation to fold keys for: the same phase as many rounds later as its last
        two aggregations were apart, else a round later (None past the last round)."""
        later = round_no + self.gap.get(phase, 1)
        if later > self.total_rounds:
            return None
        return NextAggregation(round=later, phase=phase)

    def keep(self, made_for: NextAggregation, replies: Mapping[str, Accepted]) -> None:
        """Hold the answers among `replies` that carry keys for `made_for`."""
        self.held[(made_for.round, made_for.phase)] = {
            s: r for s, r in replies.items() if ADVERTISEMENT in r.result.tensors
        }
