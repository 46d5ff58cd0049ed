"""The scalars a silo reports (sample counts, losses, held-out metrics), as its policy lets them
leave, and what they cost.

A kind the policy forbids (`privacy.reports.forbidden`) is kept back. In a DP deployment every
report is a Gaussian release at the policy's noise multiplier sigma: a count has sensitivity 1;
a mean loss over n rows, each row's loss clipped to [0, loss_bound], loss_bound / n; an accuracy
1 / n. Each gets noise of std sigma times its sensitivity, drawn from the task's noise generator
(seeded with the silo's secret, so the coordinator cannot predict it). Metrics without a
bounded sensitivity (AUROC, RMSE, MAE) and the training loss (its rows overlap across DP-SGD's
batches) are withheld. k reports at one noise multiplier compose exactly as one Gaussian release
at sigma / sqrt(k) (`reports_mechanism`), which is how a task's reports are booked.

A split's sample count is released once per job: its noise is drawn from the silo's secret,
the job and the split alone, so every later report of it repeats the same value, which costs
nothing more (`SiloContext` remembers which counts it released; a restarted silo books them
once again). Another job (another signed policy, perhaps another noise multiplier) draws other
noise: two values of one count under one noise draw at two scales would reveal it.

In a deployment without DP the reports are exact, and booked as releases without noise.
"""

from __future__ import annotations

import math

import torch

from fedsilo.policies.privacy import PrivacyConfig
from fedsilo.privacy.accounting import Mechanism

COUNTS, LOSSES, METRICS = "counts", "losses", "metrics"
DOMAIN_REPORTS = 2  # per-domain loss sums and counts: the domains are disjoint (`domain_losses`)


class Reports:
    """One task's reports: what may leave, and each value as it leaves. `count_noise` draws
    the noise of a split's count (the same generator state for every report of that split)."""

    def __init__(
        self,
        privacy: PrivacyConfig,
        noise: torch.Generator,
        count_noise: torch.Generator | None = None,
    ) -> None:
        self.privacy = privacy
        self.noise = noise
        self.count_noise = count_noise if count_noise is not None else noise

    @property
    def noised(self) -> bool:
        return self.privacy.differentially_private

    def allows(self, kind: str) -> bool:
        return kind not in self.privacy.reports.forbidden

    def count(self, n: int) -> int:
        """The sample count; noised under DP and then rounded, at least 1 (post-processing)."""
        if not self.noised:
            return n
        return max(1, round(n + self._gaussian(1.0, self.count_noise)))

    def mean_loss(self, per_row: torch.Tensor) -> float:
        """The mean of per-row losses; under DP each row clipped to [0, loss_bound] first."""
        losses = per_row.detach().double().cpu()
        if not self.noised:
            return float(losses.mean())
        bound = self.privacy.reports.loss_bound
        clipped = float(losses.clamp(0.0, bound).mean())
        return clipped + self._gaussian(bound / len(losses), self.noise)

    def domain_losses(
        self, per_row: torch.Tensor, codes: torch.Tensor, domains: int
    ) -> tuple[list[float], list[float]]:
        """Per domain: the sum of its rows' losses and its row count. Under DP each row's loss
        is clipped to [0, loss_bound] first, and each sum gets noise of std sigma loss_bound,
        each count sigma: a record is in one domain, so the two vectors together cost what
        two reports cost (`DOMAIN_REPORTS`)."""
        losses = per_row.detach().double().cpu()
        codes = codes.cpu()
        if self.noised:
            losses = losses.clamp(0.0, self.privacy.reports.loss_bound)
        sums = torch.zeros(domains, dtype=torch.float64).index_add_(0, codes, losses)
        counts = torch.bincount(codes, minlength=domains).double()
        if not self.noised:
            return sums.tolist(), counts.tolist()
        bound = self.privacy.reports.loss_bound
        return (
            [float(v) + self._gaussian(bound, self.noise) for v in sums],
            [float(v) + self._gaussian(1.0, self.noise) for v in counts],
        )

    def clipped_sum(self, per_row: torch.Tensor, signed: bool = False) -> float:
        """The sum of per-row values; under DP each clipped to [0, loss_bound] (`signed`:
        [-loss_bound, loss_bound]) and the sum noised with std sigma loss_bound (a record adds
        or removes one row). MultiBoost's loss sums and (signed) edges leave this way."""
        values = per_row.detach().double().cpu()
        if not self.noised:
            return float(values.sum())
        bound = self.privacy.reports.loss_bound
        clipped = values.clamp(-bound if signed else 0.0, bound)
        return float(clipped.sum()) + self._gaussian(bound, self.noise)

    def accuracy(self, correct: torch.Tensor) -> float:
        """The fraction of rows marked correct (a boolean per row)."""
        value = float(correct.double().mean())
        return value + self._gaussian(1.0 / len(correct), self.noise) if self.noised else value

    def _gaussian(self, sensitivity: float, generator: torch.Generator) -> float:
        std = self.privacy.reports.noise_multiplier * sensitivity
        return float(torch.normal(0.0, std, (1,), generator=generator, dtype=torch.float64))


def reports_mechanism(privacy: PrivacyConfig, reports: int) -> list[Mechanism]:
    """What `reports` scalar reports of one task release together (nothing for none)."""
    if reports == 0:
        return []
    if not privacy.differentially_private:
        return [Mechanism.none()]
    sigma = privacy.reports.noise_multiplier
    return [Mechanism.gaussian(sensitivity=math.sqrt(reports), noise_std=sigma)]
