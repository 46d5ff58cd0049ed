"""The loss-driven mixing schedules as strategies: each round probes the silos' losses, turns
them into mixing coefficients and mixes the silos' models with them. q = 0 and a zero tilt are
FedAvg; silos with noisy labels (larger losses) gain weight under AFL, AAggFF and DRFA; the
coefficients are kept in the state, exported as a metric and resumed after a restart;
secure aggregation mixes with the same coefficients; DRFA never averages fewer distinct silos
than its minimum, and its R-FedTorch variant trains uniformly drawn silos whose updates are
scaled by lambda_k K; settings for another algorithm are refused."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from fedsilo.coordinator.engine import RoundEngine, RunAborted, RunHistory
from fedsilo.coordinator.strategies import make_strategy
from fedsilo.coordinator.transport import InProcessTransport
from fedsilo.ops.metrics import CoordinatorMetrics
from fedsilo.ops.sim_silos import ConsortiumKeys, build_agent
from fedsilo.ops.simulate import simulate
from fedsilo.policies.loading import PolicyError, parse_policy
from fedsilo.policies.schema import Policy
from fedsilo.silo.agent import SiloAgent
from fedsilo.silo.data import load_consortium
from fedsilo.wire.messages import TaskMessage
from fedsilo.wire.tasks import TrainTask
from tests.resume import resumed_and_uninterrupted

SILOS = 4
NOISY = {"silo_fraction": 0.25, "probability": 0.45}  # one silo of four, labels near random


def policy(
    name: str, rounds: int = 4, noisy: bool = False, settings: dict | None = None, **extra: object
) -> Policy:
    data: dict = {"source": "sklearn:breast_cancer", "partition": {"kind": "iid", "silos": SILOS}}
    if noisy:
        data["label_noise"] = NOISY
    return parse_policy(
        {
            "version": 1,
            "seed": 2,
            "rounds": rounds,
            "eval_every": rounds,
            "algorithm": {"name": name, **(settings or {})},
            "model": {"name": "linear"},
            "training": {"steps": 4, "batch_size": 16, "lr": 0.1},
            "data": data,
            **extra,
        }
    )


def run(p: Policy) -> RunHistory:
    return simulate(p, load_consortium(p.data, seed=p.seed)).history


def noisy_silo(p: Policy) -> str:
    """The silo whose training labels the policy's label noise hit."""
    clean = load_consortium(p.model_copy(update={"data": p.data.model_copy(
        update={"label_noise": None})}).data, seed=p.seed)  # fmt: skip
    noisy = load_consortium(p.data, seed=p.seed)
    (silo,) = [
        a.name for a, b in zip(noisy, clean, strict=True) if not torch.equal(a.y_train, b.y_train)
    ]
    return silo


@pytest.mark.parametrize(("name", "settings"), [("qfedavg", {"q": 0.0}), ("term", {"tilt": 0.0})])
def test_the_degenerate_parameters_are_fedavg(name: str, settings: dict) -> None:
    fair = run(policy(name, settings=settings))
    fedavg = run(policy("fedavg"))
    assert torch.allclose(fair.state.model, fedavg.state.model, atol=1e-6)
    weights = fair.records[-1].mixing
    assert weights is not None and sum(weights.values()) == pytest.approx(1.0)


@pytest.mark.parametrize("name", ["qfedavg", "term", "propfair", "afl", "aaggff", "drfa"])
def test_a_silo_with_noisy_labels_gains_weight(name: str) -> None:
    p = policy(name, rounds=6, noisy=True)
    history = run(p)
    weights = history.records[-1].mixing
    assert weights is not None and set(weights) == {f"silo-{i}" for i in range(SILOS)}
    noisy = noisy_silo(p)
    assert weights[noisy] == max(weights.values()), weights
    assert weights[noisy] > 1 / SILOS


def test_agnostic_fedavg_moves_lambda_toward_the_larger_losses() -> None:
    p = policy("agnostic_fedavg", rounds=6, noisy=True, settings={"step": 1.0})
    history = run(p)
    lam = history.state.extra["mixing"]["lam"]
    silos = history.state.extra["mixing"]["silos"]
    assert silos[int(np.argmax(lam))] == noisy_silo(p)


def test_the_coefficients_are_exported_as_a_metric() -> None:
    registry = CollectorRegistry()
    metrics = CoordinatorMetrics(registry, deployment="d")
    p = policy("aaggff", rounds=2)
    history = simulate(p, load_consortium(p.data, seed=p.seed), observers=[metrics]).history
    for silo, weight in history.records[-1].mixing.items():
        value = registry.get_sample_value(
            "fedsilo_mixing_weight", {"silo": silo, "deployment": "d"}
        )
        assert value == pytest.approx(weight)


