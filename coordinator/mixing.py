"""Mixing coefficients learned from silo losses: the shared mathematics of DRFA, DRFLM, AFL,
AgnosticFedAvg, q-FedAvg, TERM, PropFair, AAggFF-S and AAggFF-D.

This module owns the pure numerical primitives those strategies share, in float64 numpy:

* simplex geometry: the sort-based Euclidean projection;
* the loss guards and the collapse guards: loss clipping, the lambda floor, sampling with a
  uniform share, the minimum number of distinct contributors;
* the lambda updates: projected loss ascent (AFL, DRFA/DRFLM) and the exponentiated-gradient
  step (AgnosticFedAvg);
* AAggFF: the CDF response transforms, the decision gradient, the dependency-free simplex QP
  solver, the AAggFF-S (ONS as FTRL-QP) and AAggFF-D (entropic FTRL with a doubly-robust,
  linearised gradient) steps, and the stateless unified-table weights of q-FedAvg, TERM and
  PropFair.

docs/algorithms/README.md ("Shared mixing machinery") and docs/algorithms/aaggff.md state the
formulas and why each guard is there.

Every function is pure: arrays in, new arrays out. Strategies hold the state; where an update
needs one (AAggFF), it is a frozen dataclass with `to_json`/`from_json` for the coordinator's
state store and a `..._step(state, losses, ...) -> (new_state, aggregation_weights)` function.
A non-finite loss marks a silo that did not report (a dropout): the steps accept such
entries and treat them as absent; everything else rejects non-finite input.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, NamedTuple

import numpy as np

# ---------------------------------------------------------------------------------------------
# Validation helpers


def _vector(values: Any, name: str, *, allow_missing: bool = False) -> np.ndarray:
    """`values` as a new 1-D float64 array; non-finite entries only if `allow_missing`."""
    array = np.array(values, dtype=np.float64)
    if array.ndim != 1 or array.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D vector, got shape {array.shape}")
    if not allow_missing and not np.all(np.isfinite(array)):
        raise ValueError(f"{name} has non-finite entries: {array}")
    return array


def _distribution(values: Any, name: str) -> np.ndarray:
    """Non-negative `values` with a positive sum, normalised to sum to 1."""
    array = _vector(values, name)
    if np.any(array < 0) or array.sum() <= 0:
        raise ValueError(f"{name} must be non-negative with a positive sum, got {array}")
    return array / array.sum()


def _normalise_log_weights(log_weights: np.ndarray) -> np.ndarray:
    """exp(log_weights) / sum, computed stably (log-sum-exp); -inf entries get weight 0."""
    shifted = np.exp(log_weights - np.max(log_weights))
    return shifted / shifted.sum()


def _log(values: np.ndarray) -> np.ndarray:
    """Elementwise log with log(0) = -inf and no warning."""
    with np.errstate(divide="ignore"):
        return np.log(values)


# ---------------------------------------------------------------------------------------------
# Simplex geometry (docs/algorithms/README.md, "Simplex projection")


def project_simplex(v: Any) -> np.ndarray:
    """The Euclidean projection of `v` onto the probability simplex (Duchi et al. 2008; the
    same as R-FedTorch `projection_simplex_sort`).

    Sort-based and O(K log K). Ties need no special care: the threshold theta is a function of
    the sorted values only. Rejects non-finite input (one NaN corrupts the sort).
    """
    values = _vector(v, "v")
    ordered = np.sort(values)[::-1]
    excess = np.cumsum(ordered) - 1.0
    ranks = np.arange(1, values.size + 1)
    rho = np.flatnonzero(ordered - excess / ranks > 0)[-1]
    theta = excess[rho] / (rho + 1)
    return np.maximum(values - theta, 0.0)


def restrict_and_renormalise(weights: Any, mask: Any) -> np.ndarray:
    """`weights` restricted to the silos in `mask` and renormalised over them; 0 elsewhere
    (aggregate over the silos that actually returned updates: docs/algorithms/aaggff.md,
    "Aggregating with p").

    Negative entries count as 0 (clamp at 0 and renormalise). If the selected
    silos hold no mass at all, they share it uniformly: there is then no preference among them
    to preserve. `mask` must select at least one silo.
    """
    values = _vector(weights, "weights")
    selected = np.asarray(mask, dtype=bool)
    if selected.shape != values.shape or not selected.any():
        raise ValueError("mask must select at least one of the weights")
    restricted = np.where(selected, np.maximum(values, 0.0), 0.0)
    if restricted.sum() <= 0:
        restricted = selected.astype(np.float64)
    return restricted / restricted.sum()


# ---------------------------------------------------------------------------------------------
# Robustness guards (docs/algorithms/README.md, "Loss guards" and "Collapse guards")


def clip_losses(losses: Any, loss_cap: float) -> np.ndarray:
    """Losses clipped to [0, L_max] before they feed a mixture-weight update.

    Non-finite entries come back as NaN: a non-finite payload is a dropout, not a huge loss.
    """
    if not loss_cap > 0:
        raise ValueError(f"loss_cap must be positive, got {loss_cap}")
    values = _vector(losses, "losses", allow_missing=True)
    return np.where(np.isfinite(values), np.clip(values, 0.0, loss_cap), np.nan)


def default_loss_cap(first_round_losses: Any, factor: float = 10.0) -> float:
    """The default L_max: `factor` (10) times the median finite first-round loss."""
    values = _vector(first_round_losses, "first_round_losses", allow_missing=True)
    finite = values[np.isfinite(values)]
    cap = factor * float(np.median(finite)) if finite.size else 0.0
    if not cap > 0:
        raise ValueError("the first-round losses give no positive L_max; configure one")
    return cap


def loss_cap(configured: float | None, first_losses: Any) -> float:
    """L_max, fixed when the first losses arrive: the policy's, else `default_loss_cap` of
    those losses."""
    return configured if configured is not None else default_loss_cap(first_losses)


def proportional_to_counts(counts: Any) -> np.ndarray:
    """A starting lambda proportional to the silos' released sample counts; a silo without a
    positive count gets the mean positive count (every silo 1 when none has one)."""
    values = np.asarray(counts, dtype=np.float64)
    seen = values > 0
    filled = np.where(seen, values, values[seen].mean() if seen.any() else 1.0)
    return filled / filled.sum()


def floor_and_renormalise(lam: Any, floor: float) -> np.ndarray:
    """The lambda floor of DRFA's reference code (FedTorch): lambda <- max(lambda, floor), then
    lambda <- lambda / sum(lambda).

    As there, the floor applies before the renormalisation, so afterwards every
    entry is at least floor / (1 + K floor): no silo's weight reaches 0 and lambda cannot
    collapse onto one silo. `floor` = 0 only renormalises.
    """
    if not 0 <= floor <= 1:
        raise ValueError(f"floor must lie in [0, 1], got {floor}")
    return _distribution(np.maximum(_vector(lam, "lam"), floor), "lam")


def mix_with_uniform(lam: Any, epsilon: float) -> np.ndarray:
    """(1 - epsilon) lambda + epsilon / K: the distribution DRFA draws its training silos from
    under the collapse mitigation (epsilon = 0.1 by default); every silo keeps at
    least epsilon / K."""
    if not 0 <= epsilon <= 1:
        raise ValueError(f"epsilon must lie in [0, 1], got {epsilon}")
    weights = _distribution(lam, "lam")
    return (1.0 - epsilon) * weights + epsilon / weights.size


def meets_contributor_minimum(multiplicities: Any, t_min: int = 3) -> bool:
    """Whether at least `t_min` distinct silos have a positive weight or multiplicity
    (aggregating fewer than t_min >= 2 distinct silos, 3 recommended, protects nothing;
    the coordinator must re-sample or skip the round instead)."""
    if t_min < 2:
        raise ValueError(f"t_min must be at least 2, got {t_min}")
    return int(np.count_nonzero(_vector(multiplicities, "multiplicities") > 0)) >= t_min


# ---------------------------------------------------------------------------------------------
# Lambda updates: projected loss ascent (AFL, DRFA, DRFLM) and exponentiated gradient


def unbiased_loss_vector(losses: Any, loss_cap: float) -> np.ndarray:
    """DRFA's v, and AFL's partial-observation unbiasing (docs/algorithms/README.md): for the
    silos that reported a finite loss (U'), v_k = (K / |U'|) clip(loss_k, 0, L_max); 0 for the
    others.

    With U' a uniform draw of fixed size, E[v_k] = clip(loss_k): an unbiased estimate of the
    lambda-gradient (f_1, ..., f_K). Needs at least one finite loss.
    """
    clipped = clip_losses(losses, loss_cap)
    reported = np.isfinite(clipped)
    if not reported.any():
        raise ValueError("no silo reported a finite loss")
    return np.where(reported, clipped * clipped.size / reported.sum(), 0.0)


def projected_loss_ascent(
    lam: Any, losses: Any, step: float, loss_cap: float, floor: float = 0.0
) -> np.ndarray:
    """One lambda step of AFL and DRFA/DRFLM (docs/algorithms/afl.md, drfa.md):
    lambda <- proj_simplex(lambda + step v), v = `unbiased_loss_vector`, then the floor.

    Ascent: lambda moves toward the silos with the larger losses. DRFA passes
    step = gamma_s tau and floor = 1e-3; AFL passes gamma_lambda and no floor. Absent
    silos carry a non-finite loss; if none reported, lambda is returned unchanged.
    """
    weights = _vector(lam, "lam")
    if not np.any(np.isfinite(_vector(losses, "losses", allow_missing=True))):
        return weights
    ascended = project_simplex(weights + step * unbiased_loss_vector(losses, loss_cap))
    return floor_and_renormalise(ascended, floor)


def exponentiated_gradient(
    lam: Any, gradient: Any, step: float, observed: Any | None = None
) -> np.ndarray:
    """The exponentiated-gradient (multiplicative-weights) ascent step of AgnosticFedAvg
    and of the unified table (docs/algorithms/aaggff.md, "The unified table"):
    lambda_i <- lambda_i exp(step g_i) / sum_j lambda_j exp(step g_j).

    A positive step moves mass toward the larger entries of
    `gradient` (the losses). Computed in log space (log-sum-exp), so large step g cannot
    overflow; a zero entry of lambda stays 0. With `observed`, only the observed
    entries move: they are reweighted among themselves and keep their total mass, the others
    are unchanged and their gradient entries are ignored (they may be NaN).
    """
    weights = _distribution(lam, "lam")
    selected = np.ones(weights.size, dtype=bool) if observed is None else np.asarray(observed, bool)
    values = _vector(gradient, "gradient", allow_missing=True)
    if selected.shape != weights.shape or values.shape != weights.shape:
        raise ValueError("lam, gradient and observed must have the same length")
    if not np.all(np.isfinite(values[selected])):
        raise ValueError(f"gradient has non-finite observed entries: {values}")
    mass = weights[selected].sum()
    if mass <= 0:
        return weights
    updated = weights.copy()
    updated[selected] = mass * _normalise_log_weights(
        _log(weights[selected]) + step * values[selected]
    )
    return updated


# ---------------------------------------------------------------------------------------------
# Unified table of stateless fair aggregators (docs/algorithms/aaggff.md, "The unified table")


def qfedavg_weights(losses: Any, sizes: Any, q: float) -> np.ndarray:
    """q-FedAvg's mixing coefficients, p_i proportional to (n_i/n) F_i^q (the unified table):
    EG from the prior n_i/n with response log F_i and step q. q = 0 gives FedAvg's n_i/n.

    A zero loss gets weight 0 when q > 0; if every loss is 0 the silos are equal and the
    weights are n_i/n (the limit of equal losses).
    """
    if not q >= 0:
        raise ValueError(f"q must be non-negative, got {q}")
    prior = _distribution(sizes, "sizes")
    values = _vector(losses, "losses")
    if values.shape != prior.shape or np.any(values < 0):
        raise ValueError("losses must be non-negative and match sizes")
    if q > 0:
        log_weights = _log(prior) + q * _log(values)
        if np.any(np.isfinite(log_weights)):
            return _normalise_log_weights(log_weights)
    return prior


def term_weights(losses: Any, sizes: Any, tilt: float) -> np.ndarray:
    """TERM's mixing coefficients, p_i proportional to (n_i/n) exp(tau F_i) (the unified table): EG
    from n_i/n with response F_i and step tau. tau = 0 gives FedAvg; tau < 0 down-weights
    the high-loss silos (TERM's outlier-robust tilt)."""
    prior = _distribution(sizes, "sizes")
    return exponentiated_gradient(prior, losses, tilt)


def propfair_weights(losses: Any, sizes: Any, baseline: float) -> np.ndarray:
    """PropFair's mixing coefficients, p_i proportional to (n_i/n) / (M - F_i) (the unified table):
    EG from n_i/n with response -log(M - F_i) and step 1. Needs every F_i < M; as M grows the
    weights tend to n_i/n, and equal losses give n_i/n exactly."""
    prior = _distribution(sizes, "sizes")
    values = _vector(losses, "losses")
    if np.any(values >= baseline):
        raise ValueError(f"PropFair needs every loss below the baseline M = {baseline}")
    return exponentiated_gradient(prior, -np.log(baseline - values), 1.0)


# ---------------------------------------------------------------------------------------------
# AAggFF responses and decision loss (docs/algorithms/aaggff.md, "Responses", "Decision loss")

_TINY = 1e-12  # the floor of the mean loss and of the Fréchet input
_erf = np.vectorize(math.erf, otypes=[np.float64])


def _weibull(x: np.ndarray) -> np.ndarray:
    return 1.0 - np.exp(-(x**2))


def _exponential(x: np.ndarray) -> np.ndarray:
    return 1.0 - np.exp(-x)


def _frechet(x: np.ndarray) -> np.ndarray:
    return np.exp(-1.0 / np.maximum(x, _TINY))


def _normal(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + _erf((x - 1.0) / math.sqrt(2.0)))


def _gumbel(x: np.ndarray) -> np.ndarray:
    return np.exp(-np.exp(-(x - 1.0)))


def _logistic(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-(x - 1.0)))


