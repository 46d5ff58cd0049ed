"""SCAFFOLD: two rounds on a tiny linear problem are the hand computation (corrected steps
g - c_i + c, option II's c_i+, x and c moved by the sample-weighted means, `server_lr`); each
silo keeps c_i in its local state, so a re-run round starts from the same c_i (a silo answers a
task once; a restarted one may run it again) and a run resumed after a coordinator stop (silo
state on disk) equals the uninterrupted run; under pairwise masking it is the run in the clear;
under DP-SGD the correction is added after clipping and noise; what it cannot run with is
refused with the reason."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from fedsilo.coordinator.engine import RoundEngine, RunHistory
from fedsilo.coordinator.state import StateStore
from fedsilo.coordinator.strategies import make_strategy
from fedsilo.coordinator.transport import InProcessTransport
from fedsilo.ops.sim_silos import ConsortiumKeys
from fedsilo.ops.simulate import simulate
from fedsilo.policies.loading import PolicyError, parse_policy
from fedsilo.policies.privacy import PrivacyConfig
from fedsilo.policies.schema import Policy
from fedsilo.policies.seeding import derive_seed
from fedsilo.silo.agent import SiloAgent
from fedsilo.silo.data import SiloDataset
from fedsilo.silo.scaffold import OWN_CONTROL
from fedsilo.silo.tasks.base import parameter_spec
from fedsilo.silo.tasks.scaffold import scaffold_train_releases
from fedsilo.silo.tasks.train import train_releases
from fedsilo.wire.messages import TaskMessage, TaskResult
from fedsilo.wire.tasks import TrainTask
from fedsilo.wire.tasks.tensor_names import CONTROL, CONTROL_DELTA, MODEL
from tests.silos import honest, run_handler

FEATURES = 2
STEPS, LR, SERVER_LR = 2, 0.1, 0.5


def silo_data(name: str, seed: int, rows: int) -> SiloDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows + 4, FEATURES, generator=g)
    w = torch.tensor([1.5, -2.0]) * (seed + 1)  # heterogeneous silos: drift to correct
    y = x @ w + 0.1 * torch.randn(rows + 4, generator=g)
    return SiloDataset(
        name, x[:rows], y[:rows], x[rows : rows + 2], y[rows : rows + 2], x[rows + 2 :],
        y[rows + 2 :], "regression", None, ("f0", "f1"), (FEATURES,),
    )  # fmt: skip


DATASETS = [silo_data("a", 0, 3), silo_data("b", 1, 5)]
KEYS = ConsortiumKeys.generate(d.name for d in DATASETS)


def policy(rounds: int = 2, **changes: object) -> Policy:
    document: dict = {
        "version": 1,
        "seed": 7,
        "rounds": rounds,
        "eval_every": rounds,
        "algorithm": {"name": "scaffold", "server_lr": SERVER_LR},
        "model": {"name": "linear"},
        # one batch holds every row: each step is the full gradient
        "training": {"steps": STEPS, "batch_size": 8, "optimizer": "sgd", "lr": LR},
    }
    for key, value in changes.items():
        document[key] = {**document.get(key, {}), **value} if isinstance(value, dict) else value
    return parse_policy(document)


def agents(p: Policy, state: Path | None = None) -> dict[str, SiloAgent]:
    """Each silo's agent under `p`, with the consortium's keys, keeping its state in
    `state`/<silo> (None: in memory)."""
    return {
        d.name: SiloAgent(
            d.name, d, p, keys=KEYS.of(d.name), state=None if state is None else state / d.name
        )
        for d in DATASETS
    }


def run(p: Policy, store: StateStore | None = None, state: Path | None = None) -> RunHistory:
    silos = agents(p, state)
    transport = InProcessTransport({n: a.handle_bytes for n, a in silos.items()})
    return RoundEngine(
        make_strategy(p), transport, p, sorted(silos), store=store, policy_digest="pinned"
    ).run()


def initial_model(p: Policy) -> torch.Tensor:
    a = agents(p)["a"]
    model = a.context.new_model(seed=derive_seed(p.seed, "model-init"))
    return parameter_spec(model).flatten(dict(model.named_parameters())).detach()


def full_gradient(flat: torch.Tensor, d: SiloDataset) -> torch.Tensor:
    """The gradient of the mean squared error of the linear model `flat` (weight, bias)."""
    w = flat.clone().requires_grad_()
    pred = d.x_train @ w[:FEATURES] + w[FEATURES]
    loss = ((pred - d.y_train) ** 2).mean()
    (grad,) = torch.autograd.grad(loss, w)
    return grad


def by_hand(x: torch.Tensor, rounds: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SCAFFOLD as the paper's option II, every silo every round, means weighted by rows."""
    c = torch.zeros_like(x)
    own = {d.name: torch.zeros_like(x) for d in DATASETS}
    n = sum(len(d.y_train) for d in DATASETS)
    for _ in range(rounds):
        dy, dc = torch.zeros_like(x), torch.zeros_like(x)
        for d in DATASETS:
            y = x.clone()
            for _ in range(STEPS):
                y = y - LR * (full_gradient(y, d) - own[d.name] + c)
            updated = own[d.name] - c + (x - y) / (STEPS * LR)
            dy += len(d.y_train) / n * (y - x)
            dc += len(d.y_train) / n * (updated - own[d.name])
            own[d.name] = updated
        x, c = x + SERVER_LR * dy, c + dc
    return x, c


