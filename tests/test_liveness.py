"""Liveness: every silo agent heartbeats its coordinator, which takes a silo silent for its
heartbeat window (`--heartbeat-window`) for gone at once: the task it holds fails as a dropout,
a task posted to it fails without waiting, and the join of a job stops waiting for it once the
silos that answered can meet the quorum. A gone silo that comes back joins again.

A stall for a silo that is gone is never longer than the heartbeat window plus one round,
whatever `participants.phase_timeout_s` says (600 s below)."""

from __future__ import annotations

import json
import os
import queue
import shutil
import time

from fedsilo.coordinator.hub import OFFLINE, STARTUP_WINDOWS, PostedTask, SiloHub
from fedsilo.coordinator.transport import Reply
from fedsilo.ops.demo import free_port
from tests.deployment import Consortium, fedsilo, metric, policy_document, wait_for

SLOW_PHASES = {"min_silos": 2, "phase_timeout_s": 600}
WINDOW_S = 5.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def completed_rounds(consortium: Consortium) -> int:
    return consortium.log("coordinator").count(" completed")


def test_a_silo_killed_mid_job_is_a_dropout_within_its_heartbeat_window_not_the_phase_deadline(
    consortium: Consortium,
) -> None:
    policy = consortium.write_policy(policy_document(rounds=6, participants=SLOW_PHASES))
    consortium.start_coordinator(policy, "--out", "results", "--heartbeat-window", str(WINDOW_S))
    for silo in ("silo-0", "silo-1", "silo-2"):
        consortium.start_silo(silo)
    consortium.wait_for_log("coordinator", "round 2/6 completed", timeout=120, interval=0.02)
    before = completed_rounds(consortium)
    consortium.kill("silo-2")
    killed = time.monotonic()
    wait_for(lambda: completed_rounds(consortium) > before, 60, "the next round", consortium)
    assert time.monotonic() - killed < 15  # the window plus one round, not 600 s
    assert consortium.wait("coordinator", timeout=120) == 0, consortium.log("coordinator")

    history = json.loads((consortium.root / "results" / "results.json").read_text())["history"]
    dropped = [
        why
        for record in history
        for phase in record.get("phases", {}).values()
        for silo, why in phase["dropped"].items()
        if silo == "silo-2"
    ]
    assert dropped and all(OFFLINE in why for why in dropped), dropped
    assert not any("deadline" in why for why in dropped)
    assert all(record["status"] == "completed" for record in history[1:])


def serve_three_silos_and_lose_one(
    consortium: Consortium, window_s: float, join_timeout_s: float
) -> None:
    """`coordinator serve` and three silo agents; silo-2 is SIGKILLed once all are connected,
    and this returns once the coordinator counts it gone."""
    port = free_port()
    consortium.start_serve(
        *("--heartbeat-window", str(window_s), "--join-timeout", str(join_timeout_s)),
        *("--metrics-port", str(port)),
    )
    consortium.wait_for_log("coordinator", "serving mTLS gRPC")
    for silo in ("silo-0", "silo-1", "silo-2"):
        consortium.start_silo(silo)
    connected = "fedsilo_silos_connected"
    wait_for(lambda: metric(port, connected) == 3, 60, "3 silos connected", consortium)
    consortium.kill("silo-2")
    wait_for(lambda: metric(port, connected) == 2, 2 * window_s, "silo-2 gone", consortium)


def test_a_silo_gone_before_a_job_does_not_hold_up_its_join(consortium: Consortium) -> None:
    serve_three_silos_and_lose_one(consortium, WINDOW_S, join_timeout_s=600)
    submitted = time.monotonic()
    job = consortium.submit(consortium.write_policy(policy_document(rounds=1)))
    consortium.wait_for_log("coordinator", f"job {job} complete", timeout=120)
    assert time.monotonic() - submitted < 60  # not the 600 s join timeout


def test_a_job_short_of_its_quorum_names_the_silos_gone(consortium: Consortium) -> None:
    serve_three_silos_and_lose_one(consortium, 2, join_timeout_s=6)
    everyone = {"min_silos": 3, "phase_timeout_s": 600}
    job = consortium.submit(consortium.write_policy(policy_document(participants=everyone)))
    consortium.wait_for_log("coordinator", f"job {job} failed", timeout=60)
    assert "min_silos is 3; none refused it; gone (no heartbeat for 2s): silo-2" in (
        consortium.log("coordinator")
    )


def test_an_agent_refused_as_unknown_retries_and_is_admitted_once_enrolled(
    consortium: Consortium,
) -> None:
    port = free_port()
    consortium.start_serve("--metrics-port", str(port))
    consortium.wait_for_log("coordinator", "serving mTLS gRPC")
    # the operator enrols silo-3 on her own copy of the coordinator kit first ...
    staged = consortium.root / "staged-coordinator-kit"
    shutil.copytree(consortium.kits / "coordinator", staged)
    fedsilo(
        "consortium", "add-silo", "silo-3",
        "--ca-kit", str(consortium.kits / "operator"),
        "--coordinator-kit", str(staged),
        "--consortium", str(consortium.root / "consortium.yaml"),
        "--out", str(consortium.kits),
    )  # fmt: skip
    data = {"source": "sklearn:breast_cancer", "partition": {"kind": "iid", "silos": 4}}
    for silo in ("silo-0", "silo-1", "silo-2", "silo-3"):
        consortium.start_silo(silo, consortium.write_silo_config(silo, data=data))
    consortium.wait_for_log("silo-3", "does not know this silo yet")
    # ... and the coordinator's host gets the new roster a moment after silo-3 started
    for name in ("kit.yaml", "roster.json"):  # the signed roster admits silo-3
        os.replace(staged / name, consortium.kits / "coordinator" / name)
    connected = "fedsilo_silos_connected"
    wait_for(lambda: metric(port, connected) == 4, 30, "silo-3 admitted", consortium)
    job = consortium.submit(consortium.write_policy(policy_document(rounds=1, data=data)))
    consortium.wait_for_log("coordinator", f"job {job} complete", timeout=120)
    assert "silo silo-3 accepted policy" in consortium.log("coordinator")


