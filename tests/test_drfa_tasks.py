"""The silo's side of DRFA and DRFLM: a train task returns the checkpoint after t' local steps
(with and without DP-SGD; t' = 0 is the model received) and refuses a t' outside the run; the
R-FedTorch variant's update scale stretches the update and nothing else; local mixup mixes
inputs and targets with Beta(alpha, alpha) ratios that repeat for a seed, or the embedding the
last layer reads; the mixed loss probe equals a hand computation; and DRFLM runs end to end.
Handlers run with any config, as the agent runs them once a task passed its contract (`task`);
a DRFA silo's contract takes the checkpoint step from its policy and refuses any other."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fedsilo.policies.loading import PolicyError, parse_policy
from fedsilo.silo.agent import SiloAgent
from fedsilo.silo.data import load_consortium
from fedsilo.silo.mixup import MixupDraws, mixed_inputs, mixed_losses, mixed_per_sample_loss
from fedsilo.silo.tasks.base import parameter_spec
from fedsilo.wire.messages import TaskMessage, TaskResult
from fedsilo.wire.tasks import LocalTraining, LossProbe, TaskConfig, TrainTask
from tests.silos import agent as built
from tests.silos import honest, policy_with, run_handler

DATA = parse_policy(
    {
        "version": 1,
        "data": {"source": "sklearn:breast_cancer", "partition": {"kind": "iid", "silos": 2}},
    }
).data


LINEAR = {"name": "linear"}
MLP = {"name": "mlp", "hidden": [8]}
CLIENT_DP = {"client_dp": {"clip": 1.0, "noise_multiplier": 1.0}}


def agent(privacy: dict | None = None, model: dict | None = None, **sections: Any) -> SiloAgent:
    """Silo "silo-0" of two breast-cancer silos, under a policy of `model` (linear by default),
    `privacy` and `sections`."""
    (data, _) = load_consortium(DATA, seed=0)
    if privacy is not None:
        sections["privacy"] = privacy
    return built(data, policy_with(data=DATA, model=model or LINEAR, **sections))


LOCAL = {"steps": 5, "batch_size": 16, "optimizer": "sgd", "lr": 0.1, "seed": 3}


def message(a: SiloAgent, kind: str, **config: Any) -> TaskMessage:
    """A `train` task (local training as in LOCAL but where `config` says otherwise) or a
    `loss` probe, from a fresh model (its id and position beside the point: `task` runs its
    handler alone)."""
    model = a.context.new_model(seed=0)
    spec = parameter_spec(model)
    if kind == "train":
        local = {k: config.pop(k) for k in list(config) if k in LocalTraining.json_keys()}
        typed: TaskConfig = TrainTask(local=LocalTraining(**LOCAL | local), **config)
    else:
        typed = LossProbe(**config)
    return TaskMessage(
        "t", 1, "train", "silo-0", typed,
        {"model": spec.flatten(dict(model.named_parameters()))}, spec,
    )  # fmt: skip


def task(a: SiloAgent, kind: str, **config: object) -> TaskResult:
    """What the task's handler computes (`run_handler`), checked to have succeeded."""
    result = handled(a, message(a, kind, **config))
    assert result.ok, result.error
    return result


def handled(a: SiloAgent, task: TaskMessage) -> TaskResult:
    return run_handler(a, task.config, task.tensors, task.spec, phase=task.phase)


def model_of(a: SiloAgent) -> tuple[dict[str, torch.Tensor], Any]:
    """The tensors and spec of `message`'s fresh model."""
    sent = message(a, "train")
    return sent.tensors, sent.spec


def test_the_checkpoint_is_the_model_after_t_steps() -> None:
    full = task(agent(), "train", checkpoint_step=5)
    assert torch.equal(full.tensors["checkpoint"], full.tensors["model"])
    early = task(agent(), "train", checkpoint_step=2)
    two_steps = task(agent(), "train", steps=2)
    assert torch.equal(early.tensors["checkpoint"], two_steps.tensors["model"])
    assert not torch.equal(early.tensors["checkpoint"], early.tensors["model"])


def test_checkpoint_step_zero_is_the_model_received() -> None:
    a = agent()
    result = task(a, "train", checkpoint_step=0)
    assert torch.equal(result.tensors["checkpoint"], message(a, "train").tensors["model"])


