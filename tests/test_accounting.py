"""Privacy accounting: a `Mechanism` describes one release, `epsilon` composes a deployment's
releases with Opacus' accountants, exactly as Opacus itself would."""

import math
import warnings

import pytest
from opacus.accountants import PRVAccountant, RDPAccountant

from fedsilo.privacy.accounting import (
    AccountingError,
    Mechanism,
    epsilon,
    quiet_optimal_order,
    would_reach,
)

DELTA = 1e-5


def dp_sgd(steps: int = 1000, noise: float = 1.0, rate: float = 0.01) -> Mechanism:
    return Mechanism.dp_sgd(
        noise_multiplier=noise, sample_rate=rate, steps=steps, max_grad_norm=1.0
    )


def opacus_epsilon(accountant: RDPAccountant | PRVAccountant, history: list) -> float:
    accountant.history = history
    return accountant.get_epsilon(DELTA)


def test_dp_sgd_epsilon_is_opacus_rdp_epsilon() -> None:
    expected = opacus_epsilon(RDPAccountant(), [(1.0, 0.01, 1000)])
    assert epsilon([dp_sgd()], DELTA) == expected
    assert 1.5 < expected < 3  # the textbook order of magnitude for these settings


def test_dp_sgd_epsilon_is_what_opacus_books_step_by_step() -> None:
    stepped = RDPAccountant()
    for _ in range(1000):
        stepped.step(noise_multiplier=1.0, sample_rate=0.01)
    assert epsilon([dp_sgd()], DELTA, "rdp") == stepped.get_epsilon(DELTA)


def test_prv_accountant_is_opacus_prv() -> None:
    expected = opacus_epsilon(PRVAccountant(), [(1.0, 0.01, 200)])
    assert epsilon([dp_sgd(steps=200)], DELTA, "prv") == expected
    assert expected < epsilon([dp_sgd(steps=200)], DELTA, "rdp")  # PRV is the tighter bound


def test_a_gaussian_release_is_one_full_batch_step_with_noise_multiplier_std_over_sensitivity() -> (
    None
):
    release = Mechanism.gaussian(sensitivity=2.0, noise_std=4.0)
    assert release.history_entry() == (2.0, 1.0, 1)
    assert epsilon([release], DELTA) == opacus_epsilon(RDPAccountant(), [(2.0, 1.0, 1)])
    assert epsilon([release], DELTA) == epsilon([dp_sgd(steps=1, noise=2.0, rate=1.0)], DELTA)


def test_client_level_dp_with_sampled_silos_costs_less_than_with_every_silo() -> None:
    sampled = Mechanism.gaussian(sensitivity=1.0, noise_std=1.0, sample_rate=0.1)
    every = Mechanism.gaussian(sensitivity=1.0, noise_std=1.0)
    assert 0 < epsilon([sampled], DELTA) < epsilon([every], DELTA)


def test_epsilon_grows_with_every_step() -> None:
    values = [epsilon([dp_sgd(steps=steps)], DELTA) for steps in (1, 10, 100, 1000, 5000)]
    assert values == sorted(values)
    assert len(set(values)) == len(values)


def test_composition_costs_more_than_either_release_and_ignores_order() -> None:
    training, report = dp_sgd(steps=100), Mechanism.gaussian(sensitivity=1.0, noise_std=3.0)
    both = epsilon([training, report], DELTA)
    assert both > max(epsilon([training], DELTA), epsilon([report], DELTA))
    assert epsilon([report, training], DELTA) == both


def test_a_run_split_in_two_costs_the_same_as_one_run() -> None:
    assert epsilon([dp_sgd(steps=400), dp_sgd(steps=600)], DELTA) == epsilon([dp_sgd()], DELTA)


def test_nothing_released_costs_nothing() -> None:
    assert epsilon([], DELTA) == 0.0
    assert epsilon([], DELTA, "prv") == 0.0


def test_a_release_without_noise_makes_epsilon_infinite() -> None:
    assert epsilon([Mechanism.none()], DELTA) == math.inf
    assert epsilon([dp_sgd(), Mechanism.none()], DELTA, "prv") == math.inf


def test_a_release_that_does_not_depend_on_the_data_costs_nothing() -> None:
    assert epsilon([Mechanism.public()], DELTA) == 0.0
    with_public = epsilon([dp_sgd(), Mechanism.public()], DELTA, "prv")
    assert with_public == epsilon([dp_sgd()], DELTA, "prv")


def test_k_scalar_reports_at_one_noise_multiplier_compose_as_one_gaussian_at_sigma_over_root_k():
    """Why a task's k noisy scalars are booked as one release of sensitivity sqrt(k)."""
    sigma, k = 4.0, 3
    one_by_one = [Mechanism.gaussian(sensitivity=1.0, noise_std=sigma)] * k
    together = Mechanism.gaussian(sensitivity=math.sqrt(k), noise_std=sigma)
    assert epsilon([together], DELTA) == pytest.approx(epsilon(one_by_one, DELTA), rel=1e-6)


def test_would_reach_is_the_epsilon_of_booked_and_extra_together() -> None:
    booked = [dp_sgd(steps=100), Mechanism.gaussian(sensitivity=1.0, noise_std=2.0)]
    extra = [dp_sgd(steps=50, noise=1.3)]
    assert would_reach(booked, extra, DELTA) == epsilon([*booked, *extra], DELTA)
    assert would_reach(booked, [], DELTA) == epsilon(booked, DELTA)


