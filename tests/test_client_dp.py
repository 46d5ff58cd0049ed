"""Client-level DP (DP-FedAvg): silos clip their updates to S; the round's aggregate carries
Gaussian noise of std z*S (added by the coordinator, or in shares by the silos so that the
coordinator never sees an un-noised sum); the published model's epsilon is accounted per round
as a sampled Gaussian mechanism, and each silo books what it released."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from opacus.accountants import RDPAccountant

from fedsilo.coordinator.client_dp import ClientDpRound
from fedsilo.coordinator.engine import RoundEngine
from fedsilo.coordinator.phases import Phase, Task, WeightedMean
from fedsilo.coordinator.strategies import make_strategy
from fedsilo.coordinator.strategies.base import RoundContext
from fedsilo.coordinator.transport import InProcessTransport
from fedsilo.ops.metrics import CoordinatorMetrics
from fedsilo.ops.sim_silos import ConsortiumKeys
from fedsilo.policies.loading import PolicyError, parse_policy
from fedsilo.policies.privacy import MIN_NOISE_MULTIPLIER
from fedsilo.policies.schema import Policy
from fedsilo.privacy.accounting import Mechanism
from fedsilo.privacy.ledger import PrivacyLedger
from fedsilo.silo.agent import SiloAgent
from fedsilo.silo.data import load_consortium
from fedsilo.silo.tasks.train import train_releases
from fedsilo.wire.messages import TaskMessage, TaskResult
from fedsilo.wire.tasks import LocalTraining, TrainTask
from tests.silos import honest

CLIP = 0.5
SILOS = 4


def policy(
    noise: str, z: float = 1.0, rounds: int = 1, lr: float = 0.1, **algorithm: object
) -> Policy:
    return parse_policy(
        {
            "version": 1,
            "seed": 3,
            "rounds": rounds,
            "algorithm": {"name": "fedavg", **algorithm},
            # about 8,000 parameters: one round's noise is 8,000 independent draws
            "model": {"name": "mlp", "hidden": [256]},
            "training": {"epochs": 1, "batch_size": 32, "lr": lr},
            "participants": {"min_silos": 1, "phase_timeout_s": 60},
            "data": {
                "source": "sklearn:breast_cancer",
                "partition": {"kind": "iid", "silos": SILOS},
            },
            "privacy": {"client_dp": {"clip": CLIP, "noise_multiplier": z, "noise": noise}},
        }
    )


Endpoint = Callable[[bytes], bytes]


def silos(p: Policy, first_only: bool = False, **kwargs: object) -> dict[str, SiloAgent]:
    """The policy's silos (the first alone, with `first_only`), each built from `p` with a
    secret of its own and the consortium's keys (their roster is the consortium a silo knows,
    which bounds a round's cohort); `kwargs` go to each `SiloAgent`."""
    datasets = load_consortium(p.data, seed=p.seed)
    keys = ConsortiumKeys.generate(d.name for d in datasets)
    return {
        d.name: SiloAgent(d.name, d, p, secret=d.name.encode(), keys=keys.of(d.name), **kwargs)
        for d in (datasets[:1] if first_only else datasets)
    }


def first_silo(p: Policy, **kwargs: object) -> SiloAgent:
    (agent,) = silos(p, first_only=True, **kwargs).values()
    return agent


def run(
    p: Policy,
    wrap: Callable[[str, Endpoint], Endpoint] = lambda _, endpoint: endpoint,
    secret: bytes = b"coordinator",
    metrics: CoordinatorMetrics | None = None,
):
    agents = silos(p)
    engine = RoundEngine(
        make_strategy(p),
        InProcessTransport({n: wrap(n, a.handle_bytes) for n, a in agents.items()}),
        p,
        sorted(agents),
        observers=[metrics] if metrics else [],
        secret=secret,
    )
    return engine.run()


def aggregate_noise(noise: str, wrap=lambda _, endpoint: endpoint) -> torch.Tensor:
    """The noise in one round's sum of updates: (noisy mean - nearly noise-free mean) *
    answered; the control runs at the least noise multiplier a policy takes, 1% of the run's,
    which moves the measured std by at most 1% (inside every tolerance below)."""
    noisy = run(policy(noise), wrap)
    clean = run(policy(noise, z=MIN_NOISE_MULTIPLIER), wrap)
    answered = len(noisy.records[0].phases["train"]["answered"])
    return (noisy.state.model - clean.state.model).double() * answered


