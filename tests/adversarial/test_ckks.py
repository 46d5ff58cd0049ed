"""CKKS secure aggregation against a deviating coordinator (issue 17, finding 1): under a
`secure_aggregation: ckks` policy a silo sends nothing in the clear, a decryptor decrypts only
a sum of at least the policy's `min_group` inputs, each signed by its silo for this
aggregation and confirmed by every contributor as exactly the sum's contributors, and no silo
joins a second aggregation of the same round.

Same set-up as test_masking.py: five unmodified silo agents with provisioned identities and
sealing keys, each built from its own copy of the policy, and a coordinator written here that
sends encoded TaskMessages: the tasks the silos' contract asks for, except where an attack
bends them.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from fedsilo.privacy.ckks import chunk_name, context_digest
from fedsilo.silo import contract_gate
from fedsilo.wire.messages import TaskMessage, TaskResult
from fedsilo.wire.tasks import CkksDecrypt
from fedsilo.wire.tasks.tensor_names import (
    CHUNK,
    CONFIRMATION,
    PUBLIC_CONTEXT,
    SEALED_CONTEXT,
    SUM,
)
from fedsilo.wire.tensors import tensor_bytes
from tests.adversarial.test_masking import (
    SILOS,
    TARGET,
    Consortium,
    consortium,
    message_to,
    secure_policy,
    true_update,
    wrapping,
)
from tests.silos import honest

KEY_HOLDER = "silo-3"
DECRYPTOR = "silo-1"


class CkksCoordinator:
    """A coordinator that runs CKKS steps as it likes and keeps what the silos refuse; its task
    ids are those of the positions it asks at, or with `tag` ids no position has."""

    def __init__(self, c: Consortium, tag: str | None = None) -> None:
        self.c = c
        self.tag = tag
        self.refusals: dict[str, dict[str, str]] = {}
        self.confirmations: dict[str, torch.Tensor] = {}

    def send(
        self,
        kind: str,
        configs: Mapping[str, Mapping],
        tensors: Mapping[str, Mapping[str, torch.Tensor]] | None = None,
    ) -> dict[str, TaskResult]:
        answers = {}
        for silo, config in sorted(configs.items()):
            extra = None if tensors is None else tensors[silo]
            message = message_to(silo, kind, config, 1, self.c, extra, self.tag)
            reply = TaskResult.decode(self.c.agents[silo].handle_bytes(message))
            if reply.ok:
                answers[silo] = reply
            else:
                self.refusals.setdefault(kind, {})[silo] = reply.error or ""
        return answers

    def keys(self) -> None:
        (made,) = self.send("ckks_keygen", {KEY_HOLDER: {"recipients": SILOS}}).values()
        self.digest = context_digest(tensor_bytes(made.tensors[PUBLIC_CONTEXT]))
        self.sealed = {s: made.tensors[f"{SEALED_CONTEXT}/{s}"] for s in SILOS}

    def join(self, silos: list[str]) -> dict[str, TaskResult]:
        config = {"key_holder": KEY_HOLDER, "context_digest": self.digest}
        return self.send(
            "ckks_join",
            dict.fromkeys(silos, config),
            {s: {SEALED_CONTEXT: self.sealed[s]} for s in silos},
        )

    def encrypt(self, weights: Mapping[str, float]) -> dict[str, TaskResult]:
        self.weights = dict(weights)
        encrypted = {}
        for silo in weights:
            config = wrapping(self.c, silo, 1) | {"weights": dict(weights), "tensors": ["model"]}
            encrypted |= self.send("ckks_encrypt", {silo: config})
        return encrypted

    def confirm(self, silos: list[str], contributors: list[str]) -> dict[str, TaskResult]:
        """Ask `silos` to confirm `contributors` as the sum's; keep their confirmations."""
        confirmed = self.send("ckks_confirm", dict.fromkeys(silos, {"contributors": contributors}))
        self.confirmations |= {s: r.tensors[CONFIRMATION] for s, r in confirmed.items()}
        return confirmed

    def decryption(
        self, inputs: Mapping[str, TaskResult], length: int
    ) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
        """The decrypt task's config and tensors for `inputs`: each input's chunks, signature
        and confirmation (where its silo gave one) under its silo's name (the signed
        contributions a decryptor checks)."""
        tensors = {
            f"{silo}/{name}": t
            for silo, reply in inputs.items()
            for name, t in reply.tensors.items()
        } | {
            f"{s}/{CONFIRMATION}": self.confirmations[s] for s in inputs if s in self.confirmations
        }
        config = {"length": length, "weights": self.weights, "contributors": sorted(inputs)}
        return config, tensors

    def decrypt(
        self, inputs: Mapping[str, TaskResult], length: int, decryptor: str = DECRYPTOR
    ) -> np.ndarray | None:
        """Ask `decryptor` to decrypt `inputs`, sent as signed contributions."""
        config, tensors = self.decryption(inputs, length)
        answer = self.send("ckks_decrypt", {decryptor: config}, {decryptor: tensors})
        return answer[decryptor].tensors[SUM].double().numpy() if answer else None