RESPONSE_TRANSFORMS: Mapping[str, Callable[[np.ndarray], np.ndarray]] = MappingProxyType(
    {
        "weibull": _weibull,  # Weibull(k=2, lambda=1): 1 - exp(-x^2)        (--fair_const 0)
        "exponential": _exponential,  # Exponential(1): 1 - exp(-x)          (--fair_const 1)
        "frechet": _frechet,  # Fréchet(alpha=1, s=1, m=0): exp(-1/x)        (--fair_const 2)
        "normal": _normal,  # Normal(1, 1): Phi(x - 1)                       (--fair_const 3)
        "gumbel": _gumbel,  # Gumbel(1, 1): exp(-exp(-(x - 1)))              (--fair_const 4)
        "logistic": _logistic,  # Logistic(1, 1): 1 / (1 + exp(-(x - 1)))   (--fair_const 5)
    }
)
"""The CDF response transforms (Hahn 2024, Def. 3.4), by name; inputs centred at 1."""


def cdf_responses(losses: Any, transform: str, upper: float, lower: float = 0.0) -> np.ndarray:
    """AAggFF's responses: x_i = loss_i / mean(losses), u_i = F(x_i) with F the
    named CDF, r_i = lower + (upper - lower) u_i. AAggFF-S uses [0, 1/K], AAggFF-D [0, q].

    `losses` are the observed silos' losses only. If their mean is at most 1e-12 (all zero),
    every x_i is 1.
    """
    if transform not in RESPONSE_TRANSFORMS:
        raise ValueError(f"unknown transform {transform!r}; known: {sorted(RESPONSE_TRANSFORMS)}")
    values = _vector(losses, "losses")
    if np.any(values < 0):
        raise ValueError(f"losses must be non-negative, got {values}")
    mean = values.mean()
    centred = values / mean if mean > _TINY else np.ones_like(values)
    return lower + (upper - lower) * RESPONSE_TRANSFORMS[transform](centred)


