"""`fedsilo status`: where a deployment stands, read from the coordinator's state file (safe
to run beside a live coordinator: SQLite readers do not block it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedsilo.coordinator.engine import RoundRecord
from fedsilo.coordinator.state import StateError, StateStore
from fedsilo.ops.epsilon import epsilon_by_round, final_epsilons
from fedsilo.ops.shown_metrics import MetricDisplay
from fedsilo.policies.privacy import PrivacyConfig


@dataclass(frozen=True)
class DeploymentStatus:
    deployment: str
    rounds_planned: int | None
    last_round: int
    last_status: str
    participants: dict[str, tuple[str, str]]
    last_evaluation: dict[str, dict[str, float]]
    evaluated_round: int | None
    dropouts: dict[str, int]  # silo -> rounds in which it dropped at least once (not revoked)
    failed_rounds: int
    epsilon: dict[str, float] = field(default_factory=dict)  # silo -> last epsilon it reported
    epsilon_cap: float | None = None  # the policy's cap per silo (a site may set a lower one)
    # a DP policy: every metric a silo reports carries Gaussian noise; `last_evaluation` holds
    # them as shown, clipped into each metric's range (ops/shown_metrics.py)
    noised: bool = False


def deployment_status(state: Path, consortium: str) -> DeploymentStatus:
    """Where the consortium's latest job stands (or, in a state file written before jobs, its
    one deployment), with the consortium's revocations."""
    if not state.is_file():
        raise StateError(f"{state}: no state file (has the coordinator started?)")
    with StateStore(state) as store:
        deployment = consortium
        if store.last_round(consortium) is None:
            deployment = store.latest_job(consortium) or consortium
        saved = store.last_round(deployment)
        participants = store.participants(deployment) if saved is not None else {}
        if deployment != consortium:
            revoked = store.participants(consortium)
            participants.update({s: why for s, why in revoked.items() if why[0] == "revoked"})
        policy = store.deployment_policy(deployment) or {}
    if saved is None:
        raise StateError(f"{state}: deployment {deployment!r} has not started")
    records = saved.records
    evaluated = next((r for r in reversed(records) if r.get("evaluation")), None)
    privacy = PrivacyConfig.model_validate(policy.get("privacy") or {})
    return DeploymentStatus(
        deployment=deployment,
        rounds_planned=policy.get("rounds"),
        last_round=saved.round,
        last_status=saved.status,
        participants=participants,
        last_evaluation=MetricDisplay.of(privacy).evaluation(evaluated["evaluation"]) or {}
        if evaluated
        else {},
        evaluated_round=evaluated["round"] if evaluated else None,
        dropouts=_dropouts(records),
        failed_rounds=sum(1 for r in records if r.get("status") == "failed"),
        epsilon=final_epsilons(epsilon_by_round(RoundRecord.from_json(r) for r in records)),
        epsilon_cap=privacy.epsilon_cap,
        noised=privacy.differentially_private,
    )


def _dropouts(records: list[dict[str, Any]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for record in records:
        dropped = {
            s for phase in record.get("phases", {}).values() for s in phase.get("dropped", {})
        } - set(record.get("revoked", ()))
        for silo in dropped:
            counts[silo] = counts.get(silo, 0) + 1
    return counts