@pytest.mark.parametrize("noise", ["central", "distributed"])
def test_the_aggregate_carries_noise_of_std_z_times_clip(noise: str) -> None:
    draws = aggregate_noise(noise)
    assert draws.numel() > 7_000
    # 8,000 draws: the sample std is within 1% of the true one (one standard error); 5% is
    # far outside what chance allows, and well inside what a missing share would do (13%).
    assert draws.std().item() == pytest.approx(CLIP, rel=0.05)
    assert draws.mean().item() == pytest.approx(0.0, abs=5 * CLIP / math.sqrt(draws.numel()))


def test_a_silo_that_drops_has_its_share_of_the_noise_made_up_by_the_coordinator() -> None:
    def fail_training(name: str, endpoint: Endpoint) -> Endpoint:
        def answer(payload: bytes) -> bytes:
            task = TaskMessage.decode(payload)
            if name == "silo-0" and task.kind == "train":
                return TaskResult(task.task_id, name, task.kind, error="disk full").encode()
            return endpoint(payload)

        return answer

    draws = aggregate_noise("distributed", fail_training)
    assert draws.std().item() == pytest.approx(CLIP, rel=0.05)


def uploads(p: Policy) -> dict[str, torch.Tensor]:
    """What each silo sent the coordinator in round 1's training phase."""
    sent: dict[str, torch.Tensor] = {}

    def record(name: str, endpoint: Endpoint) -> Endpoint:
        def answer(payload: bytes) -> bytes:
            reply = endpoint(payload)
            result = TaskResult.decode(reply)
            if result.kind == "train":
                sent[name] = result.tensors["model"].double()
            return reply

        return answer

    run(p, record)
    return sent


def test_with_distributed_noise_each_upload_is_noised_and_their_sum_carries_all_of_it() -> None:
    noisy = uploads(policy("distributed"))
    clean = uploads(policy("distributed", z=MIN_NOISE_MULTIPLIER))  # as in `aggregate_noise`
    shares = {silo: noisy[silo] - clean[silo] for silo in noisy}
    for share in shares.values():
        assert share.std().item() == pytest.approx(CLIP / math.sqrt(SILOS), rel=0.05)
    assert sum(shares.values()).std().item() == pytest.approx(CLIP, rel=0.05)


def train_task() -> TrainTask:
    """A train task as a strategy words it: an epoch of SGD at 0.1 in batches of 32."""
    return TrainTask(local=LocalTraining(epochs=1, batch_size=32, optimizer="sgd", lr=0.1, seed=1))


def train_once(p: Policy) -> tuple[torch.Tensor, torch.Tensor]:
    """One silo's (initial model, the model it returns after round 1's train task), the task
    its policy `p` asks for (one epoch of SGD at `p`'s learning rate, sharing the noise among
    the whole consortium under distributed noise)."""
    agent = first_silo(p)
    init = agent.handle(honest(agent, "init", 0))
    distributed = p.privacy.client_dp is not None and p.privacy.client_dp.noise == "distributed"
    chosen = {"cohort": SILOS} if distributed else {}
    trained = agent.handle(honest(agent, "train", 1, init.tensors, init.spec, **chosen))
    assert trained.ok, trained.error
    return init.tensors["model"].double(), trained.tensors["model"].double()


def test_a_large_update_leaves_its_silo_clipped_to_the_clip_norm() -> None:
    start, trained = train_once(policy("central", lr=1.0))
    assert (trained - start).norm().item() == pytest.approx(CLIP, rel=1e-5)


def test_an_update_within_the_clip_norm_leaves_unchanged() -> None:
    slow = policy("central", lr=1e-4)
    plain = slow.model_copy(update={"privacy": slow.privacy.model_copy(update={"client_dp": None})})
    start, clipped = train_once(slow)
    _, unclipped = train_once(plain)
    assert (unclipped - start).norm().item() < CLIP
    assert torch.allclose(clipped, unclipped, rtol=0, atol=1e-7)