def decision_gradient(p: Any, responses: Any) -> np.ndarray:
    """The gradient of the decision loss in p: -r / (1 + <p, r>)."""
    weights, values = _vector(p, "p"), _vector(responses, "responses")
    return -values / (1.0 + float(np.dot(weights, values)))


# ---------------------------------------------------------------------------------------------
# The simplex QP and AAggFF-S (docs/algorithms/aaggff.md, "AAggFF-S")


class QPSolution(NamedTuple):
    weights: np.ndarray
    converged: bool
    iterations: int


def solve_simplex_qp(
    quadratic: Any,
    linear: Any,
    start: Any | None = None,
    max_iterations: int = 5000,
    tolerance: float = 1e-12,
) -> QPSolution:
    """argmin over the simplex of (1/2) p^T Q p + c^T p, for symmetric positive-definite Q
    (the dependency-free solver): FISTA with step 1/lambda_max(Q), warm-started at
    `start` (projected; uniform if absent), stopping when an iterate moves less than
    `tolerance` in L1. The result is clamped at 0 and renormalised.
    """
    q_matrix = np.array(quadratic, dtype=np.float64)
    c = _vector(linear, "linear")
    if q_matrix.shape != (c.size, c.size) or not np.all(np.isfinite(q_matrix)):
        raise ValueError(f"quadratic must be a finite {c.size}x{c.size} matrix")
    lipschitz = float(np.linalg.eigvalsh(q_matrix)[-1])
    p = project_simplex(start) if start is not None else np.full(c.size, 1.0 / c.size)
    z, momentum = p, 1.0
    for iteration in range(1, max_iterations + 1):
        p_next = project_simplex(z - (q_matrix @ z + c) / lipschitz)
        momentum_next = 0.5 * (1.0 + math.sqrt(1.0 + 4.0 * momentum**2))
        z = p_next + ((momentum - 1.0) / momentum_next) * (p_next - p)
        moved = float(np.abs(p_next - p).sum())
        p, momentum = p_next, momentum_next
        if moved < tolerance:
            return QPSolution(_distribution(np.maximum(p, 0.0), "p"), True, iteration)
    return QPSolution(_distribution(np.maximum(p, 0.0), "p"), False, max_iterations)


