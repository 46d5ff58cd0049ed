"""Cross-site validation (`evaluation.cross_site`): once, after a job's final evaluation, every
model the coordinator holds in the clear evaluated on every silo's test split; the matrix from
which a consortium reads a broken site (its own model does well on its own data only, and every
model does badly on its data).

Rows are models: the final global model (`GLOBAL_ROW`, where the strategy keeps one), then each
silo's model of the last round's `train` phase where the policy lets it reach the coordinator in
the clear (`cross_site_rows` in policies/algorithms/contract.py: not under secure aggregation or
client-level DP, and only for algorithms whose silos send their own models); columns are the
silos. `CrossSite` keeps those models as the engine accepts the last round's answers; the
strategy's `cross_site` script (coordinator/strategies/base.py) evaluates each row in a phase of
its own, `cross_site_<k>`, with the plain `evaluate` task, so every answer is checked at the silo
against its own contract (only when its signed policy asks, at most one task a row), booked in
its ledger and noised under DP exactly as an evaluation is.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fedsilo.coordinator.phases import PhaseOutcome
from fedsilo.coordinator.replies import Accepted
from fedsilo.policies.algorithms.contract import cross_site_rows
from fedsilo.policies.schema import Policy
from fedsilo.wire.tasks.tensor_names import MODEL

log = logging.getLogger("fedsilo.coordinator")

GLOBAL_ROW = "(global)"  # the global model's row; no silo name starts with "("
TRAIN_PHASE = "train"  # the phase whose answers carry each silo's model (cross_site_rows)
Cells = dict[str, dict[str, dict[str, float]]]  # row -> silo -> metric -> value


@dataclass(frozen=True)
class CrossSiteMatrix:
    """`rows`: each model's metrics on each silo's test split (row -> silo -> metrics), the
    global model first; `note`: why a row the reader may expect is missing (one line);
    `dropped`: the cells no answer filled, each silo's reason by row."""

    rows: Cells
    note: str | None = None
    dropped: dict[str, dict[str, str]] = field(default_factory=dict)

    @property
    def sites(self) -> list[str]:
        """The columns: every silo any row has a cell or a reason for, sorted."""
        cells = [*self.rows.values(), *self.dropped.values()]
        return sorted({silo for row in cells for silo in row})

    def to_json(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            **({"note": self.note} if self.note else {}),
            **({"dropped": self.dropped} if self.dropped else {}),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CrossSiteMatrix:
        return cls(
            {row: {s: dict(m) for s, m in cells.items()} for row, cells in data["rows"].items()},
            data.get("note"),
            {row: dict(why) for row, why in (data.get("dropped") or {}).items()},
        )


class CrossSite:
    """What the engine holds for cross-site validation under `policy`: which rows its
    algorithm gives, and the silos' models of the last round's `train` phase."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.rows = cross_site_rows(policy, policy.algorithm.silo_contract(policy).rules)
        self.site_models: dict[str, torch.Tensor] = {}

    @classmethod
    def of(cls, policy: Policy) -> CrossSite | None:
        """None when the policy does not ask for cross-site validation."""
        return cls(policy) if policy.evaluation.cross_site else None

    def keep(self, phase: str, round_no: int, results: Mapping[str, Accepted]) -> None:
        """Keep each silo's model from `results`, the accepted answers of `phase` of
        `round_no`, when they are the last round's `train` answers in the clear."""
        if not (self.rows.site_models and phase == TRAIN_PHASE and round_no == self.policy.rounds):
            return
        models = {}
        for silo, accepted in results.items():
            lazy = accepted.lazy.get(MODEL)
            model = lazy.load() if lazy is not None else accepted.result.tensors.get(MODEL)
            if model is not None:
                models[silo] = model
        self.site_models = models

    def models(
        self, global_model: torch.Tensor | None, members: Sequence[str], trained: bool
    ) -> tuple[dict[str, torch.Tensor], str | None]:
        """The rows to evaluate, in order (the global model's, then each of `members`' kept
        model), and the one line saying why the site rows are missing, if they are;
        `trained`: whether the last round completed (a failed round's models are not the
        sites' final ones)."""
        rows = {GLOBAL_ROW: global_model} if global_model is not None else {}
        if not self.rows.site_models:
            return rows, f"the global model's row only: {self.rows.why_not_sites}"
        if not trained:
            return rows, "no site's row: the last round failed, so no site's final model came back"
        kept = {s: self.site_models[s] for s in sorted(members) if s in self.site_models}
        missing = sorted(set(members) - set(kept))
        note = None
        if not kept:
            note = "no site's row: no member trained a model of its own in the last round"
        elif missing:
            note = (
                f"no row for {', '.join(missing)}: no model of theirs came back in the last round "
                "(left out of it, or dropped)"
            )
        return {**rows, **kept}, note

    def matrix(self, outcomes: Mapping[str, PhaseOutcome], note: str | None) -> CrossSiteMatrix:
        """The matrix of the rows' evaluations (`outcomes`, by row)."""
        matrix = CrossSiteMatrix(
            {
                row: {s: dict(r.metrics) for s, r in o.reports.items()}
                for row, o in outcomes.items()
            },
            note,
            {row: dict(out.dropped) for row, out in outcomes.items() if out.dropped},
        )
        log.info(
            "cross-site validation: %d model(s) on %d silo(s)%s",
            len(matrix.rows),
            len(matrix.sites),
            f" ({note})" if note else "",
        )
        return matrix