def test_epsilon_is_deterministic() -> None:
    releases = [dp_sgd(steps=300), Mechanism.gaussian(sensitivity=1.0, noise_std=2.0)]
    for accountant in ("rdp", "prv"):
        assert epsilon(releases, DELTA, accountant) == epsilon(list(releases), DELTA, accountant)


@pytest.mark.parametrize(
    "mechanism",
    [
        dp_sgd(),
        Mechanism.gaussian(sensitivity=0.5, noise_std=2.0, sample_rate=0.2),
        Mechanism.none(),
        Mechanism.public(),
    ],
)
def test_mechanisms_round_trip_through_json(mechanism: Mechanism) -> None:
    assert Mechanism.from_json(mechanism.to_json()) == mechanism


def test_json_holds_only_the_parameters_of_the_kind() -> None:
    assert dp_sgd().to_json() == {
        "kind": "dp_sgd",
        "noise_multiplier": 1.0,
        "sample_rate": 0.01,
        "steps": 1000,
        "max_grad_norm": 1.0,
    }
    assert Mechanism.gaussian(sensitivity=1, noise_std=2).to_json() == {
        "kind": "gaussian",
        "sensitivity": 1.0,
        "noise_std": 2.0,
        "sample_rate": 1.0,
    }
    assert Mechanism.none().to_json() == {"kind": "none"}


def test_whole_numbers_are_kept_as_floats() -> None:
    mechanism = Mechanism.dp_sgd(noise_multiplier=1, sample_rate=1, steps=3, max_grad_norm=2)
    written = mechanism.to_json()
    assert [type(written[k]) for k in ("noise_multiplier", "sample_rate", "max_grad_norm")] == [
        float
    ] * 3
    assert type(written["steps"]) is int


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: dp_sgd(rate=0.0), "sample_rate"),
        (lambda: dp_sgd(rate=1.5), "sample_rate"),
        (lambda: dp_sgd(noise=0.0), "noise_multiplier"),
        (lambda: dp_sgd(noise=-1.0), "noise_multiplier"),
        (lambda: dp_sgd(noise=math.nan), "noise_multiplier"),
        (lambda: dp_sgd(noise=math.inf), "noise_multiplier"),
        (lambda: dp_sgd(steps=0), "steps"),
        (lambda: Mechanism("dp_sgd", 1.0, 0.1, 1.5, 1.0), "steps"),
        (lambda: Mechanism("dp_sgd", 1.0, 0.1, True, 1.0), "steps"),
        (lambda: Mechanism("dp_sgd", 1.0, 0.1, 10), "max_grad_norm"),
        (lambda: Mechanism.gaussian(sensitivity=0.0, noise_std=1.0), "sensitivity"),
        (lambda: Mechanism.gaussian(sensitivity=1.0, noise_std="1"), "noise_std"),
        (
            lambda: Mechanism("gaussian", sample_rate=1.0, steps=3, sensitivity=1.0, noise_std=1.0),
            "steps",
        ),
        (lambda: Mechanism("none", noise_multiplier=1.0), "noise_multiplier"),
        (lambda: Mechanism("laplace"), "laplace"),
    ],
)
def test_invalid_mechanisms_are_refused_naming_the_parameter(build, message: str) -> None:
    with pytest.raises(AccountingError, match=message):
        build()


@pytest.mark.parametrize(
    "data",
    [
        {"kind": "dp_sgd", "noise_multiplier": 1.0, "sample_rate": 0.1, "steps": 5},
        {"kind": "none", "steps": 1},
        {"kind": "gaussian", "sensitivity": 1.0, "noise_std": 1.0, "sample_rate": 1.0, "x": 1},
        {"noise_multiplier": 1.0},
        ["dp_sgd"],
    ],
)
def test_from_json_refuses_missing_or_unknown_parameters(data) -> None:
    with pytest.raises(AccountingError):
        Mechanism.from_json(data)


@pytest.mark.parametrize(
    ("delta", "accountant", "message"),
    [
        (0.0, "rdp", "delta"),
        (1.0, "rdp", "delta"),
        ("1e-5", "rdp", "delta"),
        (DELTA, "gdp", "accountant"),
    ],
)
def test_invalid_delta_or_accountant_is_refused(delta, accountant: str, message: str) -> None:
    with pytest.raises(AccountingError, match=message):
        epsilon([dp_sgd()], delta, accountant)


def test_only_mechanisms_are_accounted() -> None:
    with pytest.raises(AccountingError, match="not a Mechanism"):
        epsilon([(1.0, 0.01, 1000)], DELTA)


@pytest.mark.parametrize(
    ("mechanism", "order"),
    [
        (Mechanism.gaussian(sensitivity=1.0, noise_std=50.0), "largest"),
        (
            Mechanism.dp_sgd(noise_multiplier=0.3, sample_rate=0.5, steps=1000, max_grad_norm=1),
            "smallest",
        ),
    ],
)
def test_opacus_optimal_order_warning_is_silenced_where_epsilon_is_computed(
    mechanism: Mechanism, order: str
) -> None:
    composer = RDPAccountant()
    composer.history = [mechanism.history_entry()]
    with pytest.warns(UserWarning, match=f"Optimal order is the {order} alpha"):
        expected = composer.get_epsilon(1e-5)  # Opacus itself warns
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning left would fail here
        assert epsilon([mechanism], 1e-5) == expected


def test_only_that_warning_is_silenced() -> None:
    with pytest.warns(UserWarning, match="another"), quiet_optimal_order():
        warnings.warn("another", UserWarning, stacklevel=1)
