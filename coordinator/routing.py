"""Daisy-chain hand-offs as the engine runs them: a phase with `route={sender: recipient}`.

Two steps. `send`: every task runs; a sender's task also says how to pack its model, sealed
to its recipient's X25519 key (`channel.sealed_handoffs`; the coordinator tells the sender
only the key, and the sender checks it belongs to a member) or in the clear. `deliver`: each
recipient gets its hand-off, without the sender's name (the coordinator's own signed task
carries it). A plain hand-off whose recipient dropped out goes to a silo whose own sender
dropped out instead, so no model is lost; a sealed one cannot be re-addressed, and a silo
seals a hosted model to one member a round (silo/contract_gate.py: a second sealed copy would
let its two holders difference each other's next hand-offs), so it is not resealed. A
recipient may also be a silo outside the phase (cyclic weight transfer hands the model to the
next silo of its cycle), which only takes delivery. A model that cannot be delivered stays
hosted at its sender, which keeps every model it hands off until a replacement arrives.

The strategy sees the senders' reports and the routes delivered, never a hand-off.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

import numpy as np

from fedsilo.coordinator.phases import Phase, PhaseOutcome, QuorumNotMet, Task
from fedsilo.coordinator.replies import Accepted, reports_of
from fedsilo.wire.tasks import DaisyReceive, DaisyTrain, Handoff
from fedsilo.wire.tasks.tensor_names import HANDOFF

# collect(step, tasks) -> (accepted replies, dropped silo -> why)
Collect = Callable[[str, Sequence[Task]], tuple[dict[str, Accepted], dict[str, str]]]


class HandoffRouter:
    def __init__(
        self,
        collect: Collect,
        quorum: int,
        keys: Mapping[str, bytes] | None,
        rng: np.random.Generator,
    ) -> None:
        """`keys`: each member's X25519 public key when hand-offs are sealed, else None."""
        self.collect = collect
        self.quorum = quorum
        self.keys = keys
        self.rng = rng

    def run(self, phase: Phase) -> PhaseOutcome:
        route = dict(phase.route or {})
        silos = {task.silo for task in phase.tasks}
        strangers = sorted(set(route) - silos)
        if strangers:
            raise ValueError(
                f"phase {phase.name!r} routes models of silos without tasks: {strangers}"
            )
        inside = sorted(r for r in route.values() if r in silos)
        if len(set(route.values())) != len(route) or not set(inside) <= set(route):
            raise ValueError(
                f"phase {phase.name!r}: a route must be a permutation of its senders, or hand "
                "models on to distinct silos outside the phase (a cyclic visit)"
            )
        sent, dropped = self.collect(
            "send",
            [self._routed(t, route[t.silo]) if t.silo in route else t for t in phase.tasks],
        )
        if len(sent) < self.quorum:
            reasons = "; ".join(f"{s}: {why}" for s, why in sorted(dropped.items()))
            raise QuorumNotMet(
                f"phase {phase.name!r}: {len(sent)} of {len(phase.tasks)} silos answered, "
                f"quorum is {self.quorum} ({reasons})",
                phase.name,
                reports_of(sent),
                dropped,
            )
        ready = {s for s in route if s in sent and HANDOFF in sent[s].result.tensors}
        blobs = {s: sent[s].result.tensors[HANDOFF] for s in ready}
        targets = {s: route[s] for s in ready if route[s] in sent or route[s] not in silos}
        orphans = sorted(ready - set(targets))
        hungry = sorted(r for s, r in route.items() if r in sent and s not in ready)
        if self.keys is None:  # plain: bound to no recipient, it may go to another
            targets |= self._matched(orphans, hungry)
        delivered, lost = self.collect(
            "deliver",
            [
                Task(
                    recipient, DaisyReceive(sealed=self.keys is not None), {HANDOFF: blobs[sender]}
                )
                for sender, recipient in sorted(targets.items())
            ],
        )
        for silo, why in lost.items():
            dropped.setdefault(silo, f"hand-off, deliver: {why}")
        routes = {s: r for s, r in targets.items() if r in delivered}
        return PhaseOutcome(phase.name, reports_of(sent), dropped, routes=routes)

    def _routed(self, task: Task, recipient: str) -> Task:
        """A sender's `daisy_train` task, told where its model goes."""
        if not isinstance(task.config, DaisyTrain):
            raise ValueError(f"a routed task must be daisy_train, not {task.kind}")
        return replace(task, config=replace(task.config, handoff=self._handoff(recipient)))

    def _handoff(self, recipient: str) -> Handoff:
        if self.keys is None:
            return Handoff()
        if recipient not in self.keys:
            raise ValueError(
                f"no hand-off key for {recipient!r}; sealed hand-offs need every member's"
            )
        return Handoff(seal_to=self.keys[recipient].hex())

    def _matched(self, orphans: list[str], hungry: list[str]) -> dict[str, str]:
        """Each orphaned model (its recipient dropped) to a silo whose sender dropped, in a
        seeded random order, a silo to itself only when nothing else is left."""
        order = list(self.rng.permutation(len(hungry))) if hungry else []
        waiting = [hungry[i] for i in order]
        matched = {}
        for sender in orphans:
            if not waiting:
                break
            choice = next((r for r in waiting if r != sender), waiting[0])
            waiting.remove(choice)
            matched[sender] = choice
        return matched
