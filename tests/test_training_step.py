"""A site's training step and the parameters a silo keeps local, as specifications of their
pieces (silo/training_step.py, silo/local_parameters.py; the whole path, from `fedsilo new` to
a deployment, is tests/test_research_plugins.py).

- Plain training through a step: the optimiser moves every `accumulate` batches (and after the
  last), `stop_early` ends the run after a pass over the rows, a step that does not descend
  exactly once is refused, and the default step trains as fedsilo's own loop does.
- What DP-SGD cannot account for is named before training: early stopping, accumulation, mixed
  precision.
- A trained model leaves with the received values of the kept parameters, and the others as
  trained, whatever the layout and the patterns.
- A site trains with a step plug-in only when its rules list it (a strategy plug-in likewise:
  tests/test_research_plugins.py's deployment lists it).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from fedsilo.policies.loading import parse_policy
from fedsilo.policies.privacy import PrivacyConfig
from fedsilo.silo.config import LocalRules
from fedsilo.silo.local_loop import gradient_steps
from fedsilo.silo.local_parameters import as_received, local_names
from fedsilo.silo.training_step import (
    StepTools,
    TrainingStep,
    TrainingStepError,
    dp_sgd_problem,
    plain_steps,
)
from fedsilo.wire.tensors import ParameterSpec, TensorSpec

ROWS, FEATURES = 24, 3


class CountingSgd(torch.optim.SGD):
    """SGD that counts its updates."""

    def __init__(self, params: object, lr: float) -> None:
        super().__init__(params, lr=lr)
        self.updates = 0

    def step(self, closure: object = None) -> None:  # type: ignore[override]
        self.updates += 1
        super().step()


def setting(seed: int = 0) -> tuple[nn.Module, Tensor, Tensor]:
    torch.manual_seed(seed)
    model = nn.Linear(FEATURES, 2)
    x = torch.randn(ROWS, FEATURES)
    return model, x, (x[:, 0] > 0).long()


def tools_for(model: nn.Module, x: Tensor, y: Tensor):
    loss = nn.CrossEntropyLoss(reduction="none")
    generator = torch.Generator().manual_seed(1)
    return lambda descend: StepTools(model, generator, x, y, loss, descend)


def batches(count: int, size: int = 4) -> list[Tensor]:
    return [torch.arange(i * size, (i + 1) * size) % ROWS for i in range(count)]


@pytest.mark.parametrize(("accumulate", "count", "updates"), [(1, 6, 6), (3, 6, 2), (4, 6, 2)])
def test_the_optimiser_moves_every_accumulate_batches_and_after_the_last(
    accumulate: int, count: int, updates: int
) -> None:
    class Accumulating(TrainingStep):
        pass

    Accumulating.accumulate = accumulate
    model, x, y = setting()
    optimizer = CountingSgd(model.parameters(), lr=0.1)
    losses = plain_steps(
        Accumulating(), tools_for(model, x, y), optimizer, iter(batches(count)), 6, None
    )
    assert optimizer.updates == updates and len(losses) == count


def test_stop_early_ends_the_run_after_the_pass_it_says_so() -> None:
    class StopAfterTwo(TrainingStep):
        def __init__(self) -> None:
            self.seen: list[int] = []

        def stop_early(self, epoch: int, validation_loss: float) -> bool:
            self.seen.append(epoch)
            return epoch == 2

    model, x, y = setting()
    step = StopAfterTwo()
    losses = plain_steps(
        step,
        tools_for(model, x, y),
        torch.optim.SGD(model.parameters(), lr=0.1),
        iter(batches(12)),
        3,
        lambda: 0.5,
    )
    assert step.seen == [1, 2] and len(losses) == 6


def test_the_default_step_trains_as_fedsilos_own_loop() -> None:
    model, x, y = setting()
    own, _, _ = setting()
    plain_steps(
        TrainingStep(),
        tools_for(model, x, y),
        torch.optim.SGD(model.parameters(), lr=0.1),
        iter(batches(5)),
        6,
        None,
    )
    mean = nn.CrossEntropyLoss()
    gradient_steps(
        torch.optim.SGD(own.parameters(), lr=0.1),
        lambda rows: mean(own(x[rows]), y[rows]),
        iter(batches(5)),
        torch.device("cpu"),
    )
    for ours, theirs in zip(model.parameters(), own.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs)


def test_a_step_that_does_not_descend_exactly_once_is_refused() -> None:
    class Idle(TrainingStep):
        def step(self, rows: Tensor, tools: StepTools) -> None:
            tools.row_losses(*tools.batch(rows))

    model, x, y = setting()
    with pytest.raises(TrainingStepError, match="Idle descended 0 times in one batch"):
        plain_steps(
            Idle(),
            tools_for(model, x, y),
            torch.optim.SGD(model.parameters(), lr=0.1),
            iter(batches(1)),
            6,
            None,
        )


DP = PrivacyConfig.model_validate(
    {"delta": 1e-5, "dp_sgd": {"noise_multiplier": 1.0, "max_grad_norm": 1.0}}
)


class EarlyStopping(TrainingStep):
    def stop_early(self, epoch: int, validation_loss: float) -> bool:
        return True


class Accumulates(TrainingStep):
    accumulate = 2


class Mixed(TrainingStep):
    mixed_precision = True


@pytest.mark.parametrize(
    ("step", "reason"),
    [
        (EarlyStopping(), "stops early on the validation split, which no noise covers"),
        (Accumulates(), "accumulates 2 batches per update"),
        (Mixed(), "asks for mixed precision"),
    ],
)
def test_what_dp_sgd_cannot_account_for_is_named_before_training(
    step: TrainingStep, reason: str
) -> None:
    problem = dp_sgd_problem(step, DP)
    assert problem is not None and problem.startswith("training.step: ") and reason in problem
    assert dp_sgd_problem(step, PrivacyConfig()) is None
    assert dp_sgd_problem(TrainingStep(), DP) is None


@st.composite
def layouts(draw: st.DrawFn) -> tuple[ParameterSpec, list[str]]:
    names = draw(st.lists(st.sampled_from("abcdefgh"), min_size=1, max_size=6, unique=True))
    shapes = [tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=2))) for _ in names]
    spec = ParameterSpec(tuple(TensorSpec(n, s) for n, s in zip(names, shapes, strict=True)))
    return spec, draw(st.lists(st.sampled_from(names), unique=True))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(layout=layouts())
def test_a_trained_model_leaves_with_the_received_values_of_the_kept_parameters(
    layout: tuple[ParameterSpec, list[str]],
) -> None:
    spec, kept = layout
    size = sum(entry.numel for entry in spec.entries)
    received, trained = torch.zeros(size), torch.arange(1, size + 1, dtype=torch.float32)
    sent = spec.unflatten(as_received(trained, received, spec, kept))
    for name, values in spec.unflatten(trained).items():
        expected = torch.zeros_like(values) if name in kept else values
        assert torch.equal(sent[name], expected), name


def test_the_kept_parameters_are_those_the_patterns_match() -> None:
    model = nn.Sequential()
    model.add_module("norm", nn.LayerNorm(2))
    model.add_module("head", nn.Linear(2, 1))
    assert local_names(("norm.*",), model) == ["norm.weight", "norm.bias"]
    assert local_names(("*.bias",), model) == ["norm.bias", "head.bias"]
    assert local_names((), model) == []


def test_a_site_trains_with_a_step_plugin_only_when_its_rules_list_it() -> None:
    policy = parse_policy({"version": 1})
    assert not [v for v in LocalRules().violations(policy) if "allowed_" in v]
    step = {
        "plugin": "site.steps:Jitter",
        "package": {"version": "1", "digest": "0" * 64},
    }
    stepped = parse_policy({"version": 1, "training": {"step": step}})
    assert any(
        v.startswith("allowed_training_steps: the policy's training step 'site.steps:Jitter'")
        for v in LocalRules().violations(stepped)
    )
    allowed = LocalRules(allowed_training_steps=["site.steps:Jitter"])
    assert not [v for v in allowed.violations(stepped) if "allowed_training_steps" in v]
