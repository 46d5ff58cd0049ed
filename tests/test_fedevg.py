"""FedEvg: the mixture gradient is one silo's clipped gradient when one silo answers and the
weighted mean when the signs agree; the server's step size follows the cosine-beta curve of the
spec; a round carries the synthetic set down and energy signals up, never a model; the silo's
signals are clipped and weighted by exp(-sign E); runs repeat bit for bit; secure aggregation
gives the same points; DP-SGD trains the energy model and books it as a training; the final
set and its grids are written for the operator."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from fedsilo.coordinator.engine import RoundEngine, RunHistory
from fedsilo.coordinator.strategies import make_strategy
from fedsilo.coordinator.synthetic import langevin_step, mixture_gradient, step_sizes
from fedsilo.coordinator.transport import InProcessTransport
from fedsilo.models.zoo import build_model
from fedsilo.ops.report import write_results
from fedsilo.ops.sim_silos import ConsortiumKeys, build_agent
from fedsilo.ops.simulate import simulate
from fedsilo.policies.loading import PolicyError, parse_policy
from fedsilo.policies.schema import Policy
from fedsilo.silo.agent import SiloAgent
from fedsilo.silo.data import load_consortium
from fedsilo.silo.energy import EnergySettings, EnergyTraining
from fedsilo.silo.tasks.base import parameter_spec
from fedsilo.silo.tasks.energy import energy_signals_releases
from fedsilo.silo.tasks.train import train_releases
from fedsilo.wire.messages import TaskMessage, TaskResult, schema_metrics
from fedsilo.wire.tasks import EnergySignals, InitTask, LocalTraining
from fedsilo.wire.tasks.tensor_names import SYNTHETIC, SYNTHETIC_LABELS, WEIGHT, WEIGHTED_GRADIENT
from tests.silos import agent as built
from tests.silos import honest

SPC = 2  # synthetic points per class: 20 points of 1 x 8 x 8
CNN = {"name": "cnn", "channels": [4], "hidden": 0, "activation": "silu", "norm": "group"}


def policy(rounds: int = 3, **extra: object) -> Policy:
    algorithm = {"name": "fedevg", "samples_per_class": SPC, "classifier_epochs": 5}
    algorithm |= extra.pop("algorithm", {})  # type: ignore[arg-type]
    return parse_policy(
        {
            "version": 1,
            "seed": 4,
            "rounds": rounds,
            "eval_every": rounds,
            "algorithm": algorithm,
            "model": CNN,
            "training": {"epochs": 1, "batch_size": 32, "optimizer": "adam", "lr": 1e-3},
            "data": {
                "source": "sklearn:digits",
                "scaling": "none",
                "partition": {"kind": "dirichlet", "silos": 3, "alpha": 1.0},
            },
            **extra,
        }
    )


def run(p: Policy) -> RunHistory:
    return simulate(p, load_consortium(p.data, seed=p.seed)).history


def scripted(
    signals: dict[str, tuple[float, float, int]],
) -> tuple[dict[str, Callable[[bytes], bytes]], list[TaskMessage]]:
    """Silos answering `energy_signals` with a constant gradient g and sign e at every point
    (and `n` samples), `schema` with digits' schema, `init` with a tiny model; and the tasks
    they received."""
    received: list[TaskMessage] = []

    def silo(name: str, gradient: float, sign: float, n: int) -> Callable[[bytes], bytes]:
        def answer(payload: bytes) -> bytes:
            task = TaskMessage.decode(payload)
            received.append(task)
            if task.kind == "schema":
                metrics = schema_metrics((1, 8, 8), 10)
                return TaskResult(task.task_id, name, task.kind, metrics=metrics).encode()
            if task.kind == "init":
                assert isinstance(task.config, InitTask)
                model = build_model(policy().model, (1, 8, 8), 10, task.config.seed)
                spec = parameter_spec(model)
                tensors = {"model": spec.flatten(dict(model.named_parameters()))}
                return TaskResult(
                    task.task_id, name, task.kind, tensors=tensors, spec=spec
                ).encode()
            if task.kind == "evaluate":
                metrics = {"accuracy": 0.5, "loss": 1.0}
                return TaskResult(
                    task.task_id, name, task.kind, num_samples=n, metrics=metrics
                ).encode()
            x = task.tensors[SYNTHETIC]
            s = math.exp(-sign)
            tensors = {
                WEIGHTED_GRADIENT: torch.full_like(x, s * gradient),
                WEIGHT: torch.full((x.shape[0],), s),
            }
            return TaskResult(
                task.task_id, name, task.kind, num_samples=n, tensors=tensors
            ).encode()

        return answer

    endpoints = {name: silo(name, *values) for name, values in signals.items()}
    return endpoints, received


def one_round(signals: dict[str, tuple[float, float, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The synthetic points before and after one round with scripted silos."""
    p = policy(rounds=2, algorithm={"classifier_epochs": 1})
    endpoints, _ = scripted(signals)
    engine = RoundEngine(make_strategy(p), InProcessTransport(endpoints), p, sorted(endpoints))
    history = engine.run()
    before = engine_setup_points(p)
    assert history.records[0].status == "completed"
    return before, history.state.tensors[SYNTHETIC]


