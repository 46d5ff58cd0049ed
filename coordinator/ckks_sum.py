"""The coordinator's side of CKKS secure aggregation: a `WeightedMean` phase run as
join, encrypted inputs, a homomorphic sum under the public context, and decryption at one
silo, after which the coordinator holds the weighted mean of the survivors' models and only
ciphertexts of any one silo's.

The keys: once per deployment (and again after a restart, since they are kept in memory
only) the key-holder silo (the policy's, else the first member by name that answers) makes
the CKKS context; the coordinator keeps its public part,
checked to hold no secret key and no Galois keys, and relays each member's sealed copy of the
secret part, which it cannot open (silo/tasks/ckks_sum.py). Weights are each joined silo's
share of the sample counts released at join (or of the strategy's weights); every silo gets
the whole vector and checks it against its own policy (`min_group`, `min_weight`), sends
w_k (model_k - reference), clipped to the policy's bound, encrypted and signed, and the mean
is the reference (as in secure_sum.py) plus the decrypted sum over survivors divided by their
total weight. Every survivor then confirms the set of survivors (`ckks_confirm`, one set per
aggregation); the decryptor gets every survivor's signed input and confirmation, not a sum:
it checks the signatures, that each survivor confirmed exactly this set, and the group size
itself, adds them and decrypts, so no second decryption over another set is possible. A silo
that drops after joining is simply absent from the sum; a survivor that does not confirm
abandons the round (CKKS cannot leave out an input it holds). The decryptor is the policy's,
else the key holder, when it sent an input; otherwise the first survivor by name (every member
holds the key, so the choice changes no one's view). A decryptor that fails is replaced by the
next survivor: every one of them decrypts the same set, so the same sum.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import tenseal as ts
import torch

from fedsilo.coordinator.phases import Phase, PhaseOutcome, Task
from fedsilo.coordinator.replies import Accepted, raw_weights, released_reports
from fedsilo.coordinator.secure_mean import (
    Collect,
    SecureMean,
    shares_of_weight,
)
from fedsilo.policies.secure_aggregation import SecureAggregationConfig
from fedsilo.privacy.ckks import (
    CkksError,
    CkksParameters,
    add_encrypted,
    context_digest,
    load_public_context,
)
from fedsilo.wire.tasks import CkksConfirm, CkksDecrypt, CkksJoin, CkksKeygen, EncryptedInput
from fedsilo.wire.tasks.tensor_names import (
    CHUNK,
    CONFIRMATION,
    PUBLIC_CONTEXT,
    SEALED_CONTEXT,
    SUM,
)
from fedsilo.wire.tensors import tensor_bytes


@dataclass
class CkksKeys:
    """What the coordinator keeps of a deployment's CKKS keys: the key holder, the public
    context (its digest names it to the silos), each member's sealed secret context, and who
    has joined with it already (a sealed copy is sent until a silo joins, and again after a
    failed join, e.g. a silo restarted without it)."""

    key_holder: str
    public: ts.Context
    digest: str
    sealed: dict[str, torch.Tensor]
    holding: set[str] = field(default_factory=set)  # silos that joined under this context


class CkksMean(SecureMean):
    def __init__(
        self,
        collect: Collect,
        config: SecureAggregationConfig,
        consortium: Sequence[str],
        quorum: int,
        keys: CkksKeys | None,
    ) -> None:
        """`consortium`: every member, whom the key holder seals the context to; `keys`: the
        deployment's keys from an earlier aggregation, if any (then `self.keys` after `run`)."""
        super().__init__(collect, quorum)
        self.config = config
        self.consortium = sorted(consortium)
        self.keys = keys

    def run(self, phase: Phase) -> PhaseOutcome:
        aggregate, tasks = self.referenced(phase, "CKKS")
        keys = self._keys(phase)
        joined = self.step(
            "join",
            [
                Task(
                    s,
                    CkksJoin(key_holder=keys.key_holder, context_digest=keys.digest),
                    {} if s in keys.holding else {SEALED_CONTEXT: keys.sealed[s]},
                )
                for s in sorted(tasks)
            ],
        )
        # who holds the context now: it travels again only to a silo that failed to join
        keys.holding = (keys.holding | set(joined)) - (set(tasks) - set(joined))
        self._enough(phase, "join", len(joined))
        weights = shares_of_weight(aggregate.weights, joined)
        encrypted = self.step(
            "encrypt",
            [
                Task(
                    s,
                    EncryptedInput(
                        inner=tasks[s].config, weights=weights, tensors=tuple(aggregate.tensors)
                    ),
                    tasks[s].tensors,
                    tasks[s].spec,
                )
                for s in sorted(joined)
            ],
        )
        self._enough(phase, "encrypt", len(encrypted))
        survivors = sorted(encrypted)
        confirmed = self.step(
            "confirm",
            [Task(s, CkksConfirm(contributors=tuple(survivors))) for s in survivors],
        )
        if set(confirmed) != set(survivors):
            # each contributor confirms one set of contributors a sum: none can be left out
            raise self.missed(phase, "a contributor did not confirm the contributors")
        reference = tasks[survivors[0]].tensors
        length = sum(reference[n].numel() for n in aggregate.tensors)
        try:  # inputs that cannot be added would make every decryptor fail: stop here
            add_encrypted(keys.public, [_chunks(encrypted[s]) for s in survivors])
        except CkksError as exc:
            raise self.missed(phase, f"the inputs cannot be added: {exc}") from exc
        inputs = {  # each survivor's signed input as it sent it, under "<silo>/"
            f"{silo}/{name}": tensor
            for silo in survivors
            for name, tensor in encrypted[silo].result.tensors.items()
        } | {
            f"{silo}/{CONFIRMATION}": confirmed[silo].result.tensors[CONFIRMATION]
            for silo in survivors
        }
        config = CkksDecrypt(length=length, weights=weights, contributors=tuple(survivors))
        total = self._decrypted(phase, keys, survivors, inputs, config)
        total_weight = sum(weights[s] for s in survivors)
        if total_weight <= 0:
            raise self.missed(phase, "the surviving silos carry zero total weight")
        mean, offset = {}, 0
        for name in aggregate.tensors:
            size = reference[name].numel()
            update = total[offset : offset + size].reshape(reference[name].shape) / total_weight
            mean[name] = (reference[name].double() + update).to(reference[name].dtype)
            offset += size
        raw = raw_weights(aggregate.weights, joined)
        return PhaseOutcome(
            phase.name,
            released_reports(encrypted, joined),
            dict(self.dropped),
            mean=mean,
            total_weight=sum(raw[s] for s in survivors),
            spec=tasks[survivors[0]].spec,  # the model sent: an input holds tensors only
        )

    def _keys(self, phase: Phase) -> CkksKeys:
        """The deployment's keys; made by the key holder the first time (or when a member of
        this phase has no sealed copy)."""
        silos = {task.silo for task in phase.tasks}
        if self.keys is not None and silos <= set(self.keys.sealed):
            return self.keys
        candidates = [self.config.key_holder] if self.config.key_holder else self.consortium
        for holder in candidates:
            if holder not in self.consortium:
                raise self.missed(
                    phase, f"the key holder {holder!r} is not a member of this consortium"
                )
            made = self.step(
                "keygen", [Task(holder, CkksKeygen(recipients=tuple(self.consortium)))]
            )
            if holder not in made:
                continue  # dropped (its reason is recorded): the next member by name
            tensors = made[holder].result.tensors
            try:
                public_bytes = tensor_bytes(tensors[PUBLIC_CONTEXT])
                public = load_public_context(public_bytes, CkksParameters.of(self.config.ckks))
                sealed = {s: tensors[f"{SEALED_CONTEXT}/{s}"] for s in self.consortium}
            except (KeyError, CkksError) as exc:
                self.dropped.setdefault(
                    holder, f"secure aggregation, keygen: unusable keys ({exc})"
                )
                continue
            self.keys = CkksKeys(holder, public, context_digest(public_bytes), sealed)
            return self.keys
        raise self.missed(phase, f"no key holder made usable keys (asked {candidates})")

    def _decrypted(
        self,
        phase: Phase,
        keys: CkksKeys,
        survivors: list[str],
        inputs: dict[str, torch.Tensor],
        config: CkksDecrypt,
    ) -> torch.Tensor:
        """The sum of the signed `inputs`, decrypted by the first decryptor that answers with
        the right length."""
        preferred = [self.config.decryptor, keys.key_holder]
        order = [s for s in preferred if s in survivors] + survivors
        length = config.length
        for decryptor in dict.fromkeys(order):
            answered = self.step("decrypt", [Task(decryptor, config, inputs)])
            total = answered.get(decryptor)
            if total is not None:
                values = total.result.tensors.get(SUM)
                if values is not None and values.numel() == length:
                    return values.double()
                self.dropped.setdefault(decryptor, "secure aggregation, decrypt: a wrong sum")
        raise self.missed(phase, "no surviving silo decrypted the sum")

    def _enough(self, phase: Phase, step: str, count: int) -> None:
        if count < max(1, self.quorum):
            raise self.missed(
                phase,
                f"{count} silos remain after the {step} step; the quorum is {self.quorum}",
            )


def _chunks(reply: Accepted) -> list[bytes]:
    names = sorted(n for n in reply.result.tensors if n.startswith(CHUNK))
    return [tensor_bytes(reply.result.tensors[n]) for n in names]