def test_a_silo_under_a_ckks_policy_refuses_to_send_its_model_in_the_clear() -> None:
    c = consortium(secure_policy("ckks"))
    for silo in SILOS:
        task = honest(c.agents[silo], "train", 1, {"model": c.model}, c.spec)
        reply = TaskResult.decode(c.agents[silo].handle_bytes(task.encode()))
        assert not reply.ok, f"{silo} answered a plain train task under a ckks policy"
        assert "secure_aggregation ckks" in (reply.error or "") and not reply.tensors


def test_a_decryptor_refuses_to_decrypt_a_single_silos_input() -> None:
    """Signed by its silo, one input is a sum of fewer than min_group: its silo refuses to
    confirm it as a sum's only contributor, and the decryptor, which confirms no set it is not
    in, decrypts no set it did not confirm. Passed off as a sum the coordinator made (that
    input's chunks under a sum's names, what a decryptor used to decrypt), it is no task the
    decryptor's contract names: a decrypt step carries signed contributions only."""
    c = consortium(secure_policy("ckks"))
    coordinator = CkksCoordinator(c)
    coordinator.keys()
    coordinator.join(SILOS)
    encrypted = coordinator.encrypt(dict.fromkeys(SILOS, 1 / len(SILOS)))
    assert sorted(encrypted) == SILOS, coordinator.refusals
    update = true_update(c, TARGET)
    config, tensors = coordinator.decryption({TARGET: encrypted[TARGET]}, update.size)
    names = sorted(n for n in encrypted[TARGET].tensors if n.startswith(CHUNK))
    as_a_sum = {chunk_name(i): encrypted[TARGET].tensors[n] for i, n in enumerate(names)}
    message = TaskMessage.decode(
        message_to(DECRYPTOR, "ckks_decrypt", config, 1, c, tensors | as_a_sum)
    )
    assert isinstance(message.config, CkksDecrypt)
    refused = contract_gate.refusal(message, c.agents[DECRYPTOR].context)
    assert "none of the signed inputs this step carries" in (refused or "")
    assert coordinator.confirm([TARGET, DECRYPTOR], [TARGET]) == {}
    decrypted = coordinator.decrypt({TARGET: encrypted[TARGET]}, update.size)
    leaked = decrypted is not None and np.abs(decrypted - update / len(SILOS)).max() < 1e-4
    assert not leaked, "the decryptor decrypted the target's update alone"
    assert "min_group" in coordinator.refusals["ckks_confirm"][TARGET]
    assert "not among the contributors" in coordinator.refusals["ckks_confirm"][DECRYPTOR]
    assert "not the set this silo confirmed" in coordinator.refusals["ckks_decrypt"][DECRYPTOR]


def test_a_decryptor_refuses_inputs_the_coordinator_relabels() -> None:
    c = consortium(secure_policy("ckks"))
    coordinator = CkksCoordinator(c)
    coordinator.keys()
    coordinator.join(SILOS)
    encrypted = coordinator.encrypt(dict.fromkeys(SILOS, 1 / len(SILOS)))
    update = true_update(c, TARGET)
    # the target's input passed off as silo-2's too, in a group of three (min_silos), which
    # every one of them confirms (each sent an input) and silo-2 is asked to decrypt
    disguised = {
        TARGET: encrypted[TARGET],
        "silo-2": encrypted[TARGET],
        "silo-3": encrypted["silo-3"],
    }
    assert sorted(coordinator.confirm(sorted(disguised), sorted(disguised))) == sorted(disguised)
    assert coordinator.decrypt(disguised, update.size, "silo-2") is None
    assert "not signed by silo-2's identity" in coordinator.refusals["ckks_decrypt"]["silo-2"]


def test_a_second_ckks_aggregation_of_the_same_round_is_refused() -> None:
    """A second join of round 1 over the other silos: under the round's join task ids each
    silo refuses it as answered already; under ids no position has, as outside its
    contract."""
    c = consortium(secure_policy("ckks"))
    first = CkksCoordinator(c)
    first.keys()
    assert len(first.join(SILOS)) == len(SILOS)
    others = [s for s in SILOS if s != TARGET]
    same_ids, new_ids = CkksCoordinator(c), CkksCoordinator(c, tag="again-")
    for second in (same_ids, new_ids):
        second.digest, second.sealed = first.digest, first.sealed
        assert second.join(others) == {}
    assert "answered already" in same_ids.refusals["ckks_join"]["silo-1"]
    assert "this position's task is" in new_ids.refusals["ckks_join"]["silo-1"]
