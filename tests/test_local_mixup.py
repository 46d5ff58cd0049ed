"""The silo's side of DRFA and DRFLM.

A train task with `checkpoint_step` t also returns the parameters after exactly t local steps
(the model of a t-step run, with or without DP-SGD), books nothing more, and refuses a t outside
the run or together with client-level DP; a DRFA silo's contract refuses, before anything runs,
any t but its policy's public draw for the round. Local mixup (`mixup_alpha`) mixes inputs,
regression targets and classification losses linearly with seeded Beta(alpha, alpha) ratios and
uniform partners; a mixup run takes the plain run's batches, repeats bit for bit, and under
DP-SGD clips each mixed row. A loss task with `mixup_alpha` and `seed` reports the mean mixed
loss over the split, a hand computation, noised under DP exactly like the plain loss report.
Handlers run as the agent runs them once a task passed its contract (`run`), with any config.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fedsilo.policies.loading import PolicyError
from fedsilo.policies.privacy import PrivacyConfig
from fedsilo.silo.agent import SiloAgent
from fedsilo.silo.data import SiloDataset
from fedsilo.silo.evaluation import per_sample_loss_function
from fedsilo.silo.mixup import MixupDraws, mixed_inputs, mixed_losses, mixed_per_sample_loss
from fedsilo.silo.tasks.evaluate import loss_releases
from fedsilo.silo.tasks.train import train_releases
from fedsilo.wire.messages import SIMULATION, TaskMessage, TaskResult, task_id
from fedsilo.wire.tasks import InitTask, LossProbe
from tests.silos import agent as built
from tests.silos import honest, policy_with, run_handler
from tests.test_tasks import run, separable, train_config
from tests.wire_tasks import reworded

pytestmark = [
    pytest.mark.filterwarnings("ignore:Full backward hook is firing"),
]

LINEAR = {"name": "linear"}
DP_SGD = {"dp_sgd": {"noise_multiplier": 1.0}}
DRFA = {"name": "drfa"}
SIX_STEPS = {"epochs": None, "steps": 6}


def agent(privacy: dict | None = None, data: SiloDataset | None = None) -> SiloAgent:
    """Silo "a" of a 10-round policy of a linear model, with a secret of its own, under
    `privacy` as written: a handler's unit test may run without noise, which a policy refuses
    (the section is set on the parsed policy, past the policy's own checks)."""
    policy = policy_with(model=LINEAR, rounds=10)
    if privacy is not None:
        policy = policy.model_copy(update={"privacy": PrivacyConfig.model_validate(privacy)})
    return built(data or separable(), policy, secret=b"s")


def drfa_silo() -> SiloAgent:
    """Silo "a" of a 10-round DRFA policy of 6 local steps."""
    policy = policy_with(model=LINEAR, algorithm=DRFA, training=SIX_STEPS, rounds=10)
    return built(separable(), policy, secret=b"s")


def initial(silo: SiloAgent) -> TaskResult:
    return run(silo, InitTask(seed=0))


def trained(privacy: dict | None = None, **config: object) -> TaskResult:
    silo = agent(privacy)
    result = run(silo, train_config(**{"epochs": None, "steps": 6, **config}), initial(silo))
    assert result.ok, result.error
    return result


def regression(n: int = 40) -> SiloDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 3, generator=g)
    y = x @ torch.tensor([1.0, -2.0, 0.5]) + 0.1 * torch.randn(n, generator=g)
    return SiloDataset("a", x, y, x, y, x, y, "regression", None, ("f0", "f1", "f2"), (3,))


# -- DRFA's checkpoint ------------------------------------------------------------------------


def test_without_checkpoint_step_no_checkpoint_is_returned() -> None:
    assert set(trained().tensors) == set(trained(checkpoint_step=None).tensors) == {"model"}


def test_a_checkpoint_at_the_last_step_is_the_model() -> None:
    result = trained(checkpoint_step=6)
    assert torch.equal(result.tensors["checkpoint"], result.tensors["model"])


