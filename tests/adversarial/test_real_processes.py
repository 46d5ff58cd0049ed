"""The deviating coordinator against real processes (issue 17): unmodified `fedsilo silo start`
processes answering hand-crafted tasks over mutual TLS, and a real `fedsilo coordinator start`
process that is restarted and sent a replayed envelope. Each test is bounded in time and kills
its processes at the end."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from fedsilo.coordinator.folded_keys import FoldedKeys
from fedsilo.coordinator.phases import Phase, QuorumNotMet, WeightedMean
from fedsilo.coordinator.replies import Accepted, accept
from fedsilo.coordinator.secure_sum import MaskedMean
from fedsilo.coordinator.strategies import make_strategy
from fedsilo.coordinator.strategies.base import RoundContext
from fedsilo.ops.coordinator_process import signed_policy
from fedsilo.ops.job_id import job_id
from fedsilo.ops.provision import load_coordinator_kit, load_silo_kit
from fedsilo.wire.control import ACCEPT, ACK, Control, decode_control
from fedsilo.wire.envelope import seal
from fedsilo.wire.messages import TaskMessage, TaskResult
from fedsilo.wire.payload import as_payload
from tests.adversarial.deviating import DeviatingCoordinator
from tests.deployment import Consortium, policy_document, provision, send_as_silo

SILO = "silo-0"
DP = {"delta": 1e-5, "dp_sgd": {"noise_multiplier": 1.0, "max_grad_norm": 1.0}}


@pytest.fixture
def consortium(tmp_path: Path) -> Iterator[Consortium]:
    consortium = provision(tmp_path)
    yield consortium
    consortium.stop_all()


def start_silo(consortium: Consortium, document: dict) -> None:
    consortium.start_silo(SILO, consortium.write_silo_config(SILO, data=document["data"]))


def shifted(answer: TaskResult, by: float) -> TaskResult:
    return TaskResult(
        answer.task_id,
        answer.silo,
        answer.kind,
        tensors={"model": answer.tensors["model"] + by},
        spec=answer.spec,
    )


def test_a_real_silo_under_a_masking_policy_answers_a_plain_train_task_with_no_model(
    consortium: Consortium,
) -> None:
    document = policy_document(secure_aggregation="masking")
    policy = consortium.write_policy(document)
    with DeviatingCoordinator(consortium, policy) as coordinator:
        start_silo(consortium, document)
        coordinator.wait_until_accepted(SILO, consortium)
        initial = coordinator.initial_model(SILO)
        answer = coordinator.ask(coordinator.train_task(SILO, initial)).result
    assert not answer.ok, "the silo released its trained model in the clear"
    assert "model" not in answer.tensors
    assert "masking" in (answer.error or "")


def test_a_real_silo_restarted_answers_a_reposted_task_id_with_the_same_bytes(
    consortium: Consortium,
) -> None:
    """Finding 2 over processes: a task id re-posted with another model after the silo
    restarted (its in-memory answer cache gone) must not train again with the same noise."""
    document = policy_document(privacy=DP)
    policy = consortium.write_policy(document)
    with DeviatingCoordinator(consortium, policy) as coordinator:
        start_silo(consortium, document)
        coordinator.wait_until_accepted(SILO, consortium)
        initial = coordinator.initial_model(SILO)
        first = coordinator.ask(coordinator.train_task(SILO, initial))
        assert first.result.ok, first.result.error
        consortium.kill(SILO)
        start_silo(consortium, document)
        # Post only once the new process has joined: a task popped by the killed process's
        # last long poll (its server-side handler outlives it by up to a poll) would be lost.
        consortium.wait_for_log(SILO, "accepted policy", timeout=60)
        again = coordinator.ask(coordinator.train_task(SILO, shifted(initial, 0.5)))
    assert again.raw == first.raw, (
        "the restarted silo trained the re-posted task id again: "
        f"{again.result.status}, {again.result.error or 'a fresh model'}"
    )


def test_an_envelope_replayed_to_a_restarted_coordinator_is_refused(
    consortium: Consortium,
) -> None:
    policy = consortium.write_policy(policy_document())
    digest = signed_policy(policy, load_coordinator_kit(consortium.kits / "coordinator")).digest
    silo = load_silo_kit(consortium.kits / "silos" / SILO)
    payload = Control(ACCEPT, {"policy_digest": digest}).encode()
    captured = seal(
        payload,
        signing_key=silo.signing_key,
        sender=SILO,
        deployment=silo.consortium,
        round=0,
        task_id="accept/captured",
    )
    consortium.start_coordinator(policy, join_timeout_s=120)
    consortium.wait_for_log("coordinator", "serving mTLS gRPC")
    first = decode_control(send_as_silo(consortium, SILO, captured, payload))
    assert (first.type, first.get("accepted")) == (ACK, True)

    consortium.kill("coordinator")
    consortium.start_coordinator(policy, join_timeout_s=120, name="restarted")
    consortium.wait_for_log("restarted", "serving mTLS gRPC")
    with pytest.raises(grpc.RpcError) as refused:
        reply = decode_control(send_as_silo(consortium, SILO, captured, payload))
        pytest.fail(f"the restarted coordinator took the replayed envelope: {reply}")
    assert "replay" in (refused.value.details() or "")
    consortium.wait_for_log("restarted", "replay")


def test_real_silos_refuse_a_masked_sum_of_fewer_silos_than_the_policys_min_silos(
    consortium: Consortium,
) -> None:
    """Issue 36, attack 1, over processes: the signed policy says min_silos 3; a coordinator
    runs the masking protocol over two `fedsilo silo start` processes. Each deployed silo holds
    max(min_group, min_silos) as its smallest sum, as a simulated one does
    (tests/adversarial/test_deny_by_default.py), so neither shares its secrets."""
    document = policy_document(
        secure_aggregation="masking", participants={"min_silos": 3, "phase_timeout_s": 20}
    )
    policy = consortium.write_policy(document)
    pair = ("silo-0", "silo-1")
    with DeviatingCoordinator(consortium, policy) as coordinator:
        for silo in pair:
            consortium.start_silo(silo, consortium.write_silo_config(silo, data=document["data"]))
        for silo in pair:
            coordinator.wait_until_accepted(silo, consortium)
        job = job_id(coordinator.policy.name, coordinator.signed.digest)
        initial = coordinator.initial_model(pair[0])
        assert initial.ok and initial.spec is not None, initial.error
        strategy = make_strategy(coordinator.policy)
        context = RoundContext(1, coordinator.policy.rounds, pair, coordinator.policy.seed, 2)
        tasks = tuple(
            strategy.train_task(s, initial.tensors["model"], initial.spec, context) for s in pair
        )
        refusals: dict[str, str] = {}

        def collect(step: str, tasks, aggregate=None):
            accepted, dropped = {}, {}
            for task in tasks:
                message = TaskMessage(
                    f"{job}/r1/train/{step}/{task.silo}", 1, "train", task.silo, task.config,
                    dict(task.tensors), task.spec, policy_digest=coordinator.signed.digest,
                )  # fmt: skip
                answer = coordinator.ask(message)
                fate = accept(as_payload(answer.raw), message, aggregate)
                if isinstance(fate, Accepted):
                    accepted[task.silo] = fate
                else:
                    dropped[task.silo] = refusals[task.silo] = fate.reason
            return accepted, dropped

        masked = MaskedMean(collect, coordinator.policy.secure_aggregation, job, 1, 2,
                            FoldedKeys(lambda r, p: None))  # fmt: skip
        with pytest.raises(QuorumNotMet):
            masked.run(Phase("train", tasks, aggregate=WeightedMean(("model",))))
    assert set(refusals) == set(pair), refusals
    assert all("at least 3" in why for why in refusals.values()), refusals