def test_a_silo_books_its_share_of_the_noise_and_cannot_be_told_to_shrink_it(tmp_path) -> None:
    p = policy("distributed", z=2.0)
    agent = first_silo(p)

    def booked(cohort: int) -> Mechanism:
        return train_releases(honest(agent, cohort=cohort), agent.context)[0]

    assert booked(2) == Mechanism.gaussian(sensitivity=CLIP, noise_std=2.0 * CLIP / math.sqrt(2))
    # a coordinator that claims more silos than the consortium has gets the consortium's share
    assert booked(100) == booked(SILOS)
    assert booked(SILOS).noise_std == pytest.approx(2.0 * CLIP / 2)
    # and the silo's contract refuses such a task before anything runs or is booked
    init = agent.handle(honest(agent, "init", 0))
    claimed = agent.handle(honest(agent, "train", 1, init.tensors, init.spec, cohort=100))
    assert claimed.status == "error" and not claimed.tensors
    assert f"config key 'cohort' is 100; this silo takes 1..{SILOS}" in (claimed.error or "")


def test_central_noise_leaves_the_silos_uploads_exact_and_books_no_noise() -> None:
    p = policy("central")
    assert not p.privacy.differentially_private
    agent = first_silo(p)
    assert train_releases(honest(agent), agent.context) == [Mechanism.none()]


@pytest.mark.parametrize(("noise", "cohort"), [("central", None), ("distributed", SILOS)])
def test_the_engine_tells_each_train_task_its_cohort_only_under_distributed_noise(
    noise: str, cohort: int | None
) -> None:
    told: list[int | None] = []

    def wrap(_: str, endpoint: Endpoint) -> Endpoint:
        def answer(payload: bytes) -> bytes:
            task = TaskMessage.decode(payload)
            if isinstance(task.config, TrainTask):
                told.append(task.config.cohort)
            return endpoint(payload)

        return answer

    run(policy(noise), wrap)
    assert told == [cohort] * SILOS


def test_a_mean_that_weighs_its_silos_itself_is_refused_under_client_dp() -> None:
    ctx = RoundContext(round=1, total_rounds=1, silos=("a", "b"), seed=3, min_silos=1)
    client_dp = ClientDpRound.of(policy("central"), ctx)
    assert client_dp is not None
    tasks = (Task("a", train_task()), Task("b", train_task()))
    weighted = Phase("train", tasks, WeightedMean(weights={"a": 2.0, "b": 1.0}))
    with pytest.raises(ValueError, match="client-level DP weighs them equally"):
        client_dp.phase(weighted)
    assert client_dp.phase(Phase("train", tasks, WeightedMean())).aggregate == WeightedMean(
        weights={"a": 1.0, "b": 1.0}
    )


def test_the_published_models_epsilon_is_the_sampled_gaussian_over_completed_rounds() -> None:
    metrics = CoordinatorMetrics(deployment="d")
    history = run(policy("central", z=1.5, rounds=3, client_fraction=0.5), metrics=metrics)
    accountant = RDPAccountant()
    for record in history.records:
        accountant.history = [(1.5, 2 / SILOS, record.round)]
        assert record.client_epsilon == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-12)
    assert metrics.registry.get_sample_value(
        "fedsilo_client_dp_epsilon", {"deployment": "d"}
    ) == pytest.approx(history.records[-1].client_epsilon)


def test_a_run_repeats_bit_for_bit_and_the_coordinators_noise_follows_its_secret() -> None:
    p = policy("central", rounds=2)
    first, again = run(p), run(p)
    assert torch.equal(first.state.model, again.state.model)
    other = run(p, secret=b"another coordinator")
    assert not torch.equal(first.state.model, other.state.model)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"algorithm": {"name": "local"}}, "privacy.client_dp: local does not average"),
        ({"data": {"source": "sklearn:breast_cancer", "scaling": "federated"}}, "scaling"),
    ],
)
def test_client_dp_is_refused_where_it_cannot_hold(change: dict, message: str) -> None:
    document = {**policy("central").model_dump(), **change}
    with pytest.raises(PolicyError, match=message):
        parse_policy(document)


def test_distributed_noise_makes_a_dp_deployment_and_its_reports_are_noised() -> None:
    assert policy("distributed").privacy.differentially_private
    agent = first_silo(policy("distributed"))
    assert agent.context.reports("t", "train").noised


def test_the_ledger_books_each_rounds_share(tmp_path) -> None:
    p = policy("distributed", rounds=2)
    ledger = PrivacyLedger(tmp_path / "s.jsonl")
    agent = first_silo(p, ledger=ledger, deployment="d")
    start = agent.handle(honest(agent, "init", 0))
    assert agent.handle(honest(agent, "train", 1, start.tensors, start.spec, cohort=2)).ok
    share = Mechanism.gaussian(sensitivity=CLIP, noise_std=CLIP / math.sqrt(2))
    assert share in [record.mechanism for record in ledger.records() if record.deployment == "d"]
