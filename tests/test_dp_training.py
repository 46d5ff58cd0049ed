"""Sample-level DP-SGD in silo training: the policy section, the plan a silo books, and the
private training loop (equivalence without noise, clipping, seeding, calibration, refusals)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from opacus.grad_sample import GradSampleModule
from opacus.optimizers import DPOptimizer
from torch import nn

from fedsilo.policies.loading import PolicyError, parse_policy
from fedsilo.policies.model import CnnModel, LinearModel, MlpModel, ModelConfig
from fedsilo.policies.privacy import PrivacyConfig
from fedsilo.policies.schema import Policy
from fedsilo.privacy.accounting import Mechanism, epsilon
from fedsilo.silo.agent import SiloAgent
from fedsilo.silo.data import SiloDataset
from fedsilo.silo.dp_training import DpSgdError, DpSgdPlan, check_model, dp_sgd_plan, train_private
from fedsilo.silo.schedule import LocalSchedule
from fedsilo.wire.messages import TaskResult
from fedsilo.wire.tasks import InitTask
from tests.silos import agent as built
from tests.silos import answer, honest, policy_with
from tests.test_tasks import run, separable, train_config
from tests.wire_tasks import reworded

LINEAR = LinearModel(name="linear")

# Opacus' RDP warns while calibrating through very small epsilons; its per-sample gradient
# hooks (the reference below) warn that the first layer's backward hook has no input gradient.
pytestmark = [
    pytest.mark.filterwarnings("ignore:Full backward hook is firing"),
]


def dp(**dp_sgd: object) -> PrivacyConfig:
    return PrivacyConfig.model_validate({"dp_sgd": {"noise_multiplier": 1.0, **dp_sgd}})


def silo_policy(
    privacy: PrivacyConfig | None, model: ModelConfig = LINEAR, rounds: int = 10
) -> Policy:
    """A policy of `rounds` rounds of `model` under `privacy`. A noiseless DP-SGD section
    (noise_multiplier 0), which every policy refuses (policies/schema.py: `_check_dp_noise`),
    is set unchecked: the loop's equivalence to plain training and its clipping are unit tests
    of the handler, run without the agent (`run`)."""
    if privacy is not None and privacy.dp_sgd is not None and privacy.dp_sgd.noise_multiplier == 0:
        return policy_with(model=model, rounds=rounds).model_copy(update={"privacy": privacy})
    return policy_with(
        model=model, rounds=rounds, **({"privacy": privacy} if privacy is not None else {})
    )


def agent(
    privacy: PrivacyConfig | None = None, model: ModelConfig = LINEAR, secret: bytes = b""
) -> SiloAgent:
    return built(separable(), silo_policy(privacy, model), secret=secret)


def trained(privacy: PrivacyConfig | None, secret: bytes = b"", **config: object) -> TaskResult:
    """What the train handler computes from `train_config(**config)` on a silo of `privacy`."""
    silo = agent(privacy, secret=secret)
    result = run(silo, train_config(**config), run(silo, InitTask(seed=0)))
    assert result.ok, result.error
    return result


def update(result: TaskResult) -> torch.Tensor:
    initial = run(agent(), InitTask(seed=0))
    return result.tensors["model"] - initial.tensors["model"]


# -- equivalence, clipping, seeding ------------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [{}, {"prox_mu": 0.5}, {"optimizer": "adam", "lr": 0.01}, {"momentum": 0.9, "lr": 0.05}],
    ids=["sgd", "fedprox", "adam", "momentum"],
)
def test_without_noise_or_clipping_dp_sgd_is_plain_training(config: dict) -> None:
    # Equal to 1e-6, not bit for bit: DP-SGD sums the per-sample gradients weighted by their
    # clip factors (1 here), formed from each layer's input and output gradient, and divides
    # by the batch size, where plain training differentiates the mean loss; the float
    # operations differ, so results agree to rounding (often exactly). Shuffled batches (no
    # Poisson sampling) follow the same seeded order as plain training, the smaller last batch
    # of each pass included.
    exact = dp(noise_multiplier=0.0, max_grad_norm=1e9, poisson_sampling=False)
    plain, private = trained(None, **config), trained(exact, **config)
    assert plain.metrics["steps"] == private.metrics["dp_steps"] == 5 * 13  # 200 rows, 16 a batch
    torch.testing.assert_close(private.tensors["model"], plain.tensors["model"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("batch_size", [1, 200])
def test_each_sample_moves_the_model_by_at_most_the_clip_norm(batch_size: int) -> None:
    # One step, lr 1, no noise: the update is the mean of the clipped per-sample gradients,
    # whereas plain training's step is far longer than the clip norm.
    clip, one_step = 1e-3, {"epochs": None, "steps": 1, "batch_size": batch_size, "lr": 1.0}
    privacy = dp(noise_multiplier=0.0, max_grad_norm=clip, poisson_sampling=False)
    step = update(trained(privacy, **one_step)).norm().item()
    assert update(trained(None, **one_step)).norm().item() > 50 * clip
    if batch_size == 1:  # a single sample's gradient, clipped to exactly the clip norm
        assert step == pytest.approx(clip, rel=1e-4)
    else:
        assert step <= clip * (1 + 1e-6)


def test_the_noise_repeats_for_the_same_silo_and_task_and_is_keyed_to_the_silos_secret() -> None:
    # Poisson batches and noise come from the silo's secret and the task id, not from the
    # task's minibatch seed (derived from the policy's seed, which the coordinator knows): a
    # coordinator can neither predict nor replay the noise.
    noisy = dp(noise_multiplier=1.0)
    first, second = trained(noisy, secret=b"k1"), trained(noisy, secret=b"k1")
    other_secret = trained(noisy, secret=b"k2")
    other_task_seed = trained(noisy, secret=b"k1", seed=4)
    assert first.tensors["model"].equal(second.tensors["model"])
    assert not first.tensors["model"].equal(other_secret.tensors["model"])
    assert first.tensors["model"].equal(other_task_seed.tensors["model"])


def test_under_dp_the_count_is_noised_and_the_training_loss_stays_at_the_silo() -> None:
    counts = {trained(dp(noise_multiplier=1.0), secret=s).num_samples for s in (b"a", b"b", b"c")}
    assert len(counts) > 1 and all(150 < c < 250 for c in counts)  # 200 rows, noise std 2
    assert "train_loss" not in trained(dp(noise_multiplier=1.0)).metrics
    assert trained(None).num_samples == 200 and "train_loss" in trained(None).metrics


def test_noise_is_added_even_to_a_step_whose_poisson_batch_is_empty() -> None:
    # batch 1 of 200 rows: each step's batch is empty with probability (1 - 1/200)^200 ~ 0.37.
    noisy = dp(noise_multiplier=1.0)
    result = trained(noisy, epochs=None, steps=30, batch_size=1)
    assert torch.isfinite(result.tensors["model"]).all() and update(result).norm() > 0


@pytest.mark.parametrize(
    "model", [LINEAR, MlpModel(name="mlp", hidden=[8]), CnnModel(name="cnn", channels=[4])]
)
def test_every_model_of_the_zoo_trains_under_dp_sgd(model: ModelConfig) -> None:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 1, 6, 6, generator=g), torch.randint(0, 3, (64,), generator=g)
    data = SiloDataset("a", x, y, x[:8], y[:8], x[:8], y[:8], "classification", 3, (), (1, 6, 6))
    silo = built(data, silo_policy(dp(noise_multiplier=0.5), model, rounds=1))
    result = run(silo, train_config(epochs=1), run(silo, InitTask(seed=0)))
    assert result.ok, result.error


def one_step(model: nn.Module, clip: float, x: torch.Tensor, y: torch.Tensor, **kw) -> None:
    """One noiseless DP-SGD step over all of (x, y), lr 1, through `train_private`."""
    n = len(y)
    plan = DpSgdPlan(0.0, 1.0, clip, False, LocalSchedule(n, n, 1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)

    def per_sample_loss(index: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x[index]), y[index], reduction="none")

    train_private(model, optimizer, plan, 0, 0, per_sample_loss, **kw)


def opacus_step(model: nn.Module, clip: float, x: torch.Tensor, y: torch.Tensor) -> None:
    """The same step through Opacus' per-sample gradients (hooks) and DPOptimizer."""
    private = GradSampleModule(model)
    optimizer = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0),
        noise_multiplier=0.0,
        max_grad_norm=clip,
        expected_batch_size=len(y),
    )
    F.cross_entropy(private(x), y).backward()
    optimizer.step()
    private._close()