@pytest.mark.parametrize(
    ("t", "config"),
    [(1, {}), (4, {"optimizer": "adam", "lr": 0.05}), (15, {"epochs": 2, "steps": None})],
    ids=["first-step", "adam", "by-epochs"],
)
def test_the_checkpoint_after_t_steps_is_the_model_of_a_t_step_run(t: int, config: dict) -> None:
    result = trained(checkpoint_step=t, **config)
    short = trained(**{**config, "epochs": None, "steps": t})
    assert torch.equal(result.tensors["checkpoint"], short.tensors["model"])
    assert not torch.equal(result.tensors["checkpoint"], result.tensors["model"])
    assert result.spec == short.spec


def test_under_dp_sgd_the_checkpoint_is_an_iterate_of_the_same_noisy_run() -> None:
    # The silo's private seed depends on the task, not its length: a 2-step run draws the same
    # Poisson batches and noise for its two steps as the first two steps of a 6-step run.
    result = trained(DP_SGD, checkpoint_step=2)
    short = trained(DP_SGD, steps=2)
    assert result.metrics["dp_steps"] == 6
    assert torch.equal(result.tensors["checkpoint"], short.tensors["model"])
    assert not torch.equal(result.tensors["checkpoint"], result.tensors["model"])


@pytest.mark.parametrize("privacy", [None, DP_SGD], ids=["exact", "dp-sgd"])
def test_a_checkpoint_books_nothing_more_than_the_run(privacy: dict | None) -> None:
    silo = agent(privacy)
    init = initial(silo)

    def releases(**extra: object) -> list:
        config = train_config(epochs=None, steps=6, **extra)
        message = TaskMessage("t", 1, "train", "a", config, init.tensors, init.spec)
        return train_releases(message, silo.context)

    assert releases(checkpoint_step=3) == releases()


@pytest.mark.parametrize(
    ("t", "message"),
    [
        # the contract: a DRFA silo takes the round's checkpoint step from its own policy
        (-1, "config key 'checkpoint_step' is -1; this silo's policy says {policy}"),
        (7, "config key 'checkpoint_step' is 7; this silo's policy says {policy}"),
        # refused when the task is read, before any contract or handler
        (2.5, "train task: config key 'checkpoint_step' must be int, not float (2.5)"),
        (True, "train task: config key 'checkpoint_step' must be int, not bool (True)"),
        ("3", "train task: config key 'checkpoint_step' must be int, not str ('3')"),
    ],
)
def test_a_checkpoint_step_that_is_not_a_step_of_the_run_is_refused(
    t: object, message: str
) -> None:
    """Sent to a DRFA silo of 6 local steps, in place of its round's checkpoint step: refused
    unrun, nothing but the refusal in the answer."""
    silo = drfa_silo()
    init = initial(silo)
    task = honest(silo, "train", 1, init.tensors, init.spec)
    drawn = silo.context.algorithm.checkpoint_step(silo.context.policy, 1)
    assert task.config.checkpoint_step == drawn
    result = TaskResult.decode(
        silo.handle_bytes(reworded(task, task.config.to_json() | {"checkpoint_step": t}))
    )
    assert result.status == "error" and message.format(policy=drawn) in result.error
    assert not result.tensors


@pytest.mark.parametrize("t", [-1, 7])
def test_the_handler_refuses_a_checkpoint_step_outside_the_run(t: int) -> None:
    silo = agent()
    config = train_config(epochs=None, steps=6, checkpoint_step=t)
    with pytest.raises(ValueError, match=f"checkpoint_step {t} is outside the run's 0..6 local"):
        run(silo, config, initial(silo))


def test_a_checkpoint_is_refused_with_client_level_dp() -> None:
    client_dp = {"client_dp": {"clip": 1.0, "noise_multiplier": 1.0}}
    silo = agent(client_dp)
    with pytest.raises(
        ValueError, match="checkpoint_step cannot be combined with privacy.client_dp"
    ):
        run(silo, train_config(checkpoint_step=1), initial(silo))
    # no policy asks for both: DRFA under client-level DP is refused when the policy is read
    with pytest.raises(PolicyError, match="drfa does not average clipped model updates"):
        policy_with(algorithm=DRFA, training=SIX_STEPS, privacy=client_dp)


# -- the mixing maths -------------------------------------------------------------------------


