"""The policy's `privacy:` section: how each silo's data is protected, and how it is accounted.

`delta` and `accountant` say how every release of a silo's data is turned into one epsilon
(Opacus' RDP or PRV accountant); `epsilon_cap` is the deployment's per-silo budget, which a
silo's ledger enforces. `dp_sgd` turns on sample-level DP-SGD in every training task;
`client_dp` clips each silo's model update and noises the aggregate (DP-FedAvg). Either (with
distributed noise) makes this a DP deployment: every scalar a silo reports is then clipped and
noised (`reports`). `reports.forbidden` keeps kinds of report at the silos in any deployment.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import Field, field_validator, model_validator

from fedsilo.policies.base import PolicyModel

# The least noise multiplier a mechanism takes: below it the guarantee is void (epsilon in the
# thousands for one release) and the noise's std can underflow to 0 with a small clip bound.
MIN_NOISE_MULTIPLIER = 0.01
# The least delta the PRV accountant resolves: Opacus refuses one below its grid's floating-point
# error (long double epsilon times the grid's size, about 1e-13 for a DP-SGD plan).
MIN_PRV_DELTA = 1e-10


def _meaningful_noise(value: float | None) -> float | None:
    if value is not None and 0 < value < MIN_NOISE_MULTIPLIER:
        raise ValueError(
            f"noise_multiplier {value:g} is below {MIN_NOISE_MULTIPLIER:g}, which leaves no "
            "guarantee (one release alone costs an epsilon in the thousands); raise it"
        )
    return value


class DpSgdConfig(PolicyModel):
    """Sample-level DP-SGD (Opacus): per-sample gradients clipped to `max_grad_norm`, plus
    Gaussian noise of std `noise_multiplier * max_grad_norm` on every step.

    The noise is set by exactly one of: `noise_multiplier`; `training_epsilon`, the epsilon
    of the training alone, to which each silo calibrates its noise so that all of the job's
    training steps together reach it (the job's evaluation reports and probes come on top:
    `fedsilo privacy plan` shows the total); or the policy's `privacy.job_epsilon`, the
    job's total. `target_epsilon` is the former name of `training_epsilon` and is read as it.
    `poisson_sampling`: each sample joins each batch independently (what the accountants
    assume); false keeps shuffled fixed-size batches.
    """

    # the L2 norm each sample's gradient is clipped to before the noise is added; the noise's
    # standard deviation is noise_multiplier times it (1 by default)
    max_grad_norm: float = Field(default=1.0, gt=0)
    # the noise's standard deviation as a multiple of max_grad_norm (at least 0.01); null (the
    # default): training_epsilon or privacy.job_epsilon sets it
    noise_multiplier: float | None = Field(default=None, ge=0)
    # the epsilon the whole job's training may spend at each silo, to which each silo calibrates its
    # noise (evaluation reports and probes come on top); null (the default): noise_multiplier or
    # privacy.job_epsilon sets the noise. Formerly target_epsilon
    training_epsilon: float | None = Field(default=None, gt=0)
    # true (the default): each sample joins each batch independently, as the accountants assume;
    # false keeps shuffled fixed-size batches
    poisson_sampling: bool = True

    _noise = field_validator("noise_multiplier")(_meaningful_noise)

    @model_validator(mode="before")
    @classmethod
    def _former_name(cls, data: Any) -> Any:
        if isinstance(data, dict) and "target_epsilon" in data:
            if "training_epsilon" in data:
                raise ValueError(
                    "target_epsilon is the former name of training_epsilon: give one of them"
                )
            data = {
                ("training_epsilon" if k == "target_epsilon" else k): v for k, v in data.items()
            }
        return data

    @model_validator(mode="after")
    def _at_most_one_noise_setting(self) -> DpSgdConfig:
        if self.noise_multiplier is not None and self.training_epsilon is not None:
            raise ValueError(
                "set exactly one of 'noise_multiplier' and 'training_epsilon' (got both)"
            )
        return self

    @property
    def noise_set(self) -> bool:
        """Whether the section itself sets the noise (else privacy.job_epsilon calibrates it)."""
        return self.noise_multiplier is not None or self.training_epsilon is not None


class ClientDpConfig(PolicyModel):
    """Client-level DP (DP-FedAvg: McMahan et al. 2018, Geyer et al. 2017): each silo clips its
    model update to L2 norm `clip` (S), and the sum of a round's updates gets Gaussian noise
    of std `noise_multiplier * clip` (z S). Silos are weighted equally, so one silo moves the
    sum by at most S, whatever its data.

    `noise: central`: the coordinator adds the noise; silos trust it with their clipped
    updates, and the guarantee covers the models the consortium publishes. `distributed`:
    each of a round's m silos adds N(0, (z S)^2 / m) to its own update, so the sum carries the
    full noise and the coordinator never sees an un-noised sum (it tops the noise up when
    fewer silos answer than planned).
    """

    # S, the L2 norm each silo clips its model update to, in parameter units: the most one silo can
    # move a round's sum (required)
    clip: float = Field(gt=0)
    # z, the noise's standard deviation as a multiple of clip: the sum of a round's updates carries
    # Gaussian noise of std z S (required, at least 0.01)
    noise_multiplier: float = Field(gt=0)
    # who adds the noise: distributed (the default), each silo adds its share to its own update so
    # the coordinator never sees an un-noised sum, or central, the coordinator adds it
    noise: Literal["central", "distributed"] = "distributed"

    _noise = field_validator("noise_multiplier")(_meaningful_noise)


ReportKind = Literal["counts", "losses", "metrics"]
REPORT_KINDS: tuple[str, ...] = get_args(ReportKind)


class ReportsConfig(PolicyModel):
    """The scalars silos report: sample counts, losses (training, or a probe's), and held-out
    metrics. In a DP deployment each is a Gaussian release: a count has sensitivity 1, a mean
    loss over n rows (per-row losses clipped to [0, `loss_bound`]) `loss_bound / n`, an
    accuracy `1 / n`, and the noise std is `noise_multiplier` times the sensitivity. Metrics
    without a bounded sensitivity (AUROC, RMSE, MAE) are withheld. `forbidden` kinds never
    leave a silo; an algorithm that needs one is refused when the policy is read."""

    # in a DP deployment, the standard deviation of the Gaussian noise on each reported scalar as a
    # multiple of its sensitivity (5 by default)
    noise_multiplier: float = Field(default=5.0, gt=0)
    # in a DP deployment, the bound per-row losses are clipped to, [0, loss_bound], which sets a
    # reported loss's sensitivity, loss_bound / n (10 by default, in loss units)
    loss_bound: float = Field(default=10.0, gt=0)
    # the kinds of report that never leave a silo, in any deployment; an algorithm that needs one is
    # refused when the policy is read (none by default)
    forbidden: list[ReportKind] = Field(default_factory=list)

    _noise = field_validator("noise_multiplier")(_meaningful_noise)


class PrivacyConfig(PolicyModel):
    """Accounting (delta, accountant), the per-silo budget, and the mechanisms in use.

    `job_epsilon`: the job's total epsilon at each silo. Every mechanism but DP-SGD keeps
    the noise its section sets (reports, client-level DP), and each silo calibrates DP-SGD's
    noise so that everything the job books there (training, evaluation reports, probes:
    its plan, silo/budget_plan.py) composes to `job_epsilon`; a job whose other releases
    alone spend it cannot be met and is refused with its plan. It needs `dp_sgd` without a
    noise setting of its own."""

    # the delta of every (epsilon, delta) guarantee a silo's ledger books, the small chance the
    # guarantee does not hold (1e-5 by default); at most 0.1:
    delta: float = Field(default=1e-5, gt=0, le=0.1)  # above, no guarantee worth the name
    # the accountant that turns every release of a silo's data into one epsilon: rdp (the default,
    # Renyi DP) or prv (tighter, needs delta of at least 1e-10)
    accountant: Literal["rdp", "prv"] = "rdp"
    # the most epsilon one job may spend at each silo, which every silo's ledger enforces (a site's
    # own rules.epsilon_cap may be stricter); null (the default): no cap from the policy
    epsilon_cap: float | None = Field(default=None, gt=0)
    # the job's total epsilon at each silo: every silo calibrates DP-SGD's noise so that all the job
    # books there composes to it (needs dp_sgd without a noise setting); null (the default): none
    job_epsilon: float | None = Field(default=None, gt=0)
    # sample-level DP-SGD in every training task; null (the default): no DP-SGD
    dp_sgd: DpSgdConfig | None = None
    # client-level DP (DP-FedAvg): each silo's model update clipped and the round's sum noised; null
    # (the default): none
    client_dp: ClientDpConfig | None = None
    # how the scalars the silos report (counts, losses, metrics) are noised in a DP deployment, and
    # which never leave a silo
    reports: ReportsConfig = ReportsConfig()

    @property
    def differentially_private(self) -> bool:
        """A DP deployment: everything a silo sends is noised before it leaves (DP-SGD, or
        client-level DP with distributed noise), and so is every report."""
        return self.dp_sgd is not None or (
            self.client_dp is not None and self.client_dp.noise == "distributed"
        )

    @model_validator(mode="after")
    def _delta_the_accountant_resolves(self) -> PrivacyConfig:
        if self.accountant == "prv" and self.delta < MIN_PRV_DELTA:
            raise ValueError(
                f"delta: {self.delta:g} is below {MIN_PRV_DELTA:g}, which the prv accountant "
                "cannot resolve (floating-point error over its grid dominates); use a larger "
                "delta or accountant rdp"
            )
        return self

    @model_validator(mode="after")
    def _one_noise_setting(self) -> PrivacyConfig:
        dp = self.dp_sgd
        if self.job_epsilon is not None and (dp is None or dp.noise_set):
            raise ValueError(
                "job_epsilon calibrates DP-SGD's noise to the job's total: it needs dp_sgd "
                "without noise_multiplier or training_epsilon"
                + (" (there is no dp_sgd)" if dp is None else "")
            )
        if dp is not None and not dp.noise_set and self.job_epsilon is None:
            raise ValueError(
                "dp_sgd: set exactly one of 'noise_multiplier' and 'training_epsilon' (got "
                "neither), or privacy.job_epsilon for the job's total"
            )
        return self

    @model_validator(mode="after")
    def _target_within_cap(self) -> PrivacyConfig:
        for key, target in (
            ("dp_sgd.training_epsilon", self.dp_sgd.training_epsilon if self.dp_sgd else None),
            ("job_epsilon", self.job_epsilon),
        ):
            if target is not None and self.epsilon_cap is not None and target > self.epsilon_cap:
                raise ValueError(
                    f"{key} {target:g} exceeds epsilon_cap {self.epsilon_cap:g}: the job "
                    "would spend more than a silo's budget"
                )
        return self