SHAPES = {
    "linear": lambda: nn.Sequential(nn.Flatten(), nn.Linear(36, 3)),
    "mlp_tanh": lambda: nn.Sequential(
        nn.Flatten(), nn.Linear(36, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)
    ),
    "cnn": lambda: nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(36, 3)
    ),
    "groupnorm": lambda: nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.GroupNorm(2, 4), nn.Tanh(), nn.Flatten(), nn.Linear(64, 3)
    ),
    "linear_on_rows": lambda: nn.Sequential(nn.Linear(6, 5), nn.Flatten(), nn.Linear(30, 3)),
    "no_bias": lambda: nn.Sequential(nn.Flatten(), nn.Linear(36, 8, bias=False), nn.Linear(8, 3)),
}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("clip", [1e-2, 1.0, 1e9], ids=["clip_all", "clip_some", "clip_none"])
def test_the_clipped_gradient_is_opacus_per_sample_clipping(shape: str, clip: float) -> None:
    # The loop's one backward pass (ghost norms for dense layers, Opacus' grad samplers for
    # the rest) gives the update Opacus gives from every row's materialised gradient.
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 1, 6, 6, generator=g), torch.randint(0, 3, (32,), generator=g)
    torch.manual_seed(0)  # layer initialisation only
    model = SHAPES[shape]()
    reference = copy.deepcopy(model)
    one_step(model, clip, x, y)
    opacus_step(reference, clip, x, y)
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_the_loop_leaves_the_global_rng_alone_and_the_model_unhooked() -> None:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 1, 6, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
    model = SHAPES["cnn"]()
    state = torch.get_rng_state()
    one_step(model, 1.0, x, y)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(not m._forward_hooks for m in model.modules())


class Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.flatten, self.layer = nn.Flatten(), nn.Linear(36, 36)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(self.layer(self.flatten(x)))[:, :3]


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(36))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.flatten(1) * self.scale)[:, :3]


@pytest.mark.parametrize(
    ("model", "match"),
    [
        (Shared(), r"Linear ran twice in one forward pass"),
        (
            nn.Sequential(nn.Flatten(), nn.Linear(36, 8), nn.ReLU(inplace=True), nn.Linear(8, 3)),
            r"output of Linear is modified in place .*ReLU\(inplace=True\)",
        ),
        (Scaled(), r"Scaled at '' has parameters but Opacus has no per-sample gradient"),
    ],
    ids=["shared_layer", "inplace", "unknown_layer"],
)
def test_models_the_loop_cannot_clip_per_sample_are_refused(model: nn.Module, match: str) -> None:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 1, 6, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
    with pytest.raises(DpSgdError, match=match):
        one_step(model, 1.0, x, y)
    assert all(not m._forward_hooks for m in model.modules())


# -- the plan a silo books, and where its parameters come from ---------------------------------


def test_the_result_reports_the_plan_the_silo_computed_before_training() -> None:
    privacy = PrivacyConfig.model_validate({"dp_sgd": {"training_epsilon": 4.0}})
    plan = dp_sgd_plan(privacy, train_config().local, n_train=200, rounds=10)
    result = trained(privacy)
    assert result.metrics["dp_noise_multiplier"] == plan.noise_multiplier
    assert result.metrics["dp_sample_rate"] == plan.sample_rate == 16 / 200
    assert result.metrics["dp_steps"] == plan.steps == 5 * 13
    assert plan.mechanism() == Mechanism.dp_sgd(
        noise_multiplier=plan.noise_multiplier, sample_rate=0.08, steps=65, max_grad_norm=1.0
    )


def test_a_plan_without_noise_books_a_release_without_dp_guarantee() -> None:
    plan = dp_sgd_plan(dp(noise_multiplier=0.0), train_config().local, n_train=200, rounds=1)
    assert plan.mechanism() == Mechanism.none()


def test_the_task_cannot_change_the_silos_dp_parameters() -> None:
    # DP parameters come from the silo's own copy of the policy; a task into which a
    # coordinator slips keys of its own is refused unrun, and so is one whose local training
    # (which sets DP-SGD's sampling rate and steps, so the epsilon booked) is not the policy's.
    privacy = dp(noise_multiplier=2.0, max_grad_norm=0.5)
    assert trained(privacy).metrics["dp_noise_multiplier"] == 2.0
    silo = agent(privacy)
    init = answer(silo, honest(silo, "init", 0))
    task = honest(silo, "train", 1, init.tensors, init.spec)
    assert answer(silo, task).metrics["dp_noise_multiplier"] == 2.0
    slipped = {"dp_sgd": None, "noise_multiplier": 0.0, "max_grad_norm": 1e9}
    weakened = TaskResult.decode(silo.handle_bytes(reworded(task, task.config.to_json() | slipped)))
    assert weakened.status == "error" and not weakened.tensors
    assert "train task: unknown config key(s) ['dp_sgd', 'max_grad_norm', 'noise_multiplier']" in (
        weakened.error or ""
    )
    later = honest(silo, "train", 2, init.tensors, init.spec)  # a task id not answered yet
    whole = {**later.config.to_json(), "batch_size": 200}  # sample rate 1: far less privacy
    larger = TaskResult.decode(silo.handle_bytes(reworded(later, whole)))
    assert larger.status == "error" and not larger.tensors
    assert "config key 'batch_size' is 200; this silo's policy says 32" in (larger.error or "")