def test_inputs_mix_row_by_row_over_every_feature_dimension() -> None:
    x, partner = torch.ones(3, 1, 2, 2), torch.zeros(3, 1, 2, 2)  # image-shaped rows
    gamma = torch.tensor([1.0, 0.0, 0.25], dtype=torch.float64)
    mixed = mixed_inputs(x, partner, gamma)
    assert mixed.dtype == x.dtype and mixed.shape == x.shape
    assert mixed.flatten(1).tolist() == [[1.0] * 4, [0.0] * 4, [0.25] * 4]


def test_a_classification_row_has_the_soft_target_cross_entropy() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5], [0.0, 1.0, 3.0], [1.0, 1.0, -2.0]])
    y, partner_y = torch.tensor([0, 2, 1]), torch.tensor([1, 2, 0])
    gamma = torch.tensor([1.0, 0.3, 0.0])
    losses = mixed_per_sample_loss("classification", logits, y, partner_y, gamma)
    soft = gamma[:, None] * F.one_hot(y, 3) + (1 - gamma[:, None]) * F.one_hot(partner_y, 3)
    torch.testing.assert_close(losses, F.cross_entropy(logits, soft, reduction="none"))
    assert losses[0] == F.cross_entropy(logits[:1], y[:1])  # gamma 1: the row's own label
    assert losses[2] == F.cross_entropy(logits[2:], partner_y[2:])  # gamma 0: the partner's


def test_regression_targets_mix_linearly() -> None:
    prediction = torch.tensor([[2.0], [0.0], [1.0]])  # the model's (n, 1) output
    y, partner_y = torch.tensor([1.0, 4.0, -1.0]), torch.tensor([5.0, 0.0, 3.0])
    gamma = torch.tensor([0.5, 0.25, 1.0])
    losses = mixed_per_sample_loss("regression", prediction, y, partner_y, gamma)
    assert losses.tolist() == [(2.0 - 3.0) ** 2, (0.0 - 1.0) ** 2, (1.0 + 1.0) ** 2]


@pytest.mark.parametrize("task", ["classification", "regression"])
def test_ratios_one_and_zero_give_the_plain_losses_of_a_row_and_of_its_partner(task: str) -> None:
    data = separable(20) if task == "classification" else regression(20)
    x, y = data.x_train, data.y_train
    model = agent(data=data).context.new_model(seed=0)
    rows, partners = torch.tensor([0, 3, 5, 7]), torch.tensor([9, 3, 1, 12])
    plain = per_sample_loss_function(task)
    ones, zeros = torch.ones(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)
    torch.testing.assert_close(
        mixed_losses(task, model, x, y, rows, partners, ones), plain(model(x[rows]), y[rows])
    )
    torch.testing.assert_close(
        mixed_losses(task, model, x, y, rows, partners, zeros),
        plain(model(x[partners]), y[partners]),
    )


# -- the draws --------------------------------------------------------------------------------


def test_draws_repeat_for_a_seed_and_differ_for_another() -> None:
    first, again, other = (MixupDraws(0.5, seed, n=30).draw(100) for seed in (4, 4, 5))
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert not torch.equal(first[0], other[0]) and not torch.equal(first[1], other[1])
    draws = MixupDraws(0.5, 4, n=30)
    assert not torch.equal(draws.draw(100)[1], draws.draw(100)[1])  # a stream, not one draw


def test_partners_are_uniform_with_replacement_over_the_split() -> None:
    partners, _ = MixupDraws(1.0, seed=0, n=10).draw(10_000)
    counts = torch.bincount(partners, minlength=10)
    assert len(counts) == 10 and len(torch.unique(partners[:10])) < 10  # repeats: replacement
    # Each count is Binomial(10^4, 0.1): sd 30, so 150 is 5 sd.
    assert (counts - 1000).abs().max() < 150


