"""The admin channel: the operator administers a running coordinator over mTLS with its own
certificate (common name `operator`) and signs every request with operator.key; the coordinator
answers from its `AdminBackend`, sealed and bound to the request. Served here by a real gRPC
server on 127.0.0.1 with the kits of a real `fedsilo provision`, in front of an in-memory
backend that records every call, so "nothing reached the backend" is checked, not assumed.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from click.testing import CliRunner, Result
from nacl.signing import SigningKey

from fedsilo.coordinator.admin_api import OPERATOR, AdminError
from fedsilo.coordinator.admin_service import admin_handler
from fedsilo.coordinator.jobs import JobInfo
from fedsilo.coordinator.replay_store import ReplayStore
from fedsilo.ops.admin_client import AdminChannelError, AdminConnection
from fedsilo.ops.cli import main
from fedsilo.ops.provision import TlsFiles, load_coordinator_kit, load_operator_kit
from fedsilo.ops.status import DeploymentStatus
from fedsilo.privacy.identity import read_signing_key, write_private_key
from fedsilo.privacy.policy_signing import (
    PolicySignatureError,
    sign_policy,
    verify_attempt,
    verify_policy,
)
from fedsilo.wire.admin import AdminReply, AdminRequest, relative_path
from fedsilo.wire.envelope import MAX_AGE_S, seal
from fedsilo.wire.framing import to_frames
from fedsilo.wire.tensors import WireError

from .deployment import Consortium, policy_document, provision

JOB = "breast-cancer-deployed-0123456789ab"
RESULT_FILES = {
    "history.json": b'{"rounds": 3}',
    "plots/accuracy.png": b"\x89PNG fake",
    "empty.txt": b"",
}


def job_info(status: str = "queued", error: str = "") -> JobInfo:
    return JobInfo(
        job_id=JOB,
        name="breast-cancer-deployed",
        policy_digest="ab" * 32,
        status=status,
        submitted_by=OPERATOR,
        submitted_at=1_700_000_000.0,
        started_at=None,
        finished_at=None,
        abort_requested=status == "aborted",
        error=error,
    )


class FakeBackend:
    """An `AdminBackend` in memory: fixed answers, every call recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def submit(self, policy_text: str, signature: str, submitted_by: str) -> JobInfo:
        self.calls.append(("submit", (policy_text, signature, submitted_by)))
        return job_info()

    def retry(self, job_id: str, attempt: int, signature: str, submitted_by: str) -> JobInfo:
        self.calls.append(("retry", (job_id, attempt, signature, submitted_by)))
        return dataclasses.replace(job_info(), job_id=f"{JOB}-attempt{attempt}", attempt=attempt)

    def jobs(self) -> list[JobInfo]:
        self.calls.append(("jobs", ()))
        return [job_info(), dataclasses.replace(job_info("completed"), job_id="other-job")]

    def job(self, job_id: str) -> JobInfo:
        self.calls.append(("job", (job_id,)))
        if job_id != JOB:
            raise AdminError(f"no job {job_id!r} on this coordinator (see `fedsilo job list`)")
        return job_info("running")

    def awaiting(self, job_id: str) -> list[dict[str, Any]]:
        self.calls.append(("awaiting", (job_id,)))
        return [{"silo": "silo-1", "task_id": None, "since": 1.0e9, "until": 1.0e9 + 600}]

    def progress(self, job_id: str) -> dict[str, Any] | None:
        self.calls.append(("progress", (job_id,)))
        return {"round": 3, "rounds": 5}

    def abort(self, job_id: str) -> JobInfo:
        self.calls.append(("abort", (job_id,)))
        return job_info("aborted", "aborted by the operator before it started")

    def logs(self, job_id: str, tail: int | None) -> str:
        self.calls.append(("logs", (job_id, tail)))
        lines = [f"line {i}" for i in range(1, 6)]
        return "\n".join(lines[-tail:] if tail else lines) + "\n"

    def results(self, job_id: str) -> dict[str, bytes]:
        self.calls.append(("results", (job_id,)))
        return dict(RESULT_FILES)

    def consortium_status(self) -> dict[str, Any]:
        self.calls.append(("consortium_status", ()))
        job = DeploymentStatus(
            deployment=JOB,
            rounds_planned=5,
            last_round=3,
            last_status="completed",
            participants={"silo-0": ("accepted", ""), "silo-2": ("revoked", "left")},
            last_evaluation={"silo-0": {"accuracy": 0.875}},
            evaluated_round=3,
            dropouts={"silo-1": 2},
            failed_rounds=0,
        )
        return {
            "schema": 1,
            "consortium": "test-consortium",
            "source": "coordinator",
            "silos": {
                "silo-0": {"connected": True, "revoked": False, "reason": ""},
                "silo-1": {"connected": False, "revoked": False, "reason": ""},
                "silo-2": {"connected": False, "revoked": True, "reason": "left"},
            },
            "running": JOB,
            "queued": ["next-job"],
            "job": job_info("running").to_json(),
            "progress": job.to_json(),
        }