def engine_setup_points(p: Policy) -> torch.Tensor:
    from fedsilo.coordinator.synthetic import initial_synthetic_set
    from fedsilo.policies.seeding import derive_seed

    generator = torch.Generator().manual_seed(derive_seed(p.seed, "synthetic-init"))
    return initial_synthetic_set(SPC, 10, (1, 8, 8), generator)[0]


def replay(p: Policy, x: torch.Tensor, gradients: list[float]) -> torch.Tensor:
    """The points after the policy's rounds of Langevin steps with these constant gradients."""
    from fedsilo.policies.seeding import derive_seed

    steps = step_sizes(p.rounds, 10.0, 1.0)
    for round_no, g in enumerate(gradients, start=1):
        seed = derive_seed(p.seed, "round", round_no, "langevin")
        x = langevin_step(x, torch.full_like(x, g), float(steps[round_no - 1]), 1e-4,
                          torch.Generator().manual_seed(seed))  # fmt: skip
    return x


def test_with_one_silo_the_mixture_gradient_is_that_silos_gradient() -> None:
    g, s = torch.randn(5, 1, 2, 2), torch.tensor([math.e, 1.0, 1 / math.e, 1.0, math.e])
    assert torch.allclose(mixture_gradient(s.reshape(-1, 1, 1, 1) * g, s), g)
    before, after = one_round({"a": (0.25, 1.0, 30)})
    assert torch.allclose(after, replay(policy(rounds=2), before, [0.25, 0.25]), atol=1e-6)


def test_with_equal_signs_the_mixture_gradient_is_the_sample_weighted_mean() -> None:
    before, after = one_round({"a": (0.3, -1.0, 10), "b": (-0.1, -1.0, 30)})
    mean = (10 * 0.3 + 30 * -0.1) / 40
    assert torch.allclose(after, replay(policy(rounds=2), before, [mean, mean]), atol=1e-6)


def test_signs_weigh_each_silo_by_exp_minus_sign() -> None:
    before, after = one_round({"a": (0.3, 1.0, 10), "b": (-0.1, -1.0, 10)})
    low, high = math.exp(-1.0), math.exp(1.0)
    mixed = (low * 0.3 + high * -0.1) / (low + high)
    assert torch.allclose(after, replay(policy(rounds=2), before, [mixed, mixed]), atol=1e-6)


def test_the_server_step_follows_the_cosine_beta_curve() -> None:
    eta = step_sizes(500, 10.0, 1.0)
    expected = {1: 10.00, 250: 9.94, 450: 9.65, 490: 8.44, 499: 3.25, 500: 1.00}
    assert {t: round(float(eta[t - 1]), 2) for t in expected} == expected
    assert np.all(np.diff(eta) <= 1e-12)  # never grows