@pytest.mark.parametrize("alpha", [0.2, 1.0, 4.0])
def test_ratios_have_the_mean_and_variance_of_beta_alpha_alpha(alpha: float) -> None:
    _, gamma = MixupDraws(alpha, seed=2, n=5).draw(40_000)
    assert gamma.dtype == torch.float64 and bool(((gamma >= 0) & (gamma <= 1)).all())
    # Beta(a, a): mean 1/2, variance 1/(4(2a+1)). Over 40k draws the sample mean's standard
    # error is at most sqrt(0.25 / 40k) = 0.0025, and the sample variance's at most
    # sqrt(E(g - 1/2)^4 / 40k) <= 0.25 / 200 = 0.00125 (g in [0, 1]): tolerances of 4 of them.
    assert gamma.mean().item() == pytest.approx(0.5, abs=0.01)
    assert gamma.var().item() == pytest.approx(1 / (4 * (2 * alpha + 1)), abs=0.005)


def test_a_small_alpha_keeps_rows_whole_and_a_large_one_halves_them() -> None:
    _, near_endpoints = MixupDraws(1e-4, seed=3, n=5).draw(10_000)
    assert (torch.minimum(near_endpoints, 1 - near_endpoints) < 1e-3).float().mean() > 0.99
    _, near_half = MixupDraws(1e4, seed=3, n=5).draw(10_000)
    assert (near_half - 0.5).abs().max() < 0.05


@pytest.mark.parametrize("alpha", [0.0, -1.0, math.nan, math.inf])
def test_alpha_must_be_a_positive_number(alpha: float) -> None:
    with pytest.raises(ValueError, match="mixup_alpha must be a positive number"):
        MixupDraws(alpha, seed=0, n=5)


# -- mixup training ---------------------------------------------------------------------------


def test_a_mixup_run_differs_from_a_plain_one_and_repeats_bit_for_bit() -> None:
    plain, off = trained(), trained(mixup_alpha=None)
    mixed, again = trained(mixup_alpha=0.5), trained(mixup_alpha=0.5)
    assert torch.equal(plain.tensors["model"], off.tensors["model"])  # None: off
    assert not torch.equal(plain.tensors["model"], mixed.tensors["model"])
    assert torch.equal(mixed.tensors["model"], again.tensors["model"])
    assert not torch.equal(
        mixed.tensors["model"], trained(mixup_alpha=0.5, seed=4).tensors["model"]
    )


def test_a_mixup_step_descends_the_mean_mixed_loss_of_the_plain_batch() -> None:
    # One SGD step on a batch of 8: the rows a plain run with seed 3 takes first, partners and
    # ratios the first draw of the seed's mixup stream.
    silo, lr = agent(), 0.5
    init = initial(silo)
    config = train_config(epochs=None, steps=1, batch_size=8, lr=lr, mixup_alpha=0.7)
    result = run(silo, config, init)
    model = silo.context.new_model(seed=0)
    x, y = silo.context.split("train")
    rows = torch.randperm(200, generator=torch.Generator().manual_seed(3))[:8]
    partners, gamma = MixupDraws(0.7, seed=3, n=200).draw(8)
    mixed_losses("classification", model, x, y, rows, partners, gamma).mean().backward()
    expected = torch.cat([(p - lr * p.grad).detach().flatten() for p in model.parameters()])
    torch.testing.assert_close(result.tensors["model"], expected)


def test_under_dp_sgd_without_noise_or_clipping_mixup_is_plain_mixup_training() -> None:
    # The DP-SGD loop minimises the same mixed per-row losses, drawn in the same order;
    # agreement to rounding as in tests/test_dp_training.py.
    exact = {"dp_sgd": {"noise_multiplier": 0.0, "max_grad_norm": 1e9, "poisson_sampling": False}}
    plain, private = trained(mixup_alpha=0.5), trained(exact, mixup_alpha=0.5)
    torch.testing.assert_close(private.tensors["model"], plain.tensors["model"], rtol=0, atol=1e-6)


def test_under_dp_sgd_each_mixed_row_moves_the_model_by_at_most_the_clip_norm() -> None:
    clip = {"dp_sgd": {"noise_multiplier": 0.0, "max_grad_norm": 0.01, "poisson_sampling": False}}
    silo = agent(clip)
    init = initial(silo)
    config = train_config(epochs=None, steps=1, batch_size=1, lr=1.0, mixup_alpha=0.5)
    result = run(silo, config, init)
    step = (result.tensors["model"] - init.tensors["model"]).norm().item()
    assert 0 < step <= 0.01 * (1 + 1e-5)