def test_a_restarted_coordinator_resumes_the_schedule(tmp_path) -> None:
    p = policy("aaggff", rounds=4, noisy=True)
    resumed, uninterrupted = resumed_and_uninterrupted(p, tmp_path, stop_after=2)
    assert torch.equal(resumed.state.model, uninterrupted.state.model)
    assert resumed.state.extra["mixing"] == uninterrupted.state.extra["mixing"]


def test_secure_aggregation_mixes_with_the_same_coefficients() -> None:
    plain = run(policy("term", rounds=2, noisy=True))
    masked = run(policy("term", rounds=2, noisy=True, secure_aggregation="masking"))
    assert torch.allclose(plain.state.model, masked.state.model, atol=1e-5)
    assert masked.records[-1].mixing == pytest.approx(plain.records[-1].mixing)


def test_drfa_under_secure_aggregation_mixes_the_model_and_its_checkpoint_as_in_the_clear() -> None:
    """The checkpoint is summed relative to the model sent (the mean's declared reference), and
    lambda moves by the losses at the mixed checkpoint."""
    plain = run(policy("drfa", rounds=2, noisy=True))
    masked = run(policy("drfa", rounds=2, noisy=True, secure_aggregation="masking"))
    assert torch.allclose(plain.state.model, masked.state.model, atol=1e-5)
    assert masked.records[-1].mixing == pytest.approx(plain.records[-1].mixing)


def recorded_run(p: Policy) -> tuple[RunHistory, list[TaskMessage]]:
    """A simulation of `p` that also returns every task message the silos received (its
    agents built as `fedsilo simulate` builds them, each knowing the consortium's members)."""
    datasets = load_consortium(p.data, seed=p.seed)
    keys = ConsortiumKeys.generate(d.name for d in datasets)
    agents = {d.name: build_agent(p, d.name, d, torch.device("cpu"), keys) for d in datasets}
    received: list[TaskMessage] = []

    def endpoint(agent: SiloAgent) -> Callable[[bytes], bytes]:
        def answer(payload: bytes) -> bytes:
            received.append(TaskMessage.decode(payload))
            return agent.handle_bytes(payload)

        return answer

    transport = InProcessTransport({n: endpoint(a) for n, a in agents.items()})
    history = RoundEngine(make_strategy(p), transport, p, sorted(agents)).run()
    return history, received


def test_drfa_fedtorch_trains_uniform_silos_whose_updates_lambda_k_k_scales() -> None:
    p = policy(
        "drfa", rounds=5, noisy=True,
        settings={"variant": "fedtorch", "silos_per_round": 2, "step": 2.0},
    )  # fmt: skip
    history, received = recorded_run(p)
    lam_before = {1: dict.fromkeys(history.records[0].mixing, 1 / SILOS)}
    lam_before |= {r.round + 1: r.mixing for r in history.records}
    for r in history.records:
        train = [m for m in received if m.round == r.round and m.kind == "train"]
        assert len({m.silo for m in train}) == 2  # M distinct silos, no repeats
        for m in train:
            assert isinstance(m.config, TrainTask) and m.config.checkpoint_step is not None
            assert m.config.update_scale == pytest.approx(lam_before[r.round][m.silo] * SILOS)
            assert 0 <= m.config.checkpoint_step <= p.training.steps - 2
            assert m.config.checkpoint_step == p.algorithm.checkpoint_step(p, r.round)
        assert set(r.phases["train"]["answered"]) == {m.silo for m in train}
    assert len({frozenset(r.phases["train"]["answered"]) for r in history.records}) > 1
    assert history.records[-1].mixing != lam_before[1]  # lambda moved


def test_drfa_fedtorch_decays_its_step_by_default() -> None:
    def lam(decay: float | None) -> list[float]:
        settings = {"variant": "fedtorch", "step": 0.01, "init": "uniform"}
        settings |= {"step_decay": decay} if decay else {}
        p = policy("drfa", rounds=3, noisy=True, settings=settings)
        return run(p).state.extra["mixing"]["lam"]

    assert lam(None) == lam(0.9)
    assert lam(None) != lam(1.0)