def _frozen(values: Any, name: str, size: int | None = None, ndim: int = 1) -> np.ndarray:
    """A read-only finite float64 copy of `values`: a vector, or a size x size matrix."""
    array = np.array(values, dtype=np.float64)
    if size is None:
        size = array.shape[0] if array.ndim == 1 and array.size else -1
    shape = (size,) * ndim
    if array.shape != shape or not np.all(np.isfinite(array)):
        raise ValueError(f"{name} must be a finite array of shape {shape}, got {array.shape}")
    array.setflags(write=False)
    return array


@dataclass(frozen=True, eq=False)
class AAggFFSState:
    """AAggFF-S's server state: the decision p, G = sum of the decision
    gradients, H = alpha I + sum g g^T, and the ONS constants alpha and beta. Read-only arrays.
    """

    weights: np.ndarray
    cumulative_gradient: np.ndarray
    hessian: np.ndarray
    alpha: float
    beta: float

    def __post_init__(self) -> None:
        weights = _frozen(self.weights, "weights")
        gradient = _frozen(self.cumulative_gradient, "cumulative_gradient", weights.size)
        hessian = _frozen(self.hessian, "hessian", weights.size, ndim=2)
        object.__setattr__(self, "weights", weights)
        object.__setattr__(self, "cumulative_gradient", gradient)
        object.__setattr__(self, "hessian", hessian)
        if not (self.alpha > 0 and self.beta > 0):
            raise ValueError("alpha and beta must be positive")

    @classmethod
    def initial(cls, num_silos: int) -> AAggFFSState:
        """p uniform, G = 0, H = alpha I, with the reference code's constants:
        L = 1/K, alpha = 4 K L = 4, beta = 1/(4 L) = K/4."""
        if num_silos < 1:
            raise ValueError("AAggFF-S needs at least one silo")
        lipschitz = 1.0 / num_silos
        alpha, beta = 4.0 * num_silos * lipschitz, 1.0 / (4.0 * lipschitz)
        return cls(
            weights=np.full(num_silos, 1.0 / num_silos),
            cumulative_gradient=np.zeros(num_silos),
            hessian=alpha * np.eye(num_silos),
            alpha=alpha,
            beta=beta,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "weights": self.weights.tolist(),
            "cumulative_gradient": self.cumulative_gradient.tolist(),
            "hessian": self.hessian.tolist(),
            "alpha": self.alpha,
            "beta": self.beta,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> AAggFFSState:
        """The inverse of `to_json`."""
        return cls(**{key: data[key] for key in cls.__dataclass_fields__})


def _responders(losses: np.ndarray) -> np.ndarray:
    """The silos that reported a finite loss; a round needs at least one."""
    responded = np.isfinite(losses)
    if not responded.any():
        raise ValueError("no silo reported a finite loss; there is nothing to aggregate")
    return responded


def aaggff_s_step(
    state: AAggFFSState, losses: Any, transform: str
) -> tuple[AAggFFSState, np.ndarray]:
    """One AAggFF-S round: from this round's losses (one per silo,
    evaluated on theta_t; non-finite = did not respond) to the next state and the weights that
    aggregate this round's updates (p_{t+1} renormalised over the responders).

    r = `cdf_responses` in [0, 1/K] over the responders; a missing silo's response is the
    responders' mean. Then g = -r / (1 + <p, r>), G += g, H += g g^T and
    p_{t+1} = argmin_simplex <G, p> + (1/2) p^T (alpha I + beta H) p. With fewer than two
    responders, or K = 1, or if the solver does not converge, p is kept.
    """
    values = _vector(losses, "losses", allow_missing=True)
    size = state.weights.size
    if values.size != size:
        raise ValueError(f"expected {size} losses, got {values.size}")
    responded = _responders(values)
    if size == 1 or responded.sum() < 2:
        return state, restrict_and_renormalise(state.weights, responded)
    observed = cdf_responses(values[responded], transform, upper=1.0 / size)
    responses = np.full(size, observed.mean())
    responses[responded] = observed
    gradient = decision_gradient(state.weights, responses)
    cumulative = state.cumulative_gradient + gradient
    hessian = state.hessian + np.outer(gradient, gradient)
    solution = solve_simplex_qp(
        state.alpha * np.eye(size) + state.beta * hessian, cumulative, start=state.weights
    )
    weights = solution.weights if solution.converged else state.weights
    new_state = AAggFFSState(weights, cumulative, hessian, state.alpha, state.beta)
    return new_state, restrict_and_renormalise(weights, responded)


# ---------------------------------------------------------------------------------------------
# AAggFF-D (docs/algorithms/aaggff.md, "AAggFF-D")


def doubly_robust_responses(
    responses: Any, observed: Any, probability: float, imputation: float
) -> np.ndarray:
    """The doubly-robust response estimate (Hahn 2024, Lemma 3.2):
    r_hat_j = m + 1[j observed] (r_j - m) / q, with m the imputation and q = P(j observed).

    Unbiased, E[r_hat] = r over the sampling, when m does not depend on which silos were drawn.
    AAggFF-D passes m = the observed mean (the thesis' choice), which does depend on the draw:
    then E[r_hat_j] = r_j + (K - m_size)(mean(r) - r_j) / (m_size (K - 1)) for uniform draws of
    m_size silos without replacement. Unobserved entries of `responses` are ignored (they may be
    NaN).
    """
    if not 0 < probability <= 1:
        raise ValueError(f"probability must lie in (0, 1], got {probability}")
    values = _vector(responses, "responses", allow_missing=True)
    selected = np.asarray(observed, dtype=bool)
    if selected.shape != values.shape or not np.all(np.isfinite(values[selected])):
        raise ValueError("observed responses must be finite and match the mask")
    correction = np.where(selected, values, imputation) - imputation
    return imputation + correction / probability


def linearised_gradient(p: Any, responses: Any, reference: Any) -> np.ndarray:
    """The decision gradient -r / (1 + <p, r>) linearised in r around `reference` r0
    (Hahn 2024, Lemma 3.3): -r / a + r0 <p, r - r0> / a^2 with a = 1 + <p, r0>.

    AAggFF-D uses r0 = r_bar 1 (then r0 <p, .> is the thesis' 1 r_bar <p, .>). Being linear in
    r, it is unbiased for the linearised gradient wherever r is (for a fixed reference).
    """
    weights = _vector(p, "p")
    values, centre = _vector(responses, "responses"), _vector(reference, "reference")
    scale = 1.0 + float(np.dot(weights, centre))
    return -values / scale + centre * float(np.dot(weights, values - centre)) / scale**2


def aaggff_d_step_size(round_index: int, num_clients: int, sampling_fraction: float) -> float:
    """AAggFF-D's FTRL step in round t (1-based), as the reference code:
    eta_t = sqrt(ln K) / (L_inf sqrt(t + 1)) with L_inf = 2 + q."""
    if round_index < 1:
        raise ValueError("rounds are 1-based")
    lipschitz = 2.0 + sampling_fraction
    return math.sqrt(math.log(num_clients)) / (lipschitz * math.sqrt(round_index + 1))


@dataclass(frozen=True, eq=False)
class AAggFFDState:
    """AAggFF-D's server state: the decision p, G = sum of the linearised
    gradients, the number of rounds applied, and q = P(a client is sampled in a round)."""

    weights: np.ndarray
    cumulative_gradient: np.ndarray
    rounds: int
    sampling_fraction: float

    def __post_init__(self) -> None:
        weights = _frozen(self.weights, "weights")
        gradient = _frozen(self.cumulative_gradient, "cumulative_gradient", weights.size)
        object.__setattr__(self, "weights", weights)
        object.__setattr__(self, "cumulative_gradient", gradient)
        if self.rounds < 0 or not 0 < self.sampling_fraction <= 1:
            raise ValueError("rounds must be >= 0 and the sampling fraction in (0, 1]")

    @classmethod
    def initial(cls, num_clients: int, sampling_fraction: float) -> AAggFFDState:
        """p uniform, G = 0, no rounds yet."""
        if num_clients < 1:
            raise ValueError("AAggFF-D needs at least one client")
        uniform = np.full(num_clients, 1.0 / num_clients)
        return cls(uniform, np.zeros(num_clients), 0, sampling_fraction)

    def to_json(self) -> dict[str, Any]:
        return {
            "weights": self.weights.tolist(),
            "cumulative_gradient": self.cumulative_gradient.tolist(),
            "rounds": self.rounds,
            "sampling_fraction": self.sampling_fraction,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> AAggFFDState:
        """The inverse of `to_json`."""
        return cls(**{key: data[key] for key in cls.__dataclass_fields__})


def aaggff_d_step(
    state: AAggFFDState, losses: Any, transform: str
) -> tuple[AAggFFDState, np.ndarray]:
    """One AAggFF-D round: from the sampled clients' losses (one entry per
    client; non-finite = not sampled or did not respond) to the next state and the weights
    that aggregate this round's updates (p_{t+1} renormalised over the responders).

    r = `cdf_responses` in [0, q] over the responders, r_bar their mean,
    r_hat = `doubly_robust_responses`(r, q, imputation r_bar),
    g = `linearised_gradient`(p, r_hat, r_bar 1) updates every client's coordinate of G,
    and p_{t+1} = softmax(-eta_t G) with eta_t = `aaggff_d_step_size`. K = 1 keeps p = 1.
    """
    values = _vector(losses, "losses", allow_missing=True)
    size = state.weights.size
    if values.size != size:
        raise ValueError(f"expected {size} losses, got {values.size}")
    responded = _responders(values)
    if size == 1:
        return state, restrict_and_renormalise(state.weights, responded)
    q = state.sampling_fraction
    responses = np.full(size, np.nan)
    responses[responded] = cdf_responses(values[responded], transform, upper=q)
    mean = float(responses[responded].mean())
    estimate = doubly_robust_responses(responses, responded, q, mean)
    cumulative = state.cumulative_gradient + linearised_gradient(
        state.weights, estimate, np.full(size, mean)
    )
    rounds = state.rounds + 1
    step = aaggff_d_step_size(rounds, size, q)
    weights = _normalise_log_weights(-step * cumulative)
    new_state = AAggFFDState(weights, cumulative, rounds, q)
    return new_state, restrict_and_renormalise(weights, responded)