# -- the hub, on a fake clock --------------------------------------------------------------------


def hub_with_a_task(clock: FakeClock) -> tuple[SiloHub, queue.Queue[Reply]]:
    hub = SiloHub(["s0", "s1"], clock=clock, heartbeat_window_s=WINDOW_S)
    hub.start_job("job")
    for silo in ("s0", "s1"):
        hub.seen(silo)
        hub.accept(silo)
    replies: queue.Queue[Reply] = queue.Queue()
    for silo in ("s0", "s1"):
        hub.post(PostedTask(silo, f"job/r1/train/{silo}", 1, b"task"), replies)
        assert hub.next_task(silo, 0.01) is not None  # each silo holds its task
    return hub, replies


def test_a_silo_that_heartbeats_keeps_its_task_and_a_silent_one_drops_out_at_its_window() -> None:
    clock = FakeClock()
    hub, replies = hub_with_a_task(clock)
    clock.now += WINDOW_S - 1
    hub.seen("s0")
    hub.reap()
    assert replies.empty()
    clock.now += 2  # s1 silent for longer than its window; s0 heard a second ago
    hub.reap()
    gone = replies.get_nowait()
    assert (gone.silo, gone.payload) == ("s1", None)
    assert gone.failure is not None and gone.failure.startswith(OFFLINE)
    assert replies.empty() and hub.offline() == ["s1"]


def test_a_task_for_a_silo_known_gone_fails_at_once_and_a_silo_heard_again_rejoins() -> None:
    clock = FakeClock()
    hub, replies = hub_with_a_task(clock)
    clock.now += WINDOW_S + 1
    hub.seen("s0")
    hub.reap()
    replies.get_nowait()
    hub.post(PostedTask("s1", "job/r2/train/s1", 2, b"task"), replies)
    failed = replies.get_nowait()
    assert failed.failure is not None and failed.failure.startswith(OFFLINE)
    hub.seen("s1")  # it came back: it joins the job again before it is sent a task
    assert hub.offline() == [] and "s1" not in hub.accepted
    hub.accept("s1")
    hub.post(PostedTask("s1", "job/r3/train/s1", 3, b"task"), replies)
    assert replies.empty() and hub.next_task("s1", 0.01) is not None


def test_the_join_ends_when_the_silos_not_gone_have_answered_and_can_meet_the_quorum() -> None:
    clock = FakeClock()
    hub = SiloHub(["s0", "s1", "s2"], clock=clock, heartbeat_window_s=WINDOW_S)
    hub.start_job("job")
    for silo in ("s0", "s1", "s2"):
        hub.seen(silo)
    clock.now += WINDOW_S + 1  # s2 silent since: gone
    for silo in ("s0", "s1"):
        hub.seen(silo)
        hub.accept(silo)
    assert hub.wait_for_members(3, 30, quorum=2) == ["s0", "s1"]  # at once: s2 is gone
    started = time.monotonic()
    assert hub.wait_for_members(3, 0.5, quorum=3) == ["s0", "s1"]  # short of the quorum: waits
    assert time.monotonic() - started >= 0.5


def test_a_silo_never_heard_from_has_some_windows_to_start_after_the_coordinator_did() -> None:
    clock = FakeClock()
    hub = SiloHub(["s0", "s1"], clock=clock, heartbeat_window_s=WINDOW_S)
    hub.seen("s0")
    clock.now += WINDOW_S + 0.5
    assert hub.offline() == ["s0"]  # heard once, then silent for a window: gone
    clock.now += (STARTUP_WINDOWS - 1) * WINDOW_S
    assert hub.offline() == ["s0", "s1"]


def test_a_silo_enrolled_while_serving_has_as_long_to_start_from_its_enrolment() -> None:
    clock = FakeClock()
    hub = SiloHub(["s0"], clock=clock, heartbeat_window_s=WINDOW_S)
    clock.now += STARTUP_WINDOWS * WINDOW_S + 1
    hub.set_roster(["s0", "s1"])
    assert hub.offline() == ["s0"]  # never heard since the hub started; s1 was just enrolled
    clock.now += STARTUP_WINDOWS * WINDOW_S + 1
    assert hub.offline() == ["s0", "s1"]


def test_a_silo_whose_large_message_is_still_crossing_is_heard_and_keeps_its_task() -> None:
    """Over a narrow link a silo's heartbeats queue behind its own model upload or download:
    every frame of a message moving either way counts as hearing from it."""
    from types import SimpleNamespace

    from fedsilo.coordinator.service import CoordinatorService

    clock = FakeClock()
    hub, replies = hub_with_a_task(clock)
    service = SimpleNamespace(hub=hub)
    upload = CoordinatorService._heard_while_moving(service, "s1", iter([b"frame"] * 3))
    for _ in upload:  # s1's frames arrive over three windows; s0 heartbeats
        clock.now += WINDOW_S - 1
        hub.seen("s0")
        hub.reap()
    assert replies.empty() and hub.offline() == []
