"""The losses silos report, as the strategies read them: finite ones only, and under DP
post-processed into their domain.

Under DP a silo reports a mean loss as its rows' losses clipped to [0, loss_bound], averaged,
plus Gaussian noise (silo/reports.py), so a report may fall below 0 or above `loss_bound`,
where no mean of clipped losses lies. The strategies read each one clamped into
[0, loss_bound]: AAggFF's CDF responses take non-negative losses, q-FedAvg raises them to a
power, PropFair takes the log of its baseline less the loss. Clamping is post-processing of a
DP release, so it costs no privacy (Dwork and Roth 2014, Proposition 2.1), and it never moves a
report further from the value it noises, which lies in that interval. The raw reports stay in
the round's record. Without DP a report is exact and read as it is.

A silo whose loss is not finite did not report one; a probe in which no silo did (a model that
diverged) fails the round, naming why, as a phase below its quorum does.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from fedsilo.coordinator.phases import QuorumNotMet, SiloReport
from fedsilo.policies.privacy import PrivacyConfig


def loss_in_domain(value: float, privacy: PrivacyConfig) -> float:
    """A reported mean loss as strategies read it: clamped into [0, loss_bound] under DP."""
    if not privacy.differentially_private:
        return value
    return min(max(value, 0.0), privacy.reports.loss_bound)


def reported_losses(
    reports: Mapping[str, SiloReport], privacy: PrivacyConfig, phase: str
) -> dict[str, float]:
    """Each silo's finite reported loss, in its domain; QuorumNotMet when none is finite."""
    losses = {
        silo: loss_in_domain(float(report.metrics["loss"]), privacy)
        for silo, report in reports.items()
        if math.isfinite(report.metrics.get("loss", math.nan))
    }
    if reports and not losses:
        raise QuorumNotMet(
            "no silo reported a finite loss: the model diverged (a smaller training.lr, or a "
            "server optimizer's smaller server_lr or larger tau, may help)",
            phase,
            reports,
        )
    return losses
