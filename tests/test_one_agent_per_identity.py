"""One agent per identity: the first agent process heard with a silo's kit holds the identity; a
second one started with the same kit is refused, told where the first connects from and since
when, and gives up (exit status 1) once the first has stayed alive past twice the heartbeat
window. An agent whose predecessor was killed takes its place as soon as the predecessor has been
silent for a window, and the tasks the predecessor held fail at once instead of at their
deadline."""

from __future__ import annotations

import queue

from fedsilo.coordinator.hub import OFFLINE, PostedTask, SiloHub
from fedsilo.coordinator.transport import Reply
from fedsilo.ops.demo import free_port
from tests.deployment import Consortium, metric, policy_document, wait_for
from tests.test_liveness import FakeClock

WINDOW_S = 2.0


def test_a_second_agent_is_refused_naming_the_first_while_the_first_is_heard() -> None:
    clock = FakeClock()
    hub = SiloHub(["silo-0"], clock=clock, heartbeat_window_s=10)
    assert hub.claim("silo-0", "agent-a", "10.0.0.5:41000") is None
    hub.seen("silo-0")
    clock.now += 9
    refusal = hub.claim("silo-0", "agent-b", "10.0.0.9:52000")
    assert refusal is not None
    assert refusal.startswith("silo silo-0 already has an agent connected from 10.0.0.5:41000 ")
    assert "since " in refusal and "UTC (heard 9s ago)" in refusal
    assert hub.claim("silo-0", "agent-a", "10.0.0.5:41000") is None  # the first goes on
    assert hub.agent_of("silo-0").agent == "agent-a"  # type: ignore[union-attr]


def test_an_agent_takes_the_place_of_one_silent_for_a_window_and_its_tasks_fail_at_once() -> None:
    clock = FakeClock()
    hub = SiloHub(["silo-0"], clock=clock, heartbeat_window_s=10)
    hub.claim("silo-0", "agent-a", "10.0.0.5:41000")
    hub.seen("silo-0")
    hub.accept("silo-0")
    replies: queue.Queue[Reply] = queue.Queue()
    hub.post(PostedTask("silo-0", "t1", 1, b""), replies)
    assert hub.next_task("silo-0", 0) is not None  # the first agent took it, then was killed
    clock.now += 11
    assert hub.claim("silo-0", "agent-b", "10.0.0.5:41002") is None
    failed = replies.get_nowait()
    assert failed.payload is None and failed.failure.startswith(OFFLINE)
    assert "silo-0" not in hub.accepted  # the new agent joins the job afresh
    assert hub.agent_of("silo-0").peer == "10.0.0.5:41002"  # type: ignore[union-attr]


def test_a_second_agent_with_the_same_kit_is_refused_and_the_first_goes_on(
    consortium: Consortium,
) -> None:
    port = free_port()
    consortium.start_serve("--heartbeat-window", str(WINDOW_S), "--metrics-port", str(port))
    consortium.wait_for_log("coordinator", "serving mTLS gRPC")
    for silo in ("silo-0", "silo-1", "silo-2"):
        consortium.start_silo(silo)
    connected = "fedsilo_silos_connected"
    wait_for(lambda: metric(port, connected) == 3, 60, "3 silos connected", consortium)
    second = consortium.start_silo_again("silo-0", "silo-0-again")
    assert second.wait(timeout=90) == 1, consortium.log("silo-0-again")
    consortium.processes.pop("silo-0-again")
    said = consortium.log("silo-0-again")
    assert "silo silo-0 already has an agent connected from 127.0.0.1:" in said, said
    assert "Traceback" not in said

    job = consortium.submit(consortium.write_policy(policy_document(rounds=2)))
    consortium.wait_for_log("coordinator", f"job {job} complete", timeout=120)