def test_the_update_scale_stretches_the_update_and_nothing_else() -> None:
    a = agent()
    received = message(a, "train").tensors["model"]
    plain = task(a, "train", checkpoint_step=2)
    scaled = task(agent(), "train", checkpoint_step=2, update_scale=2.5)
    expected = received + 2.5 * (plain.tensors["model"] - received)
    assert torch.allclose(scaled.tensors["model"], expected, atol=1e-6)
    assert torch.equal(scaled.tensors["checkpoint"], plain.tensors["checkpoint"])
    assert scaled.num_samples == plain.num_samples


def test_an_update_scale_with_client_dp_is_refused() -> None:
    a = agent(CLIENT_DP)
    with pytest.raises(ValueError, match="update_scale cannot be combined with privacy.client_dp"):
        handled(a, message(a, "train", update_scale=2.0))
    # no policy asks for both: DRFA (whose fedtorch variant scales updates) under client-level
    # DP is refused when the policy is read, and no other algorithm lets a task set a scale
    fedtorch = {"name": "drfa", "variant": "fedtorch"}
    with pytest.raises(PolicyError, match="drfa does not average clipped model updates"):
        policy_with(algorithm=fedtorch, training={"epochs": None, "steps": 5}, privacy=CLIENT_DP)
    refused = a.handle(honest(a, "train", 1, *model_of(a), update_scale=2.0))
    assert not refused.ok and "config key 'update_scale' is set" in refused.error


def test_the_checkpoint_is_taken_under_dp_sgd_too() -> None:
    result = task(agent({"dp_sgd": {"noise_multiplier": 1.0}}), "train", checkpoint_step=1)
    assert not torch.equal(result.tensors["checkpoint"], result.tensors["model"])


def test_a_checkpoint_outside_the_run_is_refused() -> None:
    a = agent()
    with pytest.raises(ValueError, match="outside the run's 0..3 local steps"):
        handled(a, message(a, "train", steps=3, checkpoint_step=4))
    # before that, a DRFA silo of 3 local steps takes no checkpoint step but its policy's
    drfa = agent(algorithm={"name": "drfa"}, training={"epochs": None, "steps": 3})
    drawn = drfa.context.algorithm.checkpoint_step(drfa.context.policy, 1)
    assert 1 <= drawn <= 3
    refused = drfa.handle(honest(drfa, "train", 1, *model_of(drfa), checkpoint_step=4))
    assert not refused.ok
    assert f"config key 'checkpoint_step' is 4; this silo's policy says {drawn}" in refused.error


def test_mixup_mixes_inputs_and_targets_linearly() -> None:
    x, partner = torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, 6.0]])
    assert torch.equal(mixed_inputs(x, partner, torch.tensor([0.25])), torch.tensor([[2.5, 5.0]]))
    output = torch.tensor([[0.0, 1.0]])
    y, other = torch.tensor([0]), torch.tensor([1])
    ce = torch.nn.functional.cross_entropy
    assert mixed_per_sample_loss("classification", output, y, other, torch.tensor([1.0])) == (
        pytest.approx(ce(output, y).item())
    )
    assert mixed_per_sample_loss("classification", output, y, other, torch.tensor([0.0])) == (
        pytest.approx(ce(output, other).item())
    )
    regression = mixed_per_sample_loss(
        "regression", torch.tensor([[2.0]]), torch.tensor([1.0]), torch.tensor([5.0]),
        torch.tensor([0.5]),
    )  # fmt: skip
    assert regression.item() == pytest.approx((2.0 - 3.0) ** 2)


def test_beta_ratios_repeat_for_a_seed_and_have_the_beta_moments() -> None:
    alpha = 0.5
    partners, gamma = MixupDraws(alpha, seed=1, n=10).draw(20_000)
    again, gamma_again = MixupDraws(alpha, seed=1, n=10).draw(20_000)
    assert torch.equal(partners, again) and torch.equal(gamma, gamma_again)
    assert int(partners.min()) == 0 and int(partners.max()) == 9
    # Beta(a, a): mean 1/2, variance 1/(4(2a+1)); 20k draws: standard errors ~0.003 and ~0.001
    assert gamma.mean().item() == pytest.approx(0.5, abs=0.01)
    assert gamma.var().item() == pytest.approx(1 / (4 * (2 * alpha + 1)), abs=0.005)