@dataclasses.dataclass
class AdminServer:
    consortium: Consortium
    backend: FakeBackend
    state: Path
    server: grpc.Server | None = None

    def start(self) -> None:
        kit = load_coordinator_kit(self.consortium.kits / "coordinator")
        credentials = grpc.ssl_server_credentials(
            [(kit.tls.private_key.read_bytes(), kit.tls.certificate.read_bytes())],
            root_certificates=kit.tls.ca_certificate.read_bytes(),
            require_client_auth=True,
        )
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        handler = admin_handler(
            self.backend,
            kit.consortium,
            kit.operator_verify_key,
            kit.signing_key,
            ReplayStore(self.state, MAX_AGE_S),
            max_payload_bytes=2**24,
        )
        self.server.add_generic_rpc_handlers((handler,))
        assert self.server.add_secure_port(kit.address, credentials) != 0
        self.server.start()

    def stop(self) -> None:
        assert self.server is not None
        self.server.stop(grace=None).wait()


@pytest.fixture(scope="module")
def consortium(tmp_path_factory: pytest.TempPathFactory) -> Consortium:
    return provision(tmp_path_factory.mktemp("admin"))


@pytest.fixture
def served(consortium: Consortium, tmp_path: Path) -> Iterator[AdminServer]:
    server = AdminServer(consortium, FakeBackend(), tmp_path / "state.db")
    server.start()
    yield server
    server.stop()


def fedsilo(*args: str | Path) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args])


def operator_kit(consortium: Consortium) -> Path:
    return consortium.kits / "operator"


# Every command round-trips


def test_submit_sends_the_signed_policy_and_prints_the_job_id(
    consortium: Consortium, served: AdminServer
) -> None:
    policy = consortium.write_policy(policy_document())
    result = fedsilo("job", "submit", policy, "--kit", operator_kit(consortium))
    assert result.exit_code == 0, result.output
    assert JOB in result.output
    [(call, (text, signature, by))] = served.backend.calls
    assert (call, text, by) == ("submit", policy.read_text(), OPERATOR)
    assert signature == (policy.parent / "policy.yaml.sig").read_text()


def test_submit_signs_an_unsigned_policy_with_the_given_key(
    consortium: Consortium, served: AdminServer, tmp_path: Path
) -> None:
    policy = tmp_path / "unsigned.yaml"
    policy.write_text((consortium.root / "policy.yaml").read_text())
    kit = operator_kit(consortium)
    refused = fedsilo("job", "submit", policy, "--kit", kit)
    assert refused.exit_code == 1
    assert "unsigned.yaml.sig: not found; sign the policy first" in refused.output
    assert served.backend.calls == []
    signed = fedsilo("job", "submit", policy, "--kit", kit, "--key", kit / "operator.key")
    assert signed.exit_code == 0, signed.output
    assert served.backend.calls[0][1][1] == (tmp_path / "unsigned.yaml.sig").read_text()


def test_submit_refuses_a_signature_older_than_the_policy_and_sends_nothing(
    consortium: Consortium, served: AdminServer, tmp_path: Path
) -> None:
    policy = tmp_path / "edited.yaml"
    policy.write_text((consortium.root / "policy.yaml").read_text())
    kit = operator_kit(consortium)
    signature = sign_policy(policy, read_signing_key(kit / "operator.key"))
    policy.write_text(policy.read_text().replace("seed: 7", "seed: 8"))  # edited after signing
    stale = signature.read_text()
    refused = fedsilo("job", "submit", policy, "--kit", kit)
    assert refused.exit_code == 1
    assert refused.output == (
        f"Error: {signature}: the signature is older than the policy (it does not verify for "
        f"{policy} as it is now); sign it again (`fedsilo policy sign {policy} --key "
        "OPERATOR_KEY`) or pass --key\n"
    )
    assert served.backend.calls == [] and signature.read_text() == stale


