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

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from nacl.public import PrivateKey

from fedsilo.coordinator.folded_keys import FoldedKeys
from fedsilo.coordinator.phases import (
    Phase,
    PhaseOutcome,
    Task,
    WeightedMean,
)
from fedsilo.coordinator.replies import SLICE_ELEMENTS, Accepted, raw_weights, reports_of
from fedsilo.coordinator.secure_mean import (
    Collect,
    SecureMean,
    shares_of_weight,
)
from fedsilo.policies.secure_aggregation import SecureAggregationConfig
from fedsilo.privacy.masking import (
    STREAM_CHUNK_ELEMENTS,
    Advertisement,
    FixedPoint,
    KeyStreams,
    MaskingError,
    aggregation_label,
    combine_shares,
    silo_indices,
    tensor_context,
    unmask_terms,
)
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
from fedsilo.wire.tensors import LazyTensor, tensor_bytes


class MaskedMean(SecureMean):
    def __init__(
        self,
        collect: Collect,
        config: SecureAggregationConfig,
        deployment: str,
        round_no: int,
        quorum: int,
        folded: FoldedKeys,
    ) -> None:
        super().__init__(collect, quorum)
        self.config = config
        self.deployment = deployment
        self.round = round_no
        self.folded = folded

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
            return self._unmasked(phase, tasks, adverts, advertised, shared, summed, revealed)
        except MaskingError as exc:  # shares that do not rebuild a secret: the round is lost
            raise self.missed(phase, str(exc)) from exc

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
        threshold = self.config.share_threshold(len(adverts))
        weights = shares_of_weight(phase.aggregate.weights, advertised)
        survivors = sorted(masked)
        indices = silo_indices(list(adverts))
        seeds = [
            self._rebuild(revealed, indices, REVEALED_SEED + silo, threshold) for silo in survivors
        ]
        dropped_keys = {}
        for silo in sorted(set(shared) - set(masked)):
            key = PrivateKey(self._rebuild(revealed, indices, REVEALED_KEY + silo, threshold))
            if bytes(key.public_key) != bytes(adverts[silo].masking_key):
                raise MaskingError(f"the shares of {silo}'s masking key do not rebuild it")
            dropped_keys[silo] = key
        partners = {  # whom each dropped silo masked with: those its shares went to
            silo: {s for s in survivors if SHARE_TO + s in shared[silo].result.tensors}
            for silo in dropped_keys
        }
        encoding = FixedPoint.for_silos(self.config.bound, len(adverts))
        total_weight = sum(weights[s] for s in survivors)
        if total_weight <= 0:
            raise self.missed(phase, "the surviving silos carry zero total weight")
        reference = tasks[survivors[0]].tensors
        unmasking = unmask_terms(
            seeds, dropped_keys, {s: adverts[s].masking_key for s in survivors}, partners
        )
        mean = {}
        for name in phase.aggregate.tensors:
            before = reference[name].reshape(-1).numpy()
            streams = KeyStreams(unmasking, tensor_context(self.label, name), len(before))
            inputs = [masked[s].lazy[name] for s in survivors]
            update = _unmasked_mean(inputs, streams, encoding, total_weight, before)
            mean[name] = torch.from_numpy(update).reshape(reference[name].shape)
        raw = raw_weights(phase.aggregate.weights, advertised)
        return PhaseOutcome(
            phase.name,
            reports_of(masked),
            dict(self.dropped),
            mean=mean,
            total_weight=sum(raw[s] for s in survivors),
            spec=next((masked[s].result.spec for s in survivors if masked[s].result.spec), None),
        )

    def _enough(self, phase: Phase, step: str, count: int, threshold: int) -> None:
        needed = max(threshold, self.quorum)
        if count < needed:
            raise self.missed(
                phase,
                f"{count} silos remain after the {step} step; secure aggregation needs "
                f"{needed} (threshold {threshold}, quorum {self.quorum})",
            )

    @staticmethod
    def _rebuild(
        revealed: Mapping[str, Accepted], indices: Mapping[str, int], name: str, threshold: int
    ) -> bytes:
        shares = {
            indices[holder]: tensor_bytes(reply.result.tensors[name])
            for holder, reply in revealed.items()
            if name in reply.result.tensors
        }
        return combine_shares(shares, threshold)


def _unmasked_mean(
    inputs: Sequence[LazyTensor],
    streams: KeyStreams,
    encoding: FixedPoint,
    total_weight: float,
    before: np.ndarray,
) -> np.ndarray:
    """before + decode(sum of `inputs` - masks) / total_weight, in `before`'s dtype, a chunk at
    a time while it is in cache: each input read in place a slice at a time (no copy of one),
    summed (mod 2^32), unmasked by the next elements of `streams`, decoded and averaged in
    float64 (`before` widened exactly)."""
    update = np.empty(len(before), dtype=before.dtype)
    total = np.empty(min(len(before), STREAM_CHUNK_ELEMENTS), dtype=np.uint32)
    work = np.empty(len(total), dtype=np.float64)
    for start in range(0, len(before), SLICE_ELEMENTS):
        stop = min(start + SLICE_ELEMENTS, len(before))
        pieces = [i.peek(start, stop).numpy().view(np.uint32) for i in inputs]
        for at in range(start, stop, len(total)):
            upto = min(at + len(total), stop)
            part, out = total[: upto - at], work[: upto - at]
            np.copyto(part, pieces[0][at - start : upto - start])
            for piece in pieces[1:]:
                np.add(part, piece[at - start : upto - start], out=part)
            streams.add_to(part)
            encoding.decode(part, out=out)
            out /= total_weight
            out += before[at:upto]
            update[at:upto] = out
    return update