def test_two_rounds_are_the_hand_computation() -> None:
    p = policy(rounds=2)
    history = run(p)
    x, c = by_hand(initial_model(p), rounds=2)
    assert torch.allclose(history.state.model, x, atol=1e-5)
    assert torch.allclose(history.state.tensors[CONTROL], c, atol=1e-4)
    assert not torch.equal(c, torch.zeros_like(c))  # the correction did act in round 2


def message(a: SiloAgent, round_no: int, control: torch.Tensor | None = None) -> TaskMessage:
    """Round `round_no`'s `scaffold_train` task, as the silo's contract asks for it, from a
    fresh model and the server's control variate `control` (zeros by default)."""
    model = a.context.new_model(seed=0)
    spec = parameter_spec(model)
    flat = spec.flatten(dict(model.named_parameters())).detach()
    tensors = {MODEL: flat, CONTROL: torch.zeros_like(flat) if control is None else control}
    return honest(a, "train", round_no, tensors, spec)


def answer(a: SiloAgent, task: TaskMessage) -> TaskResult:
    result = a.handle(task)
    assert result.ok, result.error
    return result


def test_the_silo_keeps_its_control_variate_and_a_rerun_round_starts_from_the_same() -> None:
    a = agents(policy())["a"]
    first = answer(a, message(a, 1))
    kept = a.context.state.latest(OWN_CONTROL, 2)
    assert kept is not None and torch.equal(kept[CONTROL], first.tensors[CONTROL_DELTA])
    assert set(first.tensors) == {MODEL, CONTROL_DELTA}  # c_i itself never leaves
    second = answer(a, message(a, 2))
    # The coordinator sends round 2 again: the silo answers a task once.
    refused = a.handle(message(a, 2))
    assert not refused.ok and "this silo answers each task once" in refused.error
    # A silo that runs round 2 again (one restarted after it kept round 2's c_i, before its
    # answer left) starts from the c_i the first attempt started from.
    rerun = message(a, 2)
    again = run_handler(a, rerun.config, rerun.tensors, rerun.spec, round_no=2)
    assert torch.equal(second.tensors[MODEL], again.tensors[MODEL])
    assert torch.equal(second.tensors[CONTROL_DELTA], again.tensors[CONTROL_DELTA])
    assert not torch.equal(second.tensors[MODEL], first.tensors[MODEL])  # c_i corrected it


def test_a_run_resumed_after_a_coordinator_stop_equals_the_uninterrupted_one(
    tmp_path: Path,
) -> None:
    p = policy(rounds=4)
    with StateStore(tmp_path / "state.db") as store:
        run(p.model_copy(update={"rounds": 2}), store, tmp_path / "silos")
    with StateStore(tmp_path / "state.db") as store:
        resumed = run(p, store, tmp_path / "silos")  # fresh agents, c_i from their disks
    with StateStore(tmp_path / "fresh.db") as store:
        uninterrupted = run(p, store, tmp_path / "fresh-silos")
    for name in (MODEL, CONTROL):
        assert torch.equal(resumed.state.tensors[name], uninterrupted.state.tensors[name])


def test_under_pairwise_masking_it_is_the_run_in_the_clear() -> None:
    plain = simulate(policy(rounds=2), DATASETS).history
    masked = simulate(policy(rounds=2, secure_aggregation="masking"), DATASETS).history
    assert [r.status for r in masked.records] == ["completed", "completed"]
    assert torch.allclose(plain.state.model, masked.state.model, atol=1e-4)
    assert torch.allclose(plain.state.tensors[CONTROL], masked.state.tensors[CONTROL], atol=1e-3)


def test_dp_sgd_adds_the_correction_after_clipping_and_noise() -> None:
    # DP-SGD without noise or clipping, which a policy refuses: set on the parsed policy
    unbounded = PrivacyConfig.model_validate(
        {"dp_sgd": {"noise_multiplier": 0.0, "max_grad_norm": 1e9, "poisson_sampling": False}}
    )
    control = torch.full((FEATURES + 1,), 0.3)
    private_agent = agents(policy().model_copy(update={"privacy": unbounded}))["a"]
    plain_agent = agents(policy())["a"]
    private = answer(private_agent, message(private_agent, 1, control))
    plain = answer(plain_agent, message(plain_agent, 1, control))
    assert torch.allclose(private.tensors[MODEL], plain.tensors[MODEL], atol=1e-5)
    task = message(private_agent, 2)
    inner = replace(task, config=TrainTask(local=task.config.local), tensors={})
    releases = scaffold_train_releases(task, private_agent.context)
    assert releases == train_releases(inner, private_agent.context)  # c_i+ - c_i costs nothing


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"training": {"optimizer": "adam"}}, "option II"),
        ({"training": {"momentum": 0.9}}, "momentum 0"),
        ({"algorithm": {"server_lr": 0}}, "server_lr"),
        ({"privacy": {"client_dp": {"noise_multiplier": 1.0, "clip": 1.0}}}, "client_dp"),
    ],
)
def test_what_scaffold_cannot_run_with_is_refused(changes: dict, match: str) -> None:
    with pytest.raises(PolicyError, match=match):
        policy(**changes)
