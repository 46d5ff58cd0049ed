"""The coordinator's side of pairwise-masked secure aggregation: a `WeightedMean` phase run as
five steps (advertise keys, share secrets, masked inputs, confirm the survivors, unmask), after
which the coordinator holds the weighted mean of the survivors' models and nothing of any one
silo's. The unmask tasks ask the silos for their keys for the aggregation expected next
(folded_keys.py), which then starts at its share step for every silo whose keys it holds.

The strategy declares `WeightedMean` as always; when the policy says `secure_aggregation:
masking` the engine hands that phase to `MaskedMean`, so every averaging strategy runs masked
without knowing it. The whole weight vector (each silo's share of the sample counts
advertised, or of the strategy's weights) travels with every masked-input task, the same for
all, and each silo checks it against its own policy (`min_group`, `min_weight`); a silo sends
w_k (model_k - reference), clipped and encoded (privacy/masking.py), and the mean is the
reference plus the decoded sum over survivors divided by their total weight (the reference: the
tensor sent, e.g. the model, or the `WeightedMean`'s reference for it; secure_mean.py).

The coordinator only relays: silos verify each other's signed keys, so it cannot substitute
one, and before anything is unmasked every survivor signs the survivor set with the view, the
weights and the digest of the task it was sent (`secagg_confirm`), and each silo checks t
such signatures over its own statement before it reveals a share (Bonawitz et al.'s
consistency check), a survivor's self-mask share only if that survivor signed the same
statement. Drops: before sharing, a silo is simply left out; after sharing and before its
masked input, its pairwise masks are removed with its key rebuilt from t shares; after its
masked input, its self-mask is rebuilt the same way once it has confirmed; a survivor that
fails to confirm is treated as one that dropped before its masked input (its key rebuilt,
its input left out of the sum, still masked).
With the policy's `neighbours: k` (SecAgg+'s sparse graph, Bell et al. 2020) a silo sends
shares to its graph neighbours only, which the coordinator relays as it relays all shares; it
learns who masked with whom from where the shares went, and rebuilds each secret from t of
that silo's neighbours (`share_threshold`), while the consistency check still needs
floor(2n/3) + 1 survivors (`consistency_threshold`). It never computes or sends the graph.
Fewer than t silos at any step (or fewer than the quorum) abandon the round (`QuorumNotMet`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from fedsilo.coordinator.folded_keys import FoldedKeys
from fedsilo.coordinator.lineage import evidence
from fedsilo.coordinator.phases import (
    Phase,
    PhaseOutcome,
    Task,
    WeightedMean,
)
from fedsilo.coordinator.replies import Accepted, raw_weights, released_reports
from fedsilo.coordinator.secure_mean import (
    Collect,
    SecureMean,
    shares_of_weight,
)
from fedsilo.policies.secure_aggregation import SecureAggregationConfig
from fedsilo.privacy.lineage import LINEAGE_PHASE
from fedsilo.privacy.masking import (
    Advertisement,
    MaskingError,
    aggregation_label,
)
from fedsilo.privacy.unmasking import unmasked_means
from fedsilo.wire.tasks import (
    MaskedInput,
    SecAggAdvertise,
    SecAggConfirm,
    SecAggShare,
    SecAggUnmask,
)
from fedsilo.wire.tasks.tensor_names import (
    ADVERTISEMENT,
    CONFIRMATION,
    REVEALED_KEY,
    REVEALED_SEED,
    SHARE_TO,
)
from fedsilo.wire.tensors import tensor_bytes


class MaskedMean(SecureMean):
    def __init__(
        self,
        collect: Collect,
        config: SecureAggregationConfig,
        deployment: str,
        round_no: int,
        quorum: int,
        folded: FoldedKeys,
        lineage: bool = False,
        counted: int = 0,
    ) -> None:
        """`lineage`: keep a lineage phase's evidence (coordinator/lineage.py), which names the
        `counted` silos the round counts active."""
        super().__init__(collect, quorum)
        self.config = config
        self.deployment = deployment
        self.round = round_no
        self.folded = folded
        self.lineage = lineage
        self.counted = counted

    def run(self, phase: Phase) -> PhaseOutcome:
        aggregate, tasks = self.referenced(phase, "masking")
        self.label = aggregation_label(self.deployment, self.round, phase.name)
        held = self.folded.take(self.round, phase.name)
        advertised = {s: held[s] for s in tasks if s in held}
        unheld = [Task(s, SecAggAdvertise()) for s in sorted(tasks) if s not in held]
        if unheld:
            advertised |= self.step("advertise", unheld)
        advertised = dict(sorted(advertised.items()))  # the weights' sum in one order
        adverts = {
            silo: Advertisement.from_bytes(silo, tensor_bytes(reply.result.tensors[ADVERTISEMENT]))
            for silo, reply in advertised.items()
        }
        threshold = self.config.consistency_threshold(len(adverts))
        self._enough(phase, "advertise", len(adverts), threshold)
        weights = shares_of_weight(phase.aggregate.weights, advertised)
        relayed = {silo: advert.to_bytes().hex() for silo, advert in adverts.items()}
        shared = self.step(
            "share",
            [Task(s, SecAggShare(advertisements=relayed)) for s in sorted(adverts)],
        )
        self._enough(phase, "share", len(shared), threshold)
        masked = self.step(
            "mask",
            [
                Task(
                    v,
                    MaskedInput(
                        inner=tasks[v].config,
                        weights=weights,
                        shares={
                            u: tensor_bytes(shared[u].result.tensors[SHARE_TO + v]).hex()
                            for u in sorted(shared)
                            if u != v and SHARE_TO + v in shared[u].result.tensors
                        },
                        tensors=tuple(phase.aggregate.tensors),
                    ),
                    tasks[v].tensors,
                    tasks[v].spec,
                )
                for v in sorted(shared)
            ],
            aggregate.flattened(),
        )
        self._enough(phase, "mask", len(masked), threshold)
        survivors = sorted(masked)
        confirmed = self.step(
            "confirm",
            [Task(s, SecAggConfirm(survivors=tuple(survivors))) for s in survivors],
        )
        self._enough(phase, "confirm", len(confirmed), threshold)
        signatures = {
            silo: tensor_bytes(reply.result.tensors[CONFIRMATION]).hex()
            for silo, reply in confirmed.items()
        }
        ahead = self.folded.next_after(self.round, phase.name)
        revealed = self.step(
            "unmask",
            [
                Task(
                    s,
                    SecAggUnmask(
                        survivors=tuple(survivors), signatures=signatures, advertise_next=ahead
                    ),
                )
                for s in sorted(confirmed)
            ],
        )
        if ahead is not None:
            self.folded.keep(ahead, revealed)
        self._enough(phase, "unmask", len(revealed), threshold)
        summed = {s: masked[s] for s in confirmed}  # a survivor's seed is revealed if it signed
        try:
            outcome = self._unmasked(phase, tasks, adverts, advertised, shared, summed, revealed)
        except MaskingError as exc:  # shares that do not rebuild a secret: the round is lost
            raise self.missed(phase, str(exc)) from exc
        if not (self.lineage and phase.name == LINEAGE_PHASE):
            return outcome
        kept = evidence(
            self.round,
            phase.name,
            adverts,
            weights,
            survivors,
            tasks[survivors[0]],
            shared,
            summed,
            confirmed,
            revealed,
            aggregate.tensors,
            self.counted,
        )
        return replace(outcome, evidence=kept)

    def _unmasked(
        self,
        phase: Phase,
        tasks: Mapping[str, Task],
        adverts: Mapping[str, Advertisement],
        advertised: Mapping[str, Accepted],
        shared: Mapping[str, Accepted],
        masked: Mapping[str, Accepted],
        revealed: Mapping[str, Accepted],
    ) -> PhaseOutcome:
        """The mean from the masked inputs of the survivors that confirmed (`masked`) and the
        secrets rebuilt from shares: their self-masks, and the masking keys of every other silo
        that shared (a survivor that did not confirm stays masked, out of the sum)."""
        assert isinstance(phase.aggregate, WeightedMean)
        weights = shares_of_weight(phase.aggregate.weights, advertised)
        survivors = sorted(masked)
        dropped = {  # whom each dropped silo masked with: those its shares went to
            silo: {s for s in survivors if SHARE_TO + s in shared[silo].result.tensors}
            for silo in sorted(set(shared) - set(masked))
        }
        reference = tasks[survivors[0]].tensors
        names = phase.aggregate.tensors
        mean = unmasked_means(
            self.label,
            adverts,
            {s: {name: masked[s].lazy[name] for name in names} for s in survivors},
            dropped,
            {s: revealed_shares(reply) for s, reply in revealed.items()},
            weights,
            {name: reference[name] for name in names},
            self.config.bound,
            self.config.share_threshold(len(adverts)),
        )
        raw = raw_weights(phase.aggregate.weights, advertised)
        return PhaseOutcome(
            phase.name,
            released_reports(masked, advertised),
            dict(self.dropped),
            mean=mean,
            total_weight=sum(raw[s] for s in survivors),
            spec=tasks[survivors[0]].spec,  # the model sent: a masked input holds tensors only
        )

    def _enough(self, phase: Phase, step: str, count: int, threshold: int) -> None:
        needed = max(threshold, self.quorum)
        if count < needed:
            raise self.missed(
                phase,
                f"{count} silos remain after the {step} step; secure aggregation needs "
                f"{needed} (threshold {threshold}, quorum {self.quorum})",
            )


def revealed_shares(reply: Accepted) -> dict[str, bytes]:
    """The shares an unmask answer revealed, by name (REVEALED_SEED or REVEALED_KEY + silo)."""
    return {
        name: tensor_bytes(tensor)
        for name, tensor in reply.result.tensors.items()
        if name.startswith((REVEALED_SEED, REVEALED_KEY))
    }