@pytest.mark.parametrize("accountant", ["rdp", "prv"])
def test_a_training_epsilon_is_met_by_the_whole_deployments_training(accountant: str) -> None:
    privacy = PrivacyConfig.model_validate(
        {"accountant": accountant, "dp_sgd": {"training_epsilon": 2.0}}
    )
    rounds = 10
    plan = dp_sgd_plan(privacy, train_config(epochs=1).local, n_train=200, rounds=rounds)
    spent = epsilon([plan.mechanism()] * rounds, privacy.delta, accountant)
    assert 2.0 - 0.05 < spent <= 2.0


def test_an_unreachable_training_epsilon_is_a_clear_error() -> None:
    privacy = PrivacyConfig.model_validate({"dp_sgd": {"training_epsilon": 1e-4}})
    with pytest.raises(DpSgdError, match="no noise multiplier reaches training_epsilon 0.0001"):
        dp_sgd_plan(privacy, train_config(batch_size=200).local, n_train=200, rounds=100)


def test_a_model_with_batchnorm_is_refused_with_the_layer_and_the_fix() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.raises(DpSgdError, match=r"BatchNorm1d at '1' .*GroupNorm.*ModuleValidator\.fix"):
        check_model(model)
    check_model(nn.Sequential(nn.Linear(4, 8), nn.GroupNorm(2, 8), nn.Linear(8, 2)))


# -- the policy section ------------------------------------------------------------------------


def privacy_policy(**privacy: object) -> dict:
    return {"version": 1, "privacy": privacy}


@pytest.mark.parametrize(
    ("privacy", "said"),
    [
        ({"dp_sgd": {}}, r"privacy: dp_sgd: set exactly one of .*\(got neither\), or privacy\.job"),
        (
            {"dp_sgd": {"noise_multiplier": 1.0, "training_epsilon": 3.0}},
            r"privacy\.dp_sgd: set exactly one of .*\(got both\)",
        ),
        (
            {"job_epsilon": 4, "dp_sgd": {"noise_multiplier": 1.0}},
            r"job_epsilon calibrates DP-SGD's noise .* without noise_multiplier or training_eps",
        ),
        ({"job_epsilon": 4}, r"job_epsilon .* needs dp_sgd .*\(there is no dp_sgd\)"),
    ],
    ids=["neither", "both", "job-epsilon-and-a-noise", "job-epsilon-without-dp-sgd"],
)
def test_dp_sgd_noise_is_set_exactly_once(privacy: dict, said: str) -> None:
    with pytest.raises(PolicyError, match=said):
        parse_policy(privacy_policy(**privacy))


@pytest.mark.parametrize("key", ["training_epsilon", "job_epsilon"])
def test_a_target_above_the_cap_is_refused(key: str) -> None:
    privacy = (
        {"dp_sgd": {"training_epsilon": 10}}
        if key == "training_epsilon"
        else {"job_epsilon": 10, "dp_sgd": {}}
    )
    with pytest.raises(PolicyError, match=rf"privacy: (dp_sgd\.)?{key} 10 exceeds epsilon_cap 8"):
        parse_policy(privacy_policy(epsilon_cap=8, **privacy))


def test_privacy_settings_are_range_checked_and_default_to_no_dp() -> None:
    assert parse_policy({"version": 1}).privacy == PrivacyConfig(dp_sgd=None)
    with pytest.raises(PolicyError, match=r"privacy\.delta"):
        parse_policy(privacy_policy(delta=1.5))
    with pytest.raises(PolicyError, match=r"privacy\.dp_sgd\.max_grad_norm"):
        parse_policy(privacy_policy(dp_sgd={"noise_multiplier": 1, "max_grad_norm": 0}))
    with pytest.raises(PolicyError, match=r"did you mean 'noise_multiplier'"):
        parse_policy(privacy_policy(dp_sgd={"noise_multiplyer": 1}))
