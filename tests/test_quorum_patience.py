"""Quorum with patience: a job short of its quorum waits `participants.quorum_grace_s` (default
60 s, longer than the 10 s after which the shipped systemd unit restarts an agent) for silos to
come back before its next round, and then fails naming who is missing and why. A silo agent
killed mid-job and started again with the same command rejoins, and the job completes with
`min_silos` every site."""

from __future__ import annotations

import json
import threading
import time

import pytest

from fedsilo.coordinator.engine import RoundEngine, RunAborted
from fedsilo.coordinator.hub import OFFLINE, SiloHub
from fedsilo.coordinator.strategies import make_strategy
from fedsilo.coordinator.transport import InProcessTransport
from fedsilo.ops.silo_setup import SYSTEMD_RESTART_S
from fedsilo.policies.loading import parse_policy
from fedsilo.policies.schema import ParticipantsConfig
from tests.deployment import Consortium, policy_document
from tests.test_quorum import masking_policy, real_agents

WINDOW_S = 3.0
EVERY_SITE = {"min_silos": 3, "phase_timeout_s": 120}


def test_the_default_grace_outlasts_a_restart_of_the_shipped_unit() -> None:
    assert ParticipantsConfig().quorum_grace_s > SYSTEMD_RESTART_S + 2 * 10.0


def test_a_member_that_joins_again_ends_the_wait_at_once() -> None:
    hub = SiloHub(["a", "b", "c"])
    for silo in ("a", "b"):
        hub.accept(silo)
    threading.Timer(0.3, hub.accept, ("c",)).start()
    started = time.monotonic()
    assert hub.wait_for_quorum(["a", "b", "c"], 3, timeout_s=30) == []
    assert time.monotonic() - started < 10


def test_the_wait_ends_after_its_grace_with_the_silos_still_missing() -> None:
    hub = SiloHub(["a", "b", "c"])
    hub.accept("a")
    assert hub.wait_for_quorum(["a", "b", "c"], 2, timeout_s=0.2) == ["b", "c"]
    assert hub.wait_for_quorum(["a", "b", "c"], 1, timeout_s=0) == []


def test_an_aborted_job_stops_waiting() -> None:
    hub = SiloHub(["a", "b"])
    hub.accept("a")
    threading.Timer(0.2, hub.abort, ("cancelled",)).start()
    started = time.monotonic()
    assert hub.wait_for_quorum(["a", "b"], 2, timeout_s=60) == ["b"]
    assert time.monotonic() - started < 10


def test_a_run_short_of_its_quorum_after_the_grace_ends_naming_the_missing_and_why() -> None:
    policy = masking_policy(silos=3, min_silos=3, rounds=2)
    policy = policy.model_copy(
        update={"participants": policy.participants.model_copy(update={"quorum_grace_s": 7})}
    )
    agents = real_agents(policy)
    waits: list[tuple[tuple[str, ...], int, float]] = []

    def nobody_comes_back(silos, quorum, timeout_s):  # type: ignore[no-untyped-def]
        waits.append((tuple(silos), quorum, timeout_s))
        return {"silo-2": "offline: no heartbeat for 12s (window 10s)"}

    engine = RoundEngine(
        make_strategy(policy),
        InProcessTransport({n: a.handle_bytes for n, a in agents.items()}),
        policy,
        sorted(agents),
        wait_for_quorum=nobody_comes_back,
    )
    with pytest.raises(RunAborted) as aborted:
        engine.run()
    assert waits == [(("silo-0", "silo-1", "silo-2"), 3, 7.0)]
    assert str(aborted.value) == (
        "round 1: 2 of 3 silos can take part, participants.min_silos is 3; waited 7s "
        "(participants.quorum_grace_s) for the others to come back: "
        "silo-2 (offline: no heartbeat for 12s (window 10s))"
    )


def test_a_silo_killed_mid_job_and_restarted_by_its_unit_rejoins_and_the_job_completes(
    consortium: Consortium,
) -> None:
    policy = consortium.write_policy(policy_document(rounds=8, participants=EVERY_SITE))
    consortium.start_coordinator(policy, "--out", "results", "--heartbeat-window", str(WINDOW_S))
    for silo in ("silo-0", "silo-1", "silo-2"):
        consortium.start_silo(silo)
    consortium.wait_for_log("coordinator", "round 2/8 completed", timeout=120, interval=0.02)
    consortium.kill("silo-2")
    time.sleep(SYSTEMD_RESTART_S)  # the unit's RestartSec: longer than the heartbeat window
    consortium.start_silo_again("silo-2", "silo-2-restarted")

    assert consortium.wait("coordinator", timeout=240) == 0, consortium.log("coordinator")
    log = consortium.log("coordinator")
    assert "waiting up to 60s for silo-2 to come back" in log
    assert "the quorum is back" in log
    results = json.loads((consortium.root / "results" / "results.json").read_text())
    history = results["history"]
    assert [r["round"] for r in history if r["status"] == "completed"][-1] == 8
    failed = [r for r in history if r["status"] == "failed"]
    assert len(failed) <= 1, failed  # at most the round the kill interrupted
    assert "silo-2" in results["final"]["per_silo"]


def test_a_silo_that_does_not_come_back_fails_the_job_after_the_grace_naming_it(
    consortium: Consortium,
) -> None:
    everyone = {**EVERY_SITE, "quorum_grace_s": 4}
    policy = consortium.write_policy(policy_document(rounds=30, participants=everyone))
    consortium.start_coordinator(policy, "--heartbeat-window", str(WINDOW_S))
    for silo in ("silo-0", "silo-1", "silo-2"):
        consortium.start_silo(silo)
    consortium.wait_for_log("coordinator", "round 2/30 completed", timeout=120, interval=0.02)
    consortium.kill("silo-2")

    assert consortium.wait("coordinator", timeout=120) != 0
    log = consortium.log("coordinator")
    assert "2 of 3 silos can take part, participants.min_silos is 3; waited 4s" in log, log
    assert f"silo-2 ({OFFLINE}: no heartbeat for" in log


def test_quorum_grace_is_a_policy_key_with_its_bounds() -> None:
    document = policy_document(participants={"min_silos": 2, "quorum_grace_s": 0})
    assert parse_policy(document).participants.quorum_grace_s == 0
    with pytest.raises(ValueError, match="quorum_grace_s"):
        parse_policy(policy_document(participants={"quorum_grace_s": -1}))