def test_a_round_carries_the_synthetic_set_down_and_signals_up_never_a_model() -> None:
    p = policy(rounds=1)
    datasets = load_consortium(p.data, seed=p.seed)
    keys = ConsortiumKeys.generate(d.name for d in datasets)
    agents = {d.name: build_agent(p, d.name, d, torch.device("cpu"), keys) for d in datasets}
    down: list[TaskMessage] = []
    up: list[TaskResult] = []

    def endpoint(agent: SiloAgent) -> Callable[[bytes], bytes]:
        def answer(payload: bytes) -> bytes:
            task = TaskMessage.decode(payload)
            reply = agent.handle_bytes(payload)
            if task.kind == "energy_signals":
                down.append(task)
                up.append(TaskResult.decode(reply))
            return reply

        return answer

    transport = InProcessTransport({n: endpoint(a) for n, a in agents.items()})
    RoundEngine(make_strategy(p), transport, p, sorted(agents)).run()
    n, d = 10 * SPC, 64
    for task, result in zip(down, up, strict=True):
        assert task.spec is None and set(task.tensors) == {SYNTHETIC, SYNTHETIC_LABELS}
        assert task.tensors[SYNTHETIC].numel() == n * d
        assert result.spec is None and set(result.tensors) == {WEIGHTED_GRADIENT, WEIGHT}
        assert result.tensors[WEIGHTED_GRADIENT].shape == (n, 1, 8, 8)
        assert result.tensors[WEIGHTED_GRADIENT].dtype == torch.float32
        assert result.tensors[WEIGHT].shape == (n,) and result.num_samples > 0


ENERGY_TRAINING = LocalTraining(epochs=1, batch_size=32, optimizer="adam", lr=1e-3, seed=3)


def energy_task(agent: SiloAgent, round_no: int = 1) -> TaskResult:
    """The silo's answer to round `round_no`'s `energy_signals` task, as its contract asks for
    it (the policy's settings: `digits_agent`), on a fixed synthetic set."""
    generator = torch.Generator().manual_seed(0)
    x = torch.rand(10 * SPC, 1, 8, 8, generator=generator)
    labels = torch.arange(10).repeat_interleave(SPC)
    message = honest(agent, "energy", round_no, {SYNTHETIC: x, SYNTHETIC_LABELS: labels})
    assert isinstance(message.config, EnergySignals)
    result = agent.handle(message)
    assert result.ok, result.error
    return result


def digits_agent(privacy: dict | None = None, **algorithm: object) -> SiloAgent:
    """The first digits silo under `policy()` with signals clipped at 0.05 (one Langevin step
    of 1.0 with noise 0.01, a spectrally normalised joint energy, a fresh model per round) but
    where `algorithm` says otherwise, and `privacy`."""
    settings = {"algorithm": {"gradient_clip": 0.05, **algorithm}}
    p = policy(**settings, **({"privacy": privacy} if privacy is not None else {}))
    data = load_consortium(p.data, seed=0)[0]
    return built(data, p)


def test_the_silo_sends_clipped_gradients_weighted_by_exp_minus_sign() -> None:
    result = energy_task(digits_agent())
    weights = result.tensors[WEIGHT]
    allowed = torch.tensor([math.exp(-1.0), 1.0, math.exp(1.0)])
    assert torch.isclose(weights[:, None], allowed[None, :]).any(dim=1).all()
    gradient = result.tensors[WEIGHTED_GRADIENT] / weights.reshape(-1, 1, 1, 1)
    assert float(gradient.abs().max()) <= 0.05 + 1e-6
    assert float(gradient.abs().max()) > 0


def test_the_signals_are_the_energys_clipped_input_gradient_and_exp_minus_its_sign() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 3))
    x0, labels = torch.rand(6, 1, 2, 2), torch.tensor([0, 1, 2, 0, 1, 2])
    settings = EnergySettings("joint", 0, 0.0, 0.0, clip=0.2, synthetic_ce_weight=0.0)
    training = EnergyTraining(model, (x0, labels), (x0, labels), settings, seed=0)
    weighted, weights = training.signals()
    joint = -model(x0).gather(1, labels[:, None]).squeeze(1)
    assert torch.allclose(weights, torch.exp(-joint.sign()))
    by_hand = model[1].weight[labels].reshape(6, 1, 2, 2).neg().clamp(-0.2, 0.2)  # dE/dx
    assert torch.allclose(weighted, weights.reshape(-1, 1, 1, 1) * by_hand)