def test_the_mixed_loss_probe_equals_a_hand_computation() -> None:
    a = agent()
    result = task(a, "loss", split="train", mixup_alpha=1.0, seed=9)
    model = a.context.new_model(seed=0)
    x, y = a.context.split("train")
    partners, gamma = MixupDraws(1.0, 9, len(y)).draw(len(y))
    with torch.no_grad():
        output = model(mixed_inputs(x, x[partners], gamma.float()))
        expected = mixed_per_sample_loss("classification", output, y, y[partners], gamma.float())
    assert result.metrics["loss"] == pytest.approx(expected.mean().item(), rel=1e-6)
    plain = task(agent(), "loss", split="train")
    assert result.metrics["loss"] != pytest.approx(plain.metrics["loss"])


def test_embedding_mixup_feeds_the_head_a_mix_of_the_two_rows_embeddings() -> None:
    a = agent(model=MLP)
    model = a.context.new_model(seed=0)
    x, y = a.context.split("train")
    rows, partners = torch.arange(4), torch.tensor([5, 6, 7, 8])
    gamma = torch.tensor([0.1, 0.5, 0.9, 1.0], dtype=torch.float64)
    embed, head = model[:-1], model[-1]
    g = gamma.float()[:, None]
    by_hand = mixed_per_sample_loss(
        "classification", head(g * embed(x[rows]) + (1 - g) * embed(x[partners])),
        y[rows], y[partners], gamma.float(),
    )  # fmt: skip
    on_embedding = mixed_losses("classification", model, x, y, rows, partners, gamma, "embedding")
    on_inputs = mixed_losses("classification", model, x, y, rows, partners, gamma, "inputs")
    assert torch.allclose(on_embedding, by_hand)
    assert not torch.allclose(on_embedding[:3], on_inputs[:3])
    assert torch.allclose(on_embedding[3], on_inputs[3])  # gamma = 1: the row itself


def test_embedding_mixup_trains_and_probes_and_needs_a_hidden_layer() -> None:
    on_inputs = task(agent(model=MLP), "train", mixup_alpha=1.0)
    on_embedding = task(agent(model=MLP), "train", mixup_alpha=1.0, mixup_on="embedding")
    assert not torch.equal(on_inputs.tensors["model"], on_embedding.tensors["model"])
    probe = task(agent(model=MLP), "loss", mixup_alpha=1.0, seed=2, mixup_on="embedding")
    assert probe.metrics["loss"] > 0
    linear = agent()
    with pytest.raises(ValueError, match="this model has no embedding"):
        handled(linear, message(linear, "train", mixup_alpha=1.0, mixup_on="embedding"))
    # no policy asks for it: DRFLM on the embedding of a linear model is refused when read
    drflm = {"name": "drflm", "mixup_on": "embedding"}
    with pytest.raises(PolicyError, match="model 'linear' has no embedding"):
        policy_with(algorithm=drflm, model=LINEAR, training={"epochs": None, "steps": 5})


def test_mixup_training_differs_from_plain_and_repeats() -> None:
    plain = task(agent(), "train")
    mixed = task(agent(), "train", mixup_alpha=1.0)
    again = task(agent(), "train", mixup_alpha=1.0)
    assert not torch.equal(plain.tensors["model"], mixed.tensors["model"])
    assert torch.equal(mixed.tensors["model"], again.tensors["model"])


def test_drflm_runs_and_moves_lambda() -> None:
    from fedsilo.ops.simulate import simulate

    p = parse_policy(
        {
            "version": 1,
            "seed": 1,
            "rounds": 3,
            "algorithm": {"name": "drflm", "mixup_alpha": 0.5},
            "model": {"name": "linear"},
            "training": {"steps": 3, "batch_size": 16, "lr": 0.1},
            "data": {"source": "sklearn:breast_cancer", "partition": {"kind": "iid", "silos": 3}},
        }
    )
    history = simulate(p, load_consortium(p.data, seed=p.seed)).history
    assert [r.status for r in history.records] == ["completed"] * 3
    lam = history.records[-1].mixing
    assert lam is not None and sum(lam.values()) == pytest.approx(1.0)
    assert len(set(lam.values())) > 1  # the losses moved it off uniform