def test_submit_with_key_signs_again_a_policy_edited_since_it_was_signed_and_says_so(
    consortium: Consortium, served: AdminServer, tmp_path: Path
) -> None:
    policy = tmp_path / "edited.yaml"
    policy.write_text((consortium.root / "policy.yaml").read_text())
    kit = operator_kit(consortium)
    sign_policy(policy, read_signing_key(kit / "operator.key"))
    policy.write_text(policy.read_text().replace("seed: 7", "seed: 8"))
    result = fedsilo("job", "submit", policy, "--kit", kit, "--key", kit / "operator.key")
    assert result.exit_code == 0, result.output
    assert " ".join(result.output.split()).startswith(
        f"re-signed {policy}: {policy}.sig was older than the policy"
    )
    [(_, (text, signature, _))] = served.backend.calls
    assert text == policy.read_text()
    verify_policy(text.encode(), signature, read_signing_key(kit / "operator.key").verify_key)


def test_submit_refuses_a_key_that_is_not_the_kits_operator_key_and_signs_nothing(
    consortium: Consortium, served: AdminServer, tmp_path: Path
) -> None:
    policy = tmp_path / "unsigned.yaml"
    policy.write_text((consortium.root / "policy.yaml").read_text())
    other = tmp_path / "other.key"
    write_private_key(other, SigningKey.generate())
    result = fedsilo("job", "submit", policy, "--kit", operator_kit(consortium), "--key", other)
    assert result.exit_code == 1
    assert f"--key {other}: not the operator key of the kit" in result.output
    assert served.backend.calls == [] and not (tmp_path / "unsigned.yaml.sig").exists()


def test_retry_signs_the_next_attempt_with_the_operators_key_and_sends_it(
    consortium: Consortium, served: AdminServer
) -> None:
    kit = operator_kit(consortium)
    result = fedsilo("job", "submit", "--retry", JOB, "--kit", kit)
    assert result.exit_code == 0, result.output
    assert f"submitted attempt 2 at the policy of job {JOB} as job {JOB}-attempt2" in result.output
    *status, (call, (job, attempt, signature, by)) = served.backend.calls
    assert status == [("job", (JOB,)), ("awaiting", (JOB,)), ("progress", (JOB,))]
    assert (call, job, attempt, by) == ("retry", JOB, 2, OPERATOR)
    operator = load_operator_kit(kit).signing_key.verify_key
    verify_attempt("ab" * 32, 2, signature, operator)
    with pytest.raises(PolicySignatureError):
        verify_attempt("ab" * 32, 3, signature, operator)


@pytest.mark.parametrize(
    "args, said",
    [
        (["job", "submit", "p.yaml", "--retry", JOB], "--retry: it runs JOB's own signed policy"),
        (["job", "submit", "--retry", JOB, "--key", "k"], "--retry: it runs JOB's own signed"),
        (["job", "submit"], "POLICY: give the policy to submit, or --retry JOB"),
    ],
)
def test_submit_takes_a_policy_or_retry_not_both(
    consortium: Consortium, served: AdminServer, args: list[str], said: str
) -> None:
    result = fedsilo(*args, "--kit", operator_kit(consortium))
    assert result.exit_code == 1
    assert said in result.output and len(result.output.strip().splitlines()) == 1
    assert served.backend.calls == []


def test_submit_checks_the_policy_fields_before_sending(
    consortium: Consortium, served: AdminServer, tmp_path: Path
) -> None:
    policy = tmp_path / "bad.yaml"
    policy.write_text("version: 1\nname: x\nrounds: -3\n")
    result = fedsilo("job", "submit", policy, "--kit", operator_kit(consortium))
    assert result.exit_code == 1
    assert "rounds" in result.output and "Traceback" not in result.output
    assert served.backend.calls == []


def test_list_status_abort_and_logs_round_trip(consortium: Consortium, served: AdminServer) -> None:
    kit = operator_kit(consortium)
    listed = fedsilo("job", "list", "--kit", kit)
    assert listed.exit_code == 0, listed.output
    assert JOB[:20] in listed.output and "other-job" in listed.output
    shown = fedsilo("job", "status", JOB, "--kit", kit)
    assert shown.exit_code == 0, shown.output
    assert "running" in shown.output and "ab" * 10 in shown.output
    assert "awaiting silo-1" in shown.output and "its join since" in shown.output
    assert "round 3 of 5" in shown.output
    aborted = fedsilo("job", "abort", JOB, "--kit", kit)
    assert aborted.exit_code == 0, aborted.output
    assert f"job {JOB}: aborted" in aborted.output
    logs = fedsilo("job", "logs", JOB, "--kit", kit, "--tail", "2")
    assert logs.exit_code == 0, logs.output
    assert logs.output == "line 4\nline 5\n"
    assert served.backend.calls == [
        ("jobs", ()),
        ("job", (JOB,)),
        ("awaiting", (JOB,)),
        ("progress", (JOB,)),
        ("abort", (JOB,)),
        ("logs", (JOB, 2)),
    ]


