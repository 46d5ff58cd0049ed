"""A consortium that keeps running, every party a real process over mTLS: `coordinator serve`,
three silo agents started once (silo-2 behind a hospital's HTTP CONNECT proxy, proxy.py), and
the operator administering remotely with its own kit.

Job 1 runs with `phase_timeout_s: 600`; a silo SIGKILLed in its middle is a dropout within its
heartbeat window and the next round completes within 15 s. A fourth silo enrolled while the
coordinator serves (`consortium add-silo`, no other kit issued again) takes part in job 2, which
masks its sums over all four, after every certificate was renewed while serving (`consortium
renew`). A remote revocation (`consortium revoke --kit OPERATOR_KIT`) refuses a silo, and job 3
runs without it. `--json` outputs of the admin CLI are read by this test as a script would.
"""

from __future__ import annotations

import json
import time

from click.testing import CliRunner

from fedsilo.coordinator.hub import OFFLINE
from fedsilo.ops.cli import main
from fedsilo.ops.demo import free_port
from tests.deployment import Consortium, fedsilo, metric, policy_document, wait_for
from tests.test_proxy import start_proxy, tunnels, without_proxies

DATA = {"source": "sklearn:breast_cancer", "partition": {"kind": "iid", "silos": 4}}
SLOW_PHASES = {"min_silos": 2, "phase_timeout_s": 600}
WINDOW_S = 5.0


def admin(consortium: Consortium, *args: str) -> dict | list:
    """`fedsilo ARGS --kit OPERATOR_KIT --json`, parsed."""
    result = CliRunner().invoke(main, [*args, "--kit", str(consortium.kits / "operator"), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def submit(consortium: Consortium, document: dict, name: str) -> str:
    policy = consortium.write_policy(document, name)
    result = CliRunner().invoke(
        main, ["job", "submit", str(policy), "--kit", str(consortium.kits / "operator")]
    )
    assert result.exit_code == 0, result.output
    return result.output.split(" as job ")[1].split()[0]


def ended(consortium: Consortium, job: str, timeout: float = 180) -> dict:
    return wait_for(
        lambda: (
            (status := admin(consortium, "job", "status", job)["job"])["status"]
            in {"completed", "failed", "aborted", "refused"}
            and status
        ),
        timeout,
        f"job {job} to end",
        consortium,
        0.5,
    )


def test_a_consortium_keeps_running_through_a_crash_an_enrolment_a_renewal_and_a_revocation(
    consortium: Consortium,
) -> None:
    metrics_port = free_port()
    consortium.start_serve("--heartbeat-window", str(WINDOW_S), "--metrics-port", str(metrics_port))
    consortium.wait_for_log("coordinator", "serving mTLS gRPC")
    proxy = start_proxy(consortium, "proxy")
    for silo in ("silo-0", "silo-1"):
        consortium.start_silo(silo, consortium.write_silo_config(silo, data=DATA))
    behind_proxy = consortium.write_silo_config(
        "silo-2", data=DATA, proxy=f"http://127.0.0.1:{proxy}"
    )
    consortium.start_silo("silo-2", behind_proxy, env=without_proxies())

    # job 1: silo-1 dies mid-job; the phase deadline (600 s) is never waited for
    first = submit(
        consortium,
        policy_document(rounds=6, name="job-1", data=DATA, participants=SLOW_PHASES),
        "job-1.yaml",
    )
    consortium.wait_for_log("coordinator", "round 2/6 completed", timeout=120, interval=0.02)
    before = consortium.log("coordinator").count(" completed")
    consortium.kill("silo-1")
    killed = time.monotonic()
    wait_for(
        lambda: consortium.log("coordinator").count(" completed") > before,
        60,
        "the round after the kill",
        consortium,
    )
    assert time.monotonic() - killed < 15
    job_1 = ended(consortium, first)
    assert job_1["status"] == "completed", consortium.log("coordinator")
    assert "silo silo-1: no heartbeat for" in consortium.log("coordinator")
    assert OFFLINE in consortium.log("coordinator")

    # the dead silo comes back; silo-3 is enrolled while serving, no other kit issued again;
    # every certificate is renewed while serving
    consortium.start_silo("silo-1", consortium.write_silo_config("silo-1", data=DATA))
    consortium.add_silo("silo-3")
    consortium.start_silo("silo-3", consortium.write_silo_config("silo-3", data=DATA))
    fedsilo("consortium", "renew", "--kits", str(consortium.kits), "--days", "400")
    wait_for(
        lambda: metric(metrics_port, "fedsilo_silos_connected") == 4,
        60,
        "four silos connected",
        consortium,
    )
    masked = {"secure_aggregation": {"method": "masking"}, "data": DATA}
    second = submit(
        consortium,
        policy_document(
            rounds=2, name="job-2", participants={"min_silos": 4, "phase_timeout_s": 60}, **masked
        ),
        "job-2.yaml",
    )
    assert ended(consortium, second)["status"] == "completed", consortium.log("coordinator")

    # a remote revocation: silo-0 is refused from now on, and job 3 runs without it
    fedsilo(
        "consortium", "revoke", "silo-0", "--kit", str(consortium.kits / "operator"),
        "--reason", "left the consortium",
    )  # fmt: skip
    assert consortium.wait("silo-0", timeout=30) != 0
    consortium.processes.pop("silo-0")
    third = submit(
        consortium,
        policy_document(rounds=1, name="job-3", participants={"min_silos": 3}, **masked),
        "job-3.yaml",
    )
    assert ended(consortium, third)["status"] == "completed", consortium.log("coordinator")

    # what a script reads
    listed = admin(consortium, "job", "list")
    assert [job["job_id"] for job in listed["jobs"]] == [first, second, third]
    status = admin(consortium, "status")
    assert status["silos"]["silo-0"]["revoked"]
    connected = {silo for silo, seen in status["silos"].items() if seen["connected"]}
    assert connected == {"silo-1", "silo-2", "silo-3"}

    # silo-2 took part through its proxy all along: mTLS end to end inside CONNECT tunnels
    assert f"through the proxy http://127.0.0.1:{proxy}" in consortium.log("silo-2")
    consortium.kill("silo-2")  # the proxy logs a tunnel when it closes
    coordinator = f"127.0.0.1:{consortium.port}"
    wait_for(lambda: tunnels(consortium, "proxy"), 15, "the proxy's tunnels")
    assert set(tunnels(consortium, "proxy")) == {coordinator}
