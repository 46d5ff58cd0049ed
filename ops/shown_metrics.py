"""How a run's metrics are shown to people: in the coordinator's log, the `simulate` table and
progress bar, the plots, `fedsilo status`, `coordinator start`'s summary and Prometheus.

Under a DP policy every metric a silo reports is a noised release (silo/reports.py: the
accuracy of n rows plus Gaussian noise of std sigma / n, the mean of losses clipped to
[0, loss_bound] plus noise of std sigma loss_bound / n), so on a small test split it can read
1.2 or -0.3. Shown, each value is clipped into its metric's range (accuracy [0, 1], loss
[0, loss_bound]), the cross-silo summaries are computed from the clipped values, and the
metric is marked "(noised)". Clipping is post-processing: it costs no privacy, and it never
moves a value further from the one it noises, which lies in the range. results.json keeps the
raw noised values (and says they are noised); without DP the values are exact and shown as
they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from fedsilo.coordinator.engine import EngineObserver as RoundObserver
from fedsilo.coordinator.engine import RoundRecord, RunHistory
from fedsilo.coordinator.summary import summarize_metrics
from fedsilo.policies.privacy import PrivacyConfig

NOISED = "(noised)"
Evaluation = Mapping[str, Mapping[str, float]]


@dataclass(frozen=True)
class MetricDisplay:
    """The display of one policy's metrics: `noised` under DP, with the loss reports' bound."""

    noised: bool = False
    loss_bound: float = 0.0

    @classmethod
    def of(cls, privacy: PrivacyConfig) -> MetricDisplay:
        return cls(privacy.differentially_private, privacy.reports.loss_bound)

    def label(self, metric: str) -> str:
        """The metric's name as shown: marked "(noised)" under DP."""
        return f"{metric} {NOISED}" if self.noised else metric

    def value(self, metric: str, value: float) -> float:
        """The value as shown: clipped into the metric's range under DP."""
        bounds = self._range(metric)
        if not self.noised or bounds is None:
            return value
        low, high = bounds
        return min(max(value, low), high)

    def evaluation(self, evaluation: Evaluation | None) -> dict[str, dict[str, float]] | None:
        """Each silo's metrics as shown."""
        if evaluation is None:
            return None
        return {
            silo: {name: self.value(name, v) for name, v in metrics.items()}
            for silo, metrics in evaluation.items()
        }

    def record(self, record: RoundRecord) -> RoundRecord:
        """`record` with its evaluation as shown and the summaries computed from that (the
        same record without DP)."""
        if not self.noised or record.evaluation is None:
            return record
        shown = self.evaluation(record.evaluation)
        assert shown is not None
        sizes = record.test_sizes or {}
        summaries = summarize_metrics(shown, sizes, {}) if sizes else {}
        return replace(
            record,
            evaluation=shown,
            summary={name: s.as_dict() for name, s in summaries.items()} or record.summary,
        )

    def history(self, history: RunHistory) -> RunHistory:
        """Every round of `history`, and its final evaluation, as shown."""
        if not self.noised:
            return history
        return replace(
            history,
            records=[self.record(r) for r in history.records],
            final=self.record(history.final),
        )

    def _range(self, metric: str) -> tuple[float, float] | None:
        if metric == "accuracy":
            return 0.0, 1.0
        if metric == "loss":
            return 0.0, self.loss_bound
        return None


def last_metrics(record: Mapping[str, Any], privacy: PrivacyConfig) -> dict[str, Any]:
    """An evaluated round's record (as saved) reduced to what `job status` shows: its round and
    each metric's size-weighted mean across silos, as shown under the policy's `privacy`."""
    display = MetricDisplay.of(privacy)
    shown = display.record(RoundRecord.from_json(dict(record)))
    return {
        "round": shown.round,
        "values": {
            display.label(name): summary["weighted_mean"]
            for name, summary in sorted((shown.summary or {}).items())
        },
    }


class ShownRounds:
    """An engine observer that hands each round to `observer` as shown (`MetricDisplay.record`):
    the coordinator's log and its Prometheus metrics."""

    def __init__(self, observer: RoundObserver, display: MetricDisplay) -> None:
        self.observer, self.display = observer, display

    def on_round(self, record: RoundRecord, total_rounds: int) -> None:
        self.observer.on_round(self.display.record(record), total_rounds)