def test_job_status_json_is_the_job_whom_it_awaits_and_its_progress(
    consortium: Consortium, served: AdminServer
) -> None:
    result = fedsilo("job", "status", JOB, "--kit", operator_kit(consortium), "--json")
    assert result.exit_code == 0, result.output
    document = json.loads(result.output)
    assert document["schema"] == 1
    assert document["job"] == {
        **job_info("running").to_json(),
        "awaiting": [{"silo": "silo-1", "task_id": None, "since": 1.0e9, "until": 1.0e9 + 600}],
        "progress": {"round": 3, "rounds": 5},
    }
    assert document["job"]["note"] == "" and document["job"]["refusals"] == {}


def test_results_are_written_under_out(
    consortium: Consortium, served: AdminServer, tmp_path: Path
) -> None:
    out = tmp_path / "results"
    result = fedsilo("job", "results", JOB, "--kit", operator_kit(consortium), "--out", out)
    assert result.exit_code == 0, result.output
    for name, content in RESULT_FILES.items():
        assert (out / name).read_bytes() == content
    again = fedsilo("job", "results", JOB, "--kit", operator_kit(consortium), "--out", out)
    assert again.exit_code == 1
    assert "pass --overwrite" in again.output
    replaced = fedsilo(
        "job", "results", JOB, "--kit", operator_kit(consortium), "--out", out, "--overwrite"
    )
    assert replaced.exit_code == 0, replaced.output


def test_results_never_go_into_a_folder_of_the_users(
    consortium: Consortium, served: AdminServer, tmp_path: Path
) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    result = fedsilo("job", "results", JOB, "--kit", operator_kit(consortium), "--out", out)
    assert result.exit_code == 1
    assert "did not write" in result.output
    assert served.backend.calls == []
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_remote_status_renders_the_local_status_table(
    consortium: Consortium, served: AdminServer
) -> None:
    result = fedsilo("status", "--kit", operator_kit(consortium))
    assert result.exit_code == 0, result.output
    assert f"running {JOB}, 1 queued; connected silos: silo-0" in result.output
    said = " ".join(result.output.split())
    assert f"job {JOB} (running): round 3 of 5, 0 failed round(s)" in said
    assert "0.875" in result.output and "revoked left" in result.output
    assert "never joined" in result.output  # silo-1, as the local table shows it
    assert served.backend.calls == [("consortium_status", ())]


def test_status_with_the_operator_kit_takes_no_state_file(
    consortium: Consortium, tmp_path: Path
) -> None:
    result = fedsilo("status", "--kit", operator_kit(consortium), "--state", tmp_path / "s.db")
    assert result.exit_code == 1
    assert "--state: the operator's kit asks the running coordinator" in result.output
    local = fedsilo("status", "--kit", consortium.kits / "coordinator")
    assert local.exit_code == 1
    assert "--state: give the coordinator's state file" in local.output


def test_an_admin_error_comes_back_as_one_line(consortium: Consortium, served: AdminServer) -> None:
    result = fedsilo("job", "status", "nope", "--kit", operator_kit(consortium))
    assert result.exit_code == 1
    assert result.output == ("Error: no job 'nope' on this coordinator (see `fedsilo job list`)\n")


def test_an_unreachable_coordinator_is_one_line_naming_its_address(
    consortium: Consortium,
) -> None:
    result = fedsilo("job", "list", "--kit", operator_kit(consortium))
    assert result.exit_code == 1
    assert result.output.startswith(
        f"Error: the coordinator at 127.0.0.1:{consortium.port} is unreachable"
    )
    assert len(result.output.strip().splitlines()) == 1


# Only the operator administers


@pytest.mark.parametrize(
    "command, args",
    [
        ("submit", {"policy": "version: 1\n", "signature": "00" * 64}),
        ("abort", {"job": JOB}),
        ("logs", {"job": JOB, "tail": None}),
        ("results", {"job": JOB}),
    ],
)
def test_a_silo_certificate_cannot_administer(
    consortium: Consortium, served: AdminServer, command: str, args: dict[str, Any]
) -> None:
    silo = consortium.kits / "silos" / "silo-0"
    kit = dataclasses.replace(
        load_operator_kit(operator_kit(consortium)),
        tls=TlsFiles(silo / "ca.crt", silo / "client.crt", silo / "client.key"),
    )
    with (
        AdminConnection(kit) as connection,
        pytest.raises(AdminChannelError, match="refuses this operator identity: .*'silo-0'"),
    ):
        connection.call(command, **args)
    assert served.backend.calls == []


