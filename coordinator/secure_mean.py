"""What the coordinator's secure-aggregation protocols share (pairwise masking in
secure_sum.py, CKKS in ckks_sum.py): a `WeightedMean` phase run as several steps, each a
round trip to the silos; dropouts gathered with the step they happened at; the weights each
silo is told to apply; each task's reference tensors (what the silos send updates to); and the
`QuorumNotMet` that abandons the round when too few remain.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from fedsilo.coordinator.phases import Phase, QuorumNotMet, Task, WeightedMean
from fedsilo.coordinator.replies import Accepted, raw_weights

# collect(step, tasks, aggregate=None) -> (accepted replies, dropped silo -> why)
Collect = Callable[..., tuple[dict[str, Accepted], dict[str, str]]]


class SecureMean:
    """One secure aggregation of a phase; `dropped` gathers who left, and at which step."""

    def __init__(self, collect: Collect, quorum: int) -> None:
        self.collect = collect
        self.quorum = quorum
        self.dropped: dict[str, str] = {}

    @staticmethod
    def referenced(phase: Phase, method: str) -> tuple[WeightedMean, dict[str, Task]]:
        """The phase's aggregate and its tasks by silo, each sending the reference of every
        tensor it sums (a silo sends its update to it): the task's own tensor of that name,
        else the aggregate's `references` one."""
        aggregate = phase.aggregate
        assert isinstance(aggregate, WeightedMean)
        references = aggregate.references or {}
        tasks = {}
        for task in phase.tasks:
            absent = [n for n in aggregate.tensors if n not in task.tensors]
            missing = [n for n in absent if n not in references]
            if missing:
                raise ValueError(
                    f"phase {phase.name!r}: {method} sums updates to reference tensors, and "
                    f"{task.silo}'s task sends no {missing} nor does the aggregate declare them"
                )
            added = {n: references[n] for n in absent}
            tasks[task.silo] = replace(task, tensors={**task.tensors, **added}) if added else task
        return aggregate, tasks

    def step(
        self, step: str, tasks: Sequence[Task], aggregate: WeightedMean | None = None
    ) -> dict[str, Accepted]:
        results, dropped = self.collect(step, tasks, aggregate)
        for silo, why in dropped.items():
            self.dropped.setdefault(silo, f"secure aggregation, {step}: {why}")
        return results

    def missed(self, phase: Phase, why: str) -> QuorumNotMet:
        reasons = "; ".join(f"{s}: {w}" for s, w in sorted(self.dropped.items()))
        return QuorumNotMet(
            f"phase {phase.name!r}: {why}" + (f" ({reasons})" if reasons else ""),
            phase.name,
            {},
            dict(self.dropped),
        )


def shares_of_weight(
    weights: Mapping[str, float] | None, counted: Mapping[str, Accepted]
) -> dict[str, float]:
    """Each silo's share of the total weight, which it applies to its update itself."""
    raw = raw_weights(weights, counted)
    total = sum(raw.values())
    if total <= 0:
        return dict.fromkeys(raw, 0.0)
    return {s: w / total for s, w in raw.items()}