# -- the mixed loss report --------------------------------------------------------------------


LOSS_TASK = task_id(SIMULATION, 1, "loss", None, "a")  # the id `mixed_report`'s task has


def mixed_report(silo: SiloAgent, **config: object) -> TaskResult:
    init = initial(silo)
    probe = LossProbe(split="train", **config)
    result = run_handler(silo, probe, init.tensors, init.spec, phase="loss")
    assert result.ok, result.error
    return result


@pytest.mark.parametrize("task", ["classification", "regression"])
def test_the_mixed_loss_report_is_a_hand_computation(task: str) -> None:
    data = separable(6) if task == "classification" else regression(6)
    silo = agent(data=data)
    report = mixed_report(silo, mixup_alpha=0.5, seed=11)
    named = initial(silo).spec.unflatten(initial(silo).tensors["model"])
    weight, bias = named["1.weight"].double(), named["1.bias"].double()
    x, y = data.x_train.double(), data.y_train
    partners, gamma = MixupDraws(0.5, seed=11, n=6).draw(6)  # row i pairs with partners[i]
    output = (gamma[:, None] * x + (1 - gamma[:, None]) * x[partners]) @ weight.T + bias
    if task == "classification":
        log_p = output - output.logsumexp(dim=1, keepdim=True)
        rows = torch.arange(6)
        per_row = -(gamma * log_p[rows, y] + (1 - gamma) * log_p[rows, y[partners]])
    else:
        per_row = (output[:, 0] - (gamma * y + (1 - gamma) * y[partners])) ** 2
    assert report.metrics == {"loss": pytest.approx(per_row.mean().item(), rel=1e-5)}
    assert report.num_samples == 6


def test_the_mixed_loss_report_repeats_for_a_seed_and_is_not_the_plain_loss() -> None:
    silo = agent()
    first, again = (mixed_report(silo, mixup_alpha=1.0, seed=1) for _ in range(2))
    other_seed = mixed_report(silo, mixup_alpha=1.0, seed=2)
    assert first.metrics == again.metrics != other_seed.metrics
    assert first.metrics != mixed_report(silo).metrics
    assert mixed_report(silo, mixup_alpha=None, seed=1).metrics == mixed_report(silo).metrics


def test_a_mixed_loss_report_needs_a_seed() -> None:
    silo = agent()
    with pytest.raises(ValueError, match="needs a seed"):
        run(silo, LossProbe(mixup_alpha=1.0), initial(silo))


def test_under_dp_the_mixed_loss_leaves_clipped_and_noised_like_the_plain_loss() -> None:
    bound, sigma = 0.5, 2.0
    privacy = {**DP_SGD, "reports": {"noise_multiplier": sigma, "loss_bound": bound}}
    silo, exact_silo = agent(privacy), agent()
    noisy = mixed_report(silo, mixup_alpha=1.0, seed=5)
    # The exact mixed losses per row, clipped to the bound, plus the silo's report noise of
    # std sigma * bound / n (the generator the task's reports draw from).
    init = initial(exact_silo)
    x, y = exact_silo.context.split("train")
    partners, gamma = MixupDraws(1.0, seed=5, n=200).draw(200)
    model, rows = exact_silo.context.new_model(seed=0), torch.arange(200)
    with torch.no_grad():
        per_row = mixed_losses("classification", model, x, y, rows, partners, gamma)
    assert per_row.max() > bound  # so the clipping shows
    generator = silo.context.noise_generator(LOSS_TASK, "reports")
    noise = torch.normal(0.0, sigma * bound / 200, (1,), dtype=torch.float64, generator=generator)
    expected = per_row.double().clamp(0, bound).mean() + noise
    assert noisy.metrics["loss"] == pytest.approx(expected.item(), rel=1e-6)

    def releases(**config: object) -> list:
        message = TaskMessage("t", 1, "loss", "a", LossProbe(**config), init.tensors, init.spec)
        return loss_releases(message, silo.context)

    assert releases(mixup_alpha=1.0, seed=5) == releases()