def test_a_certificate_of_another_consortium_cannot_even_connect(
    consortium: Consortium, served: AdminServer, tmp_path: Path
) -> None:
    (tmp_path / "foreign").mkdir()
    foreign = provision(tmp_path / "foreign").kits / "operator"
    ours = load_operator_kit(operator_kit(consortium))
    for tls in (
        TlsFiles(ours.tls.ca_certificate, foreign / "client.crt", foreign / "client.key"),
        load_operator_kit(foreign).tls,
    ):
        kit = dataclasses.replace(ours, tls=tls)
        with (
            AdminConnection(kit) as connection,
            pytest.raises(AdminChannelError, match="unreachable"),
        ):
            connection.call("list")
    assert served.backend.calls == []


def test_a_request_signed_by_another_key_is_refused(
    consortium: Consortium, served: AdminServer
) -> None:
    kit = dataclasses.replace(
        load_operator_kit(operator_kit(consortium)), signing_key=SigningKey.generate()
    )
    with (
        AdminConnection(kit) as connection,
        pytest.raises(AdminChannelError, match="refuses this operator identity: bad_signature"),
    ):
        connection.call("abort", job=JOB)
    assert served.backend.calls == []


def test_a_replayed_request_is_refused_also_after_a_restart(
    consortium: Consortium, served: AdminServer
) -> None:
    kit = load_operator_kit(operator_kit(consortium))
    request = AdminRequest("abort", {"job": JOB}).encode()
    envelope = seal(
        request,
        signing_key=kit.signing_key,
        sender=OPERATOR,
        deployment=kit.consortium,
        round=0,
        task_id=f"abort/{uuid.uuid4().hex}",
    )

    def send() -> list[bytes]:
        with AdminConnection(kit) as connection:
            return list(connection.exchange(to_frames(envelope, request), timeout=30))

    assert send()  # the first time, answered
    with pytest.raises(grpc.RpcError, match="replay"):
        send()
    served.stop()
    served.start()  # a new service over the same state file
    with pytest.raises(grpc.RpcError, match="replay"):
        send()
    assert served.backend.calls == [("abort", (JOB,))]


def test_a_reply_not_signed_by_the_coordinator_is_refused(
    consortium: Consortium, served: AdminServer
) -> None:
    kit = load_operator_kit(operator_kit(consortium))
    with AdminConnection(kit) as connection:
        connection.verifier.set_roster({"coordinator": SigningKey.generate().verify_key})
        with pytest.raises(AdminChannelError, match="not to be trusted: bad_signature"):
            connection.call("list")


# The messages


def test_requests_take_exactly_their_commands_arguments() -> None:
    assert AdminRequest.decode(AdminRequest("logs", {"job": "j", "tail": 3}).encode()) == (
        AdminRequest("logs", {"job": "j", "tail": 3})
    )
    with pytest.raises(WireError, match="unknown admin command 'shutdown'"):
        AdminRequest("shutdown")
    with pytest.raises(WireError, match="takes arguments \\['job'\\], got \\['job', 'x'\\]"):
        AdminRequest("abort", {"job": "j", "x": 1})
    with pytest.raises(WireError, match="argument 'tail' has the wrong type"):
        AdminRequest("logs", {"job": "j", "tail": "3"})


@pytest.mark.parametrize("name", ["/etc/passwd", "../up.txt", "a/../../b", "a//b", "./a", ""])
def test_a_result_file_must_stay_inside_the_results_folder(name: str) -> None:
    with pytest.raises(WireError, match="file path"):
        relative_path(name)


def test_a_reply_naming_a_file_outside_the_folder_does_not_decode() -> None:
    forged = AdminReply(True, files={"ok.txt": b"x"}).encode().replace(b"ok.txt", b"../x.t")
    with pytest.raises(WireError, match="leaves its folder"):
        AdminReply.decode(forged)


def test_reply_files_round_trip_byte_for_byte() -> None:
    reply = AdminReply(True, data={"files": sorted(RESULT_FILES)}, files=RESULT_FILES)
    assert AdminReply.decode(reply.encode()) == reply