def test_drfa_never_averages_fewer_distinct_silos_than_its_minimum() -> None:
    p = policy(
        "drfa", rounds=6, noisy=True,
        settings={"step": 5.0, "silos_per_round": 3, "min_contributors": 2},
    )  # fmt: skip
    history = run(p)
    for record in history.records:
        if "train" in record.phases:
            assert len(record.phases["train"]["answered"]) >= 2


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"algorithm": {"name": "term", "q": 2.0}}, "term does not read 'q'"),
        ({"algorithm": {"name": "fedavg", "step": 1.0}}, "fedavg does not read 'step'"),
        (
            {"algorithm": {"name": "drfa"}, "training": {"epochs": 1}},
            "drfa needs a fixed number of local steps",
        ),
        (
            {
                "algorithm": {"name": "afl"},
                "privacy": {"client_dp": {"clip": 1.0, "noise_multiplier": 1.0}},
            },
            "afl does not average clipped model updates",
        ),
        ({"algorithm": {"name": "aaggff", "transform": "cauchy"}}, "transform"),
        (
            {"algorithm": {"name": "drfa", "variant": "fedtorch"}, "training": {"steps": 1}},
            "needs tau >= 2 local steps",
        ),
        (
            {"algorithm": {"name": "drflm", "mixup_on": "embedding"}},
            "model 'linear' has no embedding",
        ),
        ({"algorithm": {"name": "drfa", "mixup_on": "embedding"}}, "read by drflm"),
        (
            {
                "algorithm": {"name": "approx_fedavg"},
                "privacy": {"dp_sgd": {"noise_multiplier": 1.0}},
            },
            "approx_fedavg weights each row's gradient by a softmax",
        ),
        ({"algorithm": {"name": "afl", "domains": "data"}}, "read by agnostic_fedavg"),
    ],
)
def test_settings_that_do_not_fit_the_algorithm_are_refused(change: dict, message: str) -> None:
    with pytest.raises(PolicyError, match=message):
        parse_policy({**policy("fedavg").model_dump(), **change})


def test_a_run_plots_the_coefficients_over_rounds(tmp_path) -> None:
    from fedsilo.ops.report import write_results

    p = policy("term", rounds=2)
    write_results(tmp_path / "out", {"term": simulate(p, load_consortium(p.data, seed=p.seed))})
    assert (tmp_path / "out" / "mixing_weights.png").stat().st_size > 0


def test_drflm_is_refused_under_dp_where_mixup_would_break_the_accounting() -> None:
    document = {
        **policy("drflm").model_dump(),
        "privacy": {"dp_sgd": {"noise_multiplier": 1.0}},
    }
    with pytest.raises(PolicyError, match="booked epsilon would be too low"):
        parse_policy(document)


@pytest.mark.parametrize("name", ["drfa", "drflm"])
def test_a_quorum_of_every_draw_from_lambda_is_refused_at_check_time(name: str) -> None:
    """Draws with replacement: a quorum of M distinct silos in M draws makes every mean
    uniform and, with lambda leaning to one silo, almost no draw qualifies."""
    quorum = {"participants": {"min_silos": SILOS}}
    with pytest.raises(PolicyError, match=f"min_silos: {name} draws 4 silo.*quorum of 4"):
        policy(name, **quorum)
    with pytest.raises(PolicyError, match="draws 3 silo.*quorum of 3 distinct silos out of 3"):
        policy(name, settings={"silos_per_round": 3}, participants={"min_silos": 3})
    policy(name, participants={"min_silos": SILOS - 1})  # 3 distinct of 4 draws: allowed
    policy(name, settings={"silos_per_round": 6}, **quorum)  # 4 distinct of 6 draws: allowed
    policy(name, settings={"variant": "fedtorch"}, **quorum)  # uniform draws, no replacement


def test_a_consortium_that_every_draw_must_cover_is_refused_once_its_silos_are_known() -> None:
    """A natural partition's silo count is known once its data is read (a deployment's roster
    when the run starts): `simulate` refuses it then with the same reason, before any round,
    and so does the engine of a deployment."""
    p = parse_policy(
        {
            "version": 1, "rounds": 2, "algorithm": {"name": "drfa"}, "model": {"name": "linear"},
            "training": {"steps": 2}, "participants": {"min_silos": 4}, "data": {"source": "heart"},
        }
    )  # fmt: skip
    with pytest.raises(PolicyError, match="min_silos: drfa draws 4 silo.*quorum of 4"):
        run(p)
    datasets = load_consortium(p.data, seed=p.seed)
    keys = ConsortiumKeys.generate(d.name for d in datasets)
    agents = {d.name: build_agent(p, d.name, d, torch.device("cpu"), keys) for d in datasets}
    transport = InProcessTransport({n: a.handle_bytes for n, a in agents.items()})
    engine = RoundEngine(make_strategy(p), transport, p, sorted(agents))
    with pytest.raises(RunAborted, match="min_silos: drfa draws 4 silo.*quorum of 4"):
        engine.run()
