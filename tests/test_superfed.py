"""SuPerFed: with mixing never on and no proximity it is FedAvg bit for bit; for a fixed lambda
the gradient splits between the models as (1 - lambda) and lambda; the silo sends what FedAvg
sends and keeps its local model, which persists across rounds, restarts of the agent and re-runs
of a round; the regularisers are those of docs/algorithms/superfed.md; evaluation reports the
lambda curve and the lambda the validation split chooses; DP-SGD clips the two models as one
vector."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.func import functional_call

from fedsilo.coordinator.engine import RunHistory
from fedsilo.ops.simulate import simulate
from fedsilo.policies.loading import PolicyError, parse_policy
from fedsilo.policies.privacy import PrivacyConfig
from fedsilo.policies.schema import Policy
from fedsilo.silo.agent import SiloAgent
from fedsilo.silo.data import load_consortium
from fedsilo.silo.superfed import (
    LOCAL_MODEL,
    LambdaDraws,
    SuperFedRound,
    mixable_layers,
    mixed,
    orthogonality,
    proximity,
)
from fedsilo.silo.tasks.base import parameter_spec
from fedsilo.silo.tasks.superfed import local_model, superfed_train_releases
from fedsilo.silo.tasks.train import train_releases
from fedsilo.wire.messages import TaskMessage, TaskResult
from tests.silos import agent as built
from tests.silos import honest, run_handler

DATA = {"source": "sklearn:breast_cancer", "partition": {"kind": "iid", "silos": 3}}
MODEL = {"name": "mlp", "hidden": [8]}
TRAINING = {"epochs": 1, "batch_size": 16, "optimizer": "sgd", "lr": 0.05, "momentum": 0.9}
SETTINGS = {"mixing": "model", "prox_mu": 0.01, "prox_form": "layer_l2", "ortho_nu": 1.0}


def policy(
    name: str = "superfed",
    rounds: int = 4,
    *,
    eval_every: int | None = None,
    training: dict | None = None,
    **algorithm: object,
) -> Policy:
    """`rounds` rounds of `name` (SuPerFed) with `algorithm`'s settings, TRAINING but where
    `training` says otherwise, evaluated after the last round (every `eval_every`-th)."""
    return parse_policy(
        {
            "version": 1,
            "seed": 3,
            "rounds": rounds,
            "eval_every": eval_every or rounds,
            "algorithm": {"name": name, **algorithm},
            "model": MODEL,
            "training": {**TRAINING, **(training or {})},
            "data": DATA,
        }
    )


def run(p: Policy) -> RunHistory:
    return simulate(p, load_consortium(p.data, seed=p.seed)).history


def mixing(**changes: Any) -> Policy:
    """SuPerFed with SETTINGS, mixing from round 1, evaluated after every round; `changes`:
    other algorithm settings, or `training`."""
    return policy(eval_every=1, **{**SETTINGS, "start_fraction": 0.0, **changes})


def agent(
    state: Path | None = None, privacy: dict | None = None, p: Policy | None = None
) -> SiloAgent:
    """The first silo's agent under `p` (`mixing()` by default), in deployment "d", keeping
    what outlives it in `state`; `privacy` replaces the policy's section as written (a test
    may train without noise, which a policy refuses)."""
    p = p or mixing()
    if privacy is not None:
        p = p.model_copy(update={"privacy": PrivacyConfig.model_validate(privacy)})
    data = load_consortium(p.data, seed=0)[0]
    return built(data, p, state=state, deployment="d")


def message(a: SiloAgent, phase: str, round_no: int) -> TaskMessage:
    """The task the silo's contract asks for at (`round_no`, `phase`) (`train`: its policy's
    `superfed_train` or FedAvg's `train`; `evaluate`: `superfed_evaluate`), carrying a fresh
    model."""
    model = a.context.new_model(seed=0)
    spec = parameter_spec(model)
    flat = {"model": spec.flatten(dict(model.named_parameters()))}
    return honest(a, phase, round_no, flat, spec)


def answer(a: SiloAgent, phase: str, round_no: int) -> TaskResult:
    result = a.handle(message(a, phase, round_no))
    assert result.ok, result.error
    return result


def test_without_mixing_and_proximity_superfed_is_fedavg_bit_for_bit() -> None:
    superfed = run(policy(start_fraction=1.0, prox_mu=0.0))
    fedavg = run(policy("fedavg"))
    assert torch.equal(superfed.state.model, fedavg.state.model)


def test_mixing_starts_after_floor_l_t_rounds() -> None:
    config = policy(rounds=10, start_fraction=0.29).algorithm
    assert config.mixing_from(10) == 3
    assert policy(start_fraction=0.0).algorithm.mixing_from(4) == 1
    assert policy(start_fraction=1.0).algorithm.mixing_from(4) == 5  # never


def test_for_a_fixed_lambda_the_gradient_splits_between_the_models() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    layers = mixable_layers(model)
    federated = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
    local = {n: torch.randn_like(p).requires_grad_() for n, p in federated.items()}
    x, y = torch.randn(5, 4), torch.tensor([0, 1, 1, 0, 1])
    lam = 0.3
    weights = mixed(federated, local, dict.fromkeys(layers, lam), layers)
    loss = torch.nn.functional.cross_entropy(functional_call(model, weights, x), y)
    at_mix = torch.autograd.grad(loss, list(weights.values()), retain_graph=True)
    to_federated = torch.autograd.grad(loss, list(federated.values()), retain_graph=True)
    to_local = torch.autograd.grad(loss, list(local.values()))
    for g, gf, gl in zip(at_mix, to_federated, to_local, strict=True):
        assert torch.allclose(gf, (1 - lam) * g, atol=1e-7)
        assert torch.allclose(gl, lam * g, atol=1e-7)


def test_model_mixing_shares_one_lambda_and_layer_mixing_draws_one_per_layer() -> None:
    layers = ["0", "2", "4"]
    on = SuperFedRound("model", True, 0.0, "layer_l2", 0.0)
    shared = LambdaDraws(on, layers, seed=1).draw()
    assert len(set(shared.values())) == 1 and 0 < shared["0"] < 1
    per_layer = LambdaDraws(SuperFedRound("layer", True, 0.0, "layer_l2", 0.0), layers, 1).draw()
    assert len(set(per_layer.values())) == 3
    off = SuperFedRound("layer", False, 0.0, "layer_l2", 0.0)
    assert LambdaDraws(off, layers, 1).draw() == dict.fromkeys(layers, 0.0)


def test_the_regularisers_are_the_specs() -> None:
    federated = {"a": torch.tensor([3.0, 4.0], requires_grad=True), "b": torch.tensor([1.0])}
    anchor = {"a": torch.zeros(2), "b": torch.zeros(1)}
    assert proximity(federated, anchor, "layer_l2").item() == pytest.approx(5.0 + 1.0)
    assert proximity(federated, anchor, "squared").item() == pytest.approx(25.0 + 1.0)
    at_anchor = {"a": anchor["a"].clone().requires_grad_(), "b": anchor["b"]}
    (gradient,) = torch.autograd.grad(proximity(at_anchor, anchor, "layer_l2"), [at_anchor["a"]])
    assert torch.equal(gradient, torch.zeros(2))  # a zero subgradient where every round starts
    local = {"a": torch.tensor([4.0, -3.0]), "b": torch.tensor([0.0])}
    assert orthogonality(federated, local).item() == pytest.approx(0.0, abs=1e-12)
    assert orthogonality(federated, federated).item() == pytest.approx(1.0)


def test_the_silo_sends_what_fedavg_sends_and_keeps_its_local_model() -> None:
    a = agent()
    superfed = answer(a, "train", 2)
    plain = answer(agent(p=policy("fedavg", eval_every=1)), "train", 2)
    assert superfed.kind == "superfed_train" and plain.kind == "train"
    assert superfed.tensors.keys() == plain.tensors.keys() == {"model"}
    assert superfed.spec == plain.spec and superfed.num_samples == plain.num_samples
    tensor_bytes = sum(t.numel() * t.element_size() for t in superfed.tensors.values())
    assert tensor_bytes == sum(t.numel() * t.element_size() for t in plain.tensors.values())
    assert len(superfed.encode()) - len(plain.encode()) < 256  # a few metrics more, no tensor
    kept = a.context.state.latest(LOCAL_MODEL, 3)
    assert (
        kept is not None and kept.keys() == dict(a.context.new_model(0).named_parameters()).keys()
    )


def test_the_local_model_carries_over_rounds_and_a_rerun_round_starts_where_the_first_did() -> None:
    a = agent()
    first = answer(a, "train", 1)
    after_one = a.context.state.latest(LOCAL_MODEL, 2)
    second = answer(a, "train", 2)
    after_two = a.context.state.latest(LOCAL_MODEL, 3)
    assert not torch.equal(after_one["1.weight"], after_two["1.weight"])
    # The coordinator sends round 2 again: the silo answers a task once.
    refused = a.handle(message(a, "train", 2))
    assert not refused.ok and "this silo answers each task once" in refused.error
    # A silo that runs round 2 again (one restarted after it kept round 2's local model, before
    # its answer left) starts from the local model the first attempt started from.
    rerun = message(a, "train", 2)
    again = run_handler(a, rerun.config, rerun.tensors, rerun.spec, round_no=2)
    assert torch.equal(again.tensors["model"], second.tensors["model"])
    assert torch.equal(a.context.state.latest(LOCAL_MODEL, 3)["1.weight"], after_two["1.weight"])
    fresh = answer(agent(), "train", 2)  # no local model from round 1
    assert not torch.equal(fresh.tensors["model"], second.tensors["model"])
    assert not torch.equal(first.tensors["model"], second.tensors["model"])


def test_the_local_model_outlives_the_agent_on_disk(tmp_path: Path) -> None:
    answer(agent(tmp_path), "train", 1)
    stored = sorted(p.name for p in (tmp_path / "d").iterdir())
    assert stored == ["answers", f"{LOCAL_MODEL}.r000001.safetensors"]  # and what it answered
    restarted = answer(agent(tmp_path), "evaluate", 1)
    in_memory = agent()
    answer(in_memory, "train", 1)
    assert restarted.metrics == answer(in_memory, "evaluate", 1).metrics
    assert restarted.metrics["local_trained"] == 1.0


def test_evaluation_reports_the_curve_and_the_lambda_the_selection_split_chooses() -> None:
    a = agent()
    before = answer(a, "evaluate", 1)
    assert before.metrics["local_trained"] == 0.0 and before.metrics["lambda_star"] == 0.0
    for round_no in (1, 2, 3):
        answer(a, "train", round_no)
    metrics = answer(a, "evaluate", 3).metrics
    grid = [f"{lam:.2f}" for lam in torch.linspace(0, 1, 11).tolist()]
    chosen = max(
        range(11),
        key=lambda i: (
            metrics[f"selection_accuracy@{grid[i]}"],
            -metrics[f"selection_loss@{grid[i]}"],
            -i,
        ),
    )
    assert metrics["lambda_star"] == pytest.approx(float(grid[chosen]))
    assert metrics["accuracy"] == metrics[f"accuracy@{grid[chosen]}"]
    assert metrics["global_accuracy"] == metrics["accuracy@0.00"]
    assert metrics["local_accuracy"] == metrics["accuracy@1.00"]
    assert metrics["oracle_accuracy"] == max(metrics[f"accuracy@{g}"] for g in grid)
    small_validation = len(a.context.data.y_val) < 20
    assert metrics["selection_on_validation"] == float(not small_validation)


def test_orthogonality_keeps_the_endpoints_apart() -> None:
    def cosine(nu: float) -> float:
        a = agent(p=mixing(ortho_nu=nu, training={"epochs": 2}))
        for round_no in (1, 2, 3):
            result = answer(a, "train", round_no)
        return result.metrics["orthogonality"]

    free, pushed = cosine(0.0), cosine(5.0)
    assert pushed < free / 10


def test_dp_sgd_without_noise_or_clipping_trains_like_the_plain_loop() -> None:
    unbounded = {
        "dp_sgd": {"noise_multiplier": 0.0, "max_grad_norm": 1e9, "poisson_sampling": False}
    }
    private = answer(agent(privacy=unbounded), "train", 1)
    plain = answer(agent(), "train", 1)
    assert torch.allclose(private.tensors["model"], plain.tensors["model"], atol=1e-5)


def test_dp_sgd_clips_each_rows_gradient_over_both_models_together() -> None:
    clip = 1e-3
    tight = {"dp_sgd": {"noise_multiplier": 0.0, "max_grad_norm": clip, "poisson_sampling": False}}
    step = {"steps": 1, "epochs": None, "batch_size": 1, "lr": 1.0, "momentum": 0.0}
    quiet = {"prox_mu": 0.0, "ortho_nu": 0.0}
    a = agent(privacy=tight, p=mixing(training=step, **quiet))
    task = message(a, "train", 1)
    result = a.handle(task)
    assert result.ok, result.error
    received = task.tensors["model"]
    start, _ = local_model(a.context, task, task.config.local_seed, 1)
    after = a.context.state.latest(LOCAL_MODEL, 2)
    local_move = torch.cat([(after[n] - start[n]).flatten() for n in start])
    federated_move = result.tensors["model"] - received
    total = math.hypot(float(federated_move.norm()), float(local_move.norm()))
    assert total == pytest.approx(clip, rel=1e-3)  # one row, clipped: the joint norm is C


def test_dp_sgd_books_superfed_as_the_train_task() -> None:
    a = agent(privacy={"dp_sgd": {"noise_multiplier": 1.0}})
    task = message(a, "train", 1)
    assert task.kind == "superfed_train" and task.config.mixing_on
    assert superfed_train_releases(task, a.context) == train_releases(task, a.context)
    assert a.handle(task).ok


def test_superfed_runs_under_secure_aggregation_like_in_the_clear() -> None:
    plain = run(policy(rounds=2, start_fraction=0.0))
    masked_policy = policy(rounds=2, start_fraction=0.0).model_copy(
        update={"secure_aggregation": parse_policy(
            {"version": 1, "secure_aggregation": "masking"}).secure_aggregation}
    )  # fmt: skip
    masked = run(masked_policy)
    assert torch.allclose(plain.state.model, masked.state.model, atol=1e-5)
    for silo, metrics in plain.final.evaluation.items():
        assert masked.final.evaluation[silo]["lambda_star"] == metrics["lambda_star"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"mixing": "both"}, "mixing"),
        ({"start_fraction": 1.5}, "start_fraction"),
    ],
)
def test_bad_superfed_settings_are_refused(change: dict, message: str) -> None:
    with pytest.raises(PolicyError, match=message):
        policy(**change)


def test_superfed_with_client_level_dp_is_refused() -> None:
    document = {
        **policy().model_dump(),
        "privacy": {"client_dp": {"clip": 1.0, "noise_multiplier": 1.0}},
    }
    with pytest.raises(PolicyError, match="superfed does not average clipped model updates"):
        parse_policy(document)
