"""FedDC: rounds follow the daisy and aggregation schedules (aggregation first when both fall
due); hand-offs move each model to its recipient, sealed so that only the recipient opens
them and the coordinator relays bytes it cannot read; a key outside the roster is refused; a
dropped recipient's sealed model stays with its sender; FedAvg and daisy chaining alone are the
degenerate schedules; Radon aggregation is the iterated Radon point of the models; no model
returns to a recent holder; incompatible policies are refused."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np
import pytest
import torch
from nacl.public import PrivateKey
from nacl.signing import SigningKey, VerifyKey
from sklearn.datasets import make_classification

from fedsilo.coordinator.engine import RoundEngine, RunHistory
from fedsilo.coordinator.radon import radon_point
from fedsilo.coordinator.strategies import make_strategy
from fedsilo.coordinator.transport import InProcessTransport
from fedsilo.policies.loading import PolicyError, parse_policy
from fedsilo.policies.schema import Policy
from fedsilo.policies.seeding import derive_rng
from fedsilo.privacy.handoff import Binding, HandoffError, open_sealed, unpack
from fedsilo.silo.agent import SiloAgent
from fedsilo.silo.data import SiloDataset
from fedsilo.silo.tasks.base import SiloKeys
from fedsilo.wire.messages import STATUS_ERROR, TaskMessage, TaskResult
from fedsilo.wire.tasks import DaisyTrain, Handoff
from fedsilo.wire.tasks.tensor_names import HANDOFF

Endpoint = Callable[[bytes], bytes]
FEATURES = 4


def silo_data(name: str, seed: int, samples: int = 10, features: int = FEATURES) -> SiloDataset:
    x, y = make_classification(
        samples + 20,
        features,
        n_informative=min(2, features),
        n_redundant=0,
        n_clusters_per_class=1,
        random_state=seed,
    )
    x, y = torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.int64)
    return SiloDataset(
        name,
        x[:samples],
        y[:samples],
        x[samples : samples + 10],
        y[samples : samples + 10],
        x[samples + 10 :],
        y[samples + 10 :],
        "classification",
        2,
        tuple(f"f{i}" for i in range(features)),
        (features,),
    )


def policy(rounds: int = 4, model: dict | None = None, **algorithm: object) -> Policy:
    extra = {k: algorithm.pop(k) for k in ("channel", "secure_aggregation") if k in algorithm}
    return parse_policy(
        {
            "version": 1,
            "seed": 3,
            "rounds": rounds,
            "eval_every": rounds,
            "algorithm": {"name": "feddc", **algorithm},
            "model": model or {"name": "mlp", "hidden": [8]},
            "training": {"steps": 1, "batch_size": 10, "lr": 0.1},
            **extra,
        }
    )


class Consortium:
    """Silo agents with identities and sealing keys, behind an in-process transport that
    records every task and reply (the coordinator's transcript)."""

    def __init__(self, silos: int, features: int = FEATURES) -> None:
        self.data = [silo_data(f"silo-{i}", seed=i, features=features) for i in range(silos)]
        self.identities = {d.name: SigningKey.generate() for d in self.data}
        self.sealing = {d.name: PrivateKey.generate() for d in self.data}
        self.tasks: list[TaskMessage] = []
        self.replies: list[TaskResult] = []
        self.agents: dict[str, SiloAgent] = {}

    def run(
        self, p: Policy, wrap: Callable[[str, Endpoint], Endpoint] = lambda _, e: e
    ) -> RunHistory:
        sealing_roster = {n: k.public_key for n, k in self.sealing.items()}
        self.agents = {
            d.name: SiloAgent(
                d.name,
                d,
                p,
                keys=SiloKeys(
                    identity=self.identities[d.name],
                    roster=self.roster,
                    sealing_key=self.sealing[d.name],
                    sealing_roster=sealing_roster,
                ),
            )
            for d in self.data
        }

        def recorded(name: str, endpoint: Endpoint) -> Endpoint:
            def answer(payload: bytes) -> bytes:
                self.tasks.append(TaskMessage.decode(payload))
                reply = endpoint(payload)
                self.replies.append(TaskResult.decode(reply))
                return reply

            return wrap(name, answer)

        transport = InProcessTransport(
            {n: recorded(n, a.handle_bytes) for n, a in self.agents.items()}
        )
        keys = {n: bytes(k) for n, k in sealing_roster.items()}
        engine = RoundEngine(make_strategy(p), transport, p, sorted(self.agents), handoff_keys=keys)
        return engine.run()

    @property
    def roster(self) -> dict[str, VerifyKey]:
        return {n: k.verify_key for n, k in self.identities.items()}

    def hosted(self, silo: str) -> torch.Tensor:
        hosted = self.agents[silo].context.store.hosted.model
        assert hosted is not None
        return hosted

    def kinds(self, round_no: int) -> set[str]:
        return {t.kind for t in self.tasks if t.round == round_no}


def failing(silo: str, kind: str, round_no: int) -> Callable[[str, Endpoint], Endpoint]:
    def wrap(name: str, endpoint: Endpoint) -> Endpoint:
        def answer(payload: bytes) -> bytes:
            task = TaskMessage.decode(payload)
            if name == silo and task.kind == kind and task.round == round_no:
                return TaskResult(
                    task.task_id, name, task.kind, status=STATUS_ERROR, error="power cut"
                ).encode()
            return endpoint(payload)

        return answer

    return wrap


def test_rounds_follow_the_daisy_and_aggregation_schedule() -> None:
    consortium = Consortium(3)
    history = consortium.run(policy(rounds=12, daisy_period=2, aggregation_period=6))
    phases = [
        sorted(
            set(r.phases)
            - {"evaluate_local_test", "evaluate_local_train", "evaluate_test", "evaluate_train"}
        )
        for r in history.records
    ]
    daisy, aggregate, local = ["daisy"], ["aggregate"], ["local"]
    # t = round - 1: daisy when (t+1) % 2 == 0, aggregation when (t+1) % 6 == 0 (and then only)
    assert phases == [local, daisy, local, daisy, local, aggregate] * 2


def test_a_hand_off_moves_each_model_to_its_recipient() -> None:
    consortium = Consortium(4)
    history = consortium.run(
        policy(rounds=1, daisy_period=1, aggregation_period=None, permutation="derangement")
    )
    sent = {r.silo: r.tensors[HANDOFF] for r in consortium.replies if HANDOFF in r.tensors}
    routes = {t.silo: t.tensors[HANDOFF] for t in consortium.tasks if t.kind == "daisy_receive"}
    assert routes, "a round with d=1 hands models on"
    for recipient, blob in routes.items():
        (sender,) = [s for s, b in sent.items() if torch.equal(b, blob)]
        assert sender != recipient
        handed = unpack(
            bytes(blob.numpy()), Binding("simulation", 1, "daisy", None), consortium.roster
        )
        assert handed.sender == sender
        assert torch.equal(consortium.hosted(recipient), handed.model)
    assert history.records[0].status == "completed"


def test_sealed_hand_offs_open_only_at_their_recipient() -> None:
    consortium = Consortium(4)
    p = policy(
        rounds=1,
        daisy_period=1,
        aggregation_period=None,
        permutation="derangement",
        channel={"sealed_handoffs": True},
    )
    consortium.run(p)
    deliveries = [t for t in consortium.tasks if t.kind == "daisy_receive"]
    assert deliveries
    for task in deliveries:
        blob = bytes(task.tensors[HANDOFF].numpy())
        assert task.config.to_json() == {"sealed": True}  # nothing names the sender
        bound = Binding("simulation", 1, "daisy", task.silo)
        with pytest.raises(HandoffError):
            unpack(blob, bound, consortium.roster)  # the coordinator cannot read it
        for other in consortium.sealing:
            if other != task.silo:
                with pytest.raises(HandoffError, match="does not open"):
                    open_sealed(blob, consortium.sealing[other])
        handed = unpack(open_sealed(blob, consortium.sealing[task.silo]), bound, consortium.roster)
        assert torch.equal(consortium.hosted(task.silo), handed.model)


def test_a_hand_off_key_outside_the_roster_is_refused() -> None:
    stranger = bytes(PrivateKey.generate().public_key).hex()

    def substitute(name: str, endpoint: Endpoint) -> Endpoint:
        def answer(payload: bytes) -> bytes:
            task = TaskMessage.decode(payload)
            if isinstance(task.config, DaisyTrain) and task.config.handoff is not None:
                config = replace(task.config, handoff=Handoff(seal_to=stranger))
                task = replace(task, config=config)
            return endpoint(task.encode())

        return answer

    consortium = Consortium(3)
    p = policy(
        rounds=1,
        daisy_period=1,
        aggregation_period=None,
        permutation="derangement",
        channel={"sealed_handoffs": True},
    )
    (record,) = consortium.run(p, substitute).records
    assert record.status == "failed"
    assert "config key 'handoff' seals to no other member's key" in record.error


def test_a_dropped_recipients_sealed_model_stays_with_its_sender() -> None:
    """A sealed hand-off cannot be re-addressed, and a silo seals a hosted model to one member
    a round: the model whose recipient dropped is resealed to no one else and stays with its
    sender (which keeps what it hands off until a model arrives for it), the silo whose sender
    dropped keeps its own, and the next round's permutation counts the dropped recipient among
    the holders of a model its sender kept, as the sender does (no silo refuses a task)."""
    consortium = Consortium(5)
    p = policy(
        rounds=3,
        daisy_period=1,
        aggregation_period=None,
        permutation="derangement",
        no_return_window=1,
        channel={"sealed_handoffs": True},
    )
    history = consortium.run(p, failing("silo-2", "daisy_train", round_no=2))
    assert [r.status for r in history.records] == ["completed"] * 3
    assert "silo-2" in history.records[1].phases["daisy"]["dropped"]
    assert not [t for t in consortium.tasks if t.kind == "daisy_reseal"]
    refused = [r.error for r in consortium.replies if not r.ok and r.error != "power cut"]
    assert not refused
    sent = {
        r.silo: r.tensors[HANDOFF] for r in consortium.replies
        if HANDOFF in r.tensors and r.task_id.startswith("simulation/r2/")
    }  # fmt: skip
    delivered = hops(consortium, 2)
    (orphan,) = set(sent) - set(delivered)  # silo-2 was someone's recipient
    handed = unpack(
        open_sealed(bytes(sent[orphan].numpy()), consortium.sealing["silo-2"]),
        Binding("simulation", 2, "daisy", "silo-2"),
        consortium.roster,
    )
    assert handed.sender == orphan
    assert len(delivered) == len(sent) - 1 and "silo-2" not in delivered.values()
    assert len(set(sent) - set(delivered.values())) == 1  # silo-2's recipient keeps its own


def test_fedavg_is_the_schedule_without_hand_offs() -> None:
    rounds = 3
    consortium = Consortium(3)
    feddc = consortium.run(policy(rounds=rounds, daisy_period=None, aggregation_period=1))
    fedavg = Consortium(3).run(
        parse_policy({**policy(rounds=rounds).model_dump(), "algorithm": {"name": "fedavg"}})
    )  # equal silo sizes: FedAvg's sample weights are FedDC's equal ones
    assert torch.allclose(feddc.state.model, fedavg.state.model, atol=1e-6)
    assert consortium.kinds(2) == {"daisy_train"}


def test_daisy_chaining_alone_never_aggregates_and_reports_the_local_models() -> None:
    consortium = Consortium(3)
    history = consortium.run(policy(rounds=4, daisy_period=1, aggregation_period=None))
    assert all("aggregate" not in r.phases for r in history.records)
    assert "accuracy" in history.final.summary and "local_accuracy" not in history.final.summary


def test_radon_aggregation_is_the_radon_point_of_the_silos_models() -> None:
    # a linear model on 1 feature and 2 classes has d = 4 parameters, so r = 6 silos
    consortium = Consortium(6, features=1)
    p = policy(
        rounds=1, model={"name": "linear"}, daisy_period=None, aggregation_period=1,
        aggregator="radon",
    )  # fmt: skip
    history = consortium.run(p)
    sent = {r.silo: r.tensors["model"] for r in consortium.replies if r.kind == "daisy_train"}
    # the round's seeded draw of which models, in which order (a linear softmax model's
    # updates are degenerate, so the Radon point depends on the order)
    order = derive_rng(p.seed, "round", 1, "radon").permutation(len(sent))
    models = np.stack([sent[sorted(sent)[i]].double().numpy() for i in order])
    assert history.state.model.double().numpy() == pytest.approx(radon_point(models), abs=1e-6)


def test_a_round_with_fewer_models_than_the_radon_number_fails_naming_why() -> None:
    # (`policy validate` and `simulate` refuse such a policy once the model's size is known:
    # tests/test_policy_regressions.py; a deployment's round meets it when too few answer)
    consortium = Consortium(4, features=1)
    p = policy(
        rounds=1, model={"name": "linear"}, daisy_period=None, aggregation_period=1,
        aggregator="radon",
    )  # fmt: skip
    (record,) = consortium.run(p).records
    assert record.status == "failed"
    assert "the Radon point of models of 4 parameters takes r = d + 2 = 6" in record.error
    assert "and 4 answered" in record.error


def hops(consortium: Consortium, round_no: int) -> dict[str, str]:
    """sender -> recipient of one round's hand-offs, matched by the bytes relayed."""
    sent = {
        r.silo: r.tensors[HANDOFF]
        for r in consortium.replies
        if HANDOFF in r.tensors and r.task_id.startswith(f"simulation/r{round_no}/")
    }
    return {
        next(s for s, blob in sent.items() if torch.equal(blob, t.tensors[HANDOFF])): t.silo
        for t in consortium.tasks
        if t.kind == "daisy_receive" and t.round == round_no
    }


def test_no_model_returns_to_a_silo_that_held_it_within_the_window() -> None:
    window, rounds = 2, 12
    consortium = Consortium(5)
    consortium.run(policy(rounds=rounds, daisy_period=1, aggregation_period=None,
                          no_return_window=window))  # fmt: skip
    trails = {s: [s] for s in consortium.agents}  # by current host: the model's holders
    for round_no in range(1, rounds + 1):
        moved = hops(consortium, round_no)
        trails = {moved.get(host, host): trail + [moved[host]] if host in moved else trail
                  for host, trail in trails.items()}  # fmt: skip
    for trail in trails.values():
        for j in range(1, len(trail)):
            assert trail[j] not in trail[max(0, j - window - 1) : j], trail
    assert sum(len(t) - 1 for t in trails.values()) >= rounds  # models did move


def test_an_impossible_return_window_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="no permutation of 2 silos"):
        Consortium(2).run(
            policy(rounds=2, daisy_period=1, aggregation_period=None, permutation="derangement",
                   no_return_window=1)
        )  # fmt: skip


def test_runs_repeat_bit_for_bit() -> None:
    p = policy(rounds=6, daisy_period=1, aggregation_period=3)
    first, second = Consortium(4).run(p), Consortium(4).run(p)
    assert torch.equal(first.state.model, second.state.model)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"privacy": {"client_dp": {"clip": 1.0, "noise_multiplier": 1.0}}},
            "feddc hands single silos' models",
        ),
        ({"algorithm": {"name": "fedavg"}, "channel": {"sealed_handoffs": True}}, "only feddc"),
        (
            {
                "algorithm": {"name": "feddc", "aggregator": "radon"},
                "secure_aggregation": "masking",
            },
            "with the Radon aggregator needs each silo's own model",
        ),
        ({"algorithm": {"name": "feddc", "aggregator": "median"}}, "aggregator"),
    ],
)
def test_policies_that_cannot_run_feddc_are_refused(change: dict, message: str) -> None:
    with pytest.raises(PolicyError, match=message):
        parse_policy({**policy().model_dump(), **change})