def test_a_fresh_model_per_round_repeats_and_a_persisted_one_carries_over() -> None:
    a, b = energy_task(digits_agent()), energy_task(digits_agent())
    assert torch.equal(a.tensors[WEIGHTED_GRADIENT], b.tensors[WEIGHTED_GRADIENT])
    keeper = digits_agent(persist_local_model=True)
    energy_task(keeper, 1)
    carried = energy_task(keeper, 2)
    fresh = energy_task(digits_agent(persist_local_model=True), 2)
    assert not torch.equal(carried.tensors[WEIGHTED_GRADIENT], fresh.tensors[WEIGHTED_GRADIENT])


def test_under_dp_sgd_the_energy_model_is_trained_privately_and_booked_as_a_training() -> None:
    agent = digits_agent({"dp_sgd": {"noise_multiplier": 1.0}}, spectral_norm=False)
    result = energy_task(agent)
    assert result.metrics["dp_noise_multiplier"] == 1.0
    plain = energy_task(digits_agent(spectral_norm=False))
    assert not torch.equal(result.tensors[WEIGHTED_GRADIENT], plain.tensors[WEIGHTED_GRADIENT])
    task = EnergySignals(
        local=ENERGY_TRAINING, sgld_steps=1, sgld_step=1.0, sgld_noise=0.01, gradient_clip=0.05,
        synthetic_ce_weight=0.1, model_seed=8,
    )  # fmt: skip
    message = TaskMessage("t", 1, "e", agent.name, task)
    assert energy_signals_releases(message, agent.context) == train_releases(message, agent.context)


def test_runs_repeat_bit_for_bit_and_the_points_move() -> None:
    first, second = run(policy()), run(policy())
    assert torch.equal(first.state.tensors[SYNTHETIC], second.state.tensors[SYNTHETIC])
    assert torch.equal(first.state.model, second.state.model)
    x = first.state.tensors[SYNTHETIC]
    assert float(x.min()) >= 0.0 and float(x.max()) <= 1.0
    assert not torch.equal(x, engine_setup_points(policy()).clamp(0, 1))
    evaluation = first.final.evaluation
    assert evaluation and all("accuracy" in m for m in evaluation.values())


@pytest.mark.parametrize("method", ["masking", "ckks"])
def test_secure_aggregation_moves_the_points_as_in_the_clear(method: str) -> None:
    plain = run(policy(rounds=2))
    secure = run(policy(rounds=2, secure_aggregation=method))
    assert [r.status for r in secure.records] == ["completed"] * 2
    assert torch.allclose(
        plain.state.tensors[SYNTHETIC], secure.state.tensors[SYNTHETIC], atol=1e-4
    )


def test_the_operator_gets_the_synthetic_set_and_its_grids(tmp_path: Path) -> None:
    p = policy(rounds=4, algorithm={"image_every": 2})
    result = simulate(p, load_consortium(p.data, seed=p.seed))
    write_results(tmp_path / "out", {"fedevg": result})
    out = tmp_path / "out"
    tensors = load_file(out / "synthetic.safetensors")
    assert torch.equal(tensors["x"], result.history.state.tensors[SYNTHETIC])
    assert tensors["y"].tolist() == torch.arange(10).repeat_interleave(SPC).tolist()
    with np.load(out / "synthetic.npz", allow_pickle=False) as arrays:
        assert np.array_equal(arrays["x"], tensors["x"].numpy())
    grids = sorted(p.name for p in (out / "synthetic").iterdir())
    assert grids == ["round-0000.png", "round-0002.png", "round-0004.png"]
    assert torch.equal(result.snapshots[0][0], engine_setup_points(p))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"data": {"source": "sklearn:digits"}}, "scaling: fedevg's synthetic points live in"),
        (
            {"privacy": {"dp_sgd": {"noise_multiplier": 1.0}}},
            "set spectral_norm: false under DP",
        ),
    ],
)
def test_settings_fedevg_cannot_run_with_are_refused(change: dict, message: str) -> None:
    with pytest.raises(PolicyError, match=message):
        parse_policy({**policy().model_dump(), **change})
