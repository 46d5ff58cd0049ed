"""Certificates that keep a consortium running: `fedsilo consortium renew` issues them again
from the same CA for the same names and keys; a serving coordinator and its silos take renewed
certificates without a restart and without losing their job; days to expiry are a gauge, a line
in `fedsilo status` and a warning 30 days ahead; an expired or not yet valid certificate stops a
party at start with one message naming the file and the date."""

from __future__ import annotations

import logging
import socket
import ssl
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from rich.console import Console

from fedsilo.coordinator.jobs import COMPLETED, RUNNING, JobQueue
from fedsilo.coordinator.state import StateStore
from fedsilo.ops.cli import main
from fedsilo.ops.demo import free_port
from fedsilo.ops.provision import load_coordinator_kit, load_operator_kit, load_silo_kit
from fedsilo.ops.status_view import print_certificate
from fedsilo.privacy.certificate_files import TlsFileWatch
from fedsilo.privacy.certificates import certificate_fingerprint, verify_issued_by
from fedsilo.privacy.identity import read_secret_file
from tests.deployment import (
    SILOS,
    Consortium,
    fedsilo,
    metric,
    policy_document,
    provision,
    wait_for,
)

DAY = timedelta(days=1)


def certificates(kits: Path) -> dict[str, Path]:
    return {
        "operator": kits / "operator" / "client.crt",
        "coordinator": kits / "coordinator" / "server.crt",
        **{silo: kits / "silos" / silo / "client.crt" for silo in SILOS},
    }


def read(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def renew(consortium: Consortium, *args: str) -> object:
    return CliRunner().invoke(main, ["consortium", "renew", "--kits", str(consortium.kits), *args])


def reissue(kits: Path, path: Path, not_before: datetime, not_after: datetime) -> None:
    """Replace the certificate at `path` with one of the same name and key, signed by the
    consortium's CA, valid from `not_before` to `not_after` (back-dated, or in the future)."""
    authority = serialization.load_pem_private_key(
        read_secret_file(kits / "operator" / "ca.key"), password=None
    )
    old = read(path)
    builder = (
        x509.CertificateBuilder()
        .subject_name(old.subject)
        .issuer_name(old.issuer)
        .public_key(old.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
    )
    for extension in old.extensions:
        builder = builder.add_extension(extension.value, critical=extension.critical)
    certificate = builder.sign(authority, hashes.SHA256())
    path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))


def test_renewal_keeps_each_partys_name_key_uses_and_ca_and_extends_its_expiry(
    consortium: Consortium,
) -> None:
    kits = consortium.kits
    before = {party: path.read_bytes() for party, path in certificates(kits).items()}
    keys = {path: path.read_bytes() for path in kits.rglob("*.key")}
    silo_kits = {silo: (kits / "silos" / silo / "kit.yaml").read_text() for silo in SILOS}
    roster = yaml.safe_load((kits / "coordinator" / "kit.yaml").read_text())

    fedsilo("consortium", "renew", "--kits", str(kits), "--days", "400")

    authority = (kits / "operator" / "ca.crt").read_bytes()
    for party, path in certificates(kits).items():
        old, new = x509.load_pem_x509_certificate(before[party]), read(path)
        assert new.subject == old.subject and new.public_key() == old.public_key()
        assert list(new.extensions) == list(old.extensions)
        assert verify_issued_by(path.read_bytes(), authority)
        assert new.serial_number != old.serial_number
        left = new.not_valid_after_utc - datetime.now(timezone.utc)
        assert timedelta(days=399) < left <= timedelta(days=400)
        backup = path.with_name(f"{path.name}.{old.serial_number:x}.old")
        assert backup.read_bytes() == before[party]  # the old certificate is kept
    assert {path: path.read_bytes() for path in kits.rglob("*.key")} == keys
    assert {s: (kits / "silos" / s / "kit.yaml").read_text() for s in SILOS} == silo_kits
    renewed_roster = yaml.safe_load((kits / "coordinator" / "kit.yaml").read_text())
    for silo in SILOS:
        fingerprint = certificate_fingerprint(certificates(kits)[silo].read_bytes())
        roster["silos"][silo]["certificate_fingerprint"] = fingerprint
    assert renewed_roster == roster  # only the fingerprints changed
    load_coordinator_kit(kits / "coordinator")
    load_operator_kit(kits / "operator")
    assert [load_silo_kit(kits / "silos" / silo).name for silo in SILOS] == list(SILOS)


def test_renew_chooses_its_parties_and_those_due_and_refuses_what_it_cannot_issue(
    consortium: Consortium,
) -> None:
    files = certificates(consortium.kits)
    before = {party: path.read_bytes() for party, path in files.items()}

    result = renew(consortium, "--party", "silo-1", "--within", "30")
    assert result.exit_code == 0 and "kept silo-1's" in result.output, result.output
    assert {party: path.read_bytes() for party, path in files.items()} == before
    result = renew(consortium, "--party", "silo-1", "--party", "coordinator")
    assert result.exit_code == 0, result.output
    changed = {party for party, path in files.items() if path.read_bytes() != before[party]}
    assert changed == {"silo-1", "coordinator"}

    after = {party: path.read_bytes() for party, path in files.items()}
    refusals = {
        ("--days", "4000"): "--days 4000: a certificate cannot outlive the CA",
        ("--party", "nobody"): "--party: no party 'nobody'",
    }
    for args, message in refusals.items():
        result = renew(consortium, *args)
        assert result.exit_code == 1 and message in result.output, result.output
    (consortium.root / "other").mkdir()
    other = provision(consortium.root / "other")
    files["silo-2"].write_bytes((other.kits / "silos" / "silo-2" / "client.crt").read_bytes())
    result = renew(consortium, "--party", "silo-2")
    assert result.exit_code == 1 and "not issued by the CA of --ca-kit" in result.output
    files["silo-2"].write_bytes(after["silo-2"])
    assert {party: path.read_bytes() for party, path in files.items()} == after


def test_renew_refuses_a_revoked_silos_certificate_and_leaves_it_out_of_the_rest(
    consortium: Consortium,
) -> None:
    """Revoked through the running coordinator (`consortium revoke`, the signed roster)."""
    consortium.start_serve()
    consortium.wait_for_log("coordinator", "serving mTLS gRPC")
    fedsilo(
        "consortium",
        "revoke",
        "silo-2",
        "--kit",
        str(consortium.kits / "operator"),
        "--reason",
        "left the study",
    )
    files = certificates(consortium.kits)
    before = {party: path.read_bytes() for party, path in files.items()}

    result = renew(consortium, "--party", "silo-2")
    assert result.exit_code == 1
    assert result.output == (
        "Error: --party silo-2: silo 'silo-2' is revoked (left the study); a revoked silo's "
        "certificate is not renewed\n"
    )
    assert {party: path.read_bytes() for party, path in files.items()} == before

    result = renew(consortium)
    assert result.exit_code == 0, result.output
    assert "not renewed: silo-2: revoked (left the study)" in result.output
    changed = {party for party, path in files.items() if path.read_bytes() != before[party]}
    assert changed == set(files) - {"silo-2"}


def test_an_expired_or_not_yet_valid_certificate_stops_a_party_at_start_naming_it(
    consortium: Consortium,
) -> None:
    now = datetime.now(timezone.utc)
    silo_certificate = certificates(consortium.kits)["silo-0"]
    reissue(consortium.kits, silo_certificate, now - 30 * DAY, now - 2 * DAY)
    config = consortium.write_silo_config("silo-0")
    result = CliRunner().invoke(main, ["silo", "start", "--config", str(config)])
    expired = f"{silo_certificate}: the certificate expired on {now - 2 * DAY:%Y-%m-%d}"
    assert result.exit_code == 1 and expired in result.output, result.output
    assert "fedsilo consortium renew" in result.output and "Traceback" not in result.output

    server_certificate = certificates(consortium.kits)["coordinator"]
    reissue(consortium.kits, server_certificate, now + 3 * DAY, now + 30 * DAY)
    state = consortium.root / "state.db"
    result = CliRunner().invoke(
        main,
        ["coordinator", "serve", "--kit", str(consortium.kits / "coordinator")]
        + ["--state", str(state)],
    )
    not_yet = f"{server_certificate}: the certificate is not valid before {now + 3 * DAY:%Y-%m-%d}"
    assert result.exit_code == 1 and not_yet in result.output, result.output
    assert "Traceback" not in result.output
    assert not state.exists()  # refused before the state file was made


def test_a_certificate_within_30_days_of_expiry_is_warned_about_once_a_day_and_in_status(
    consortium: Consortium, caplog: pytest.LogCaptureFixture
) -> None:
    kit = consortium.kits / "silos" / "silo-0"
    log = logging.getLogger("test.certificates")
    watch = TlsFileWatch(kit / "ca.crt", kit / "client.crt", kit / "client.key", "silo-0", log)
    with caplog.at_level(logging.WARNING, logger=log.name):
        watch.sync()
        assert not caplog.records  # 365 days left
        fedsilo("consortium", "renew", "--kits", str(consortium.kits), "--days", "20")
        watch.sync()
        watch.sync()
    assert len(caplog.records) == 1
    message = caplog.records[0].getMessage()
    assert f"{kit / 'client.crt'} is valid until" in message and "(20 days left)" in message
    assert "fedsilo consortium renew" in message
    assert 19 < watch.days_left() <= 20
    console = Console(record=True, width=200)
    print_certificate(console, "silo-0", kit / "client.crt")
    line = console.export_text()
    assert line.startswith(f"certificate of the silo-0: {kit / 'client.crt'} is valid until")
    assert "(20 days left); renew it with `fedsilo consortium renew`" in line


def served_certificate(consortium: Consortium, silo: str = "silo-0") -> x509.Certificate:
    """The certificate the coordinator serves to a new mTLS connection (a silo's)."""
    kit = consortium.kits / "silos" / silo
    context = ssl.create_default_context(cafile=str(kit / "ca.crt"))
    context.load_cert_chain(kit / "client.crt", kit / "client.key")
    context.set_alpn_protocols(["h2"])
    with (
        socket.create_connection(("127.0.0.1", consortium.port), timeout=5) as connection,
        context.wrap_socket(connection, server_hostname="127.0.0.1") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    return x509.load_der_x509_certificate(der)


def job_status(consortium: Consortium, job: str) -> str:
    jobs = JobQueue(consortium.root / "state.db")
    try:
        return jobs.job(job).status
    finally:
        jobs.close()


def last_round(consortium: Consortium, job: str) -> int:
    with StateStore(consortium.root / "state.db") as store:
        saved = store.last_round(job)
    return saved.round if saved is not None else 0


def test_a_serving_coordinator_and_its_silos_take_renewed_certificates_and_keep_their_job(
    consortium: Consortium,
) -> None:
    coordinator_metrics, silo_metrics = free_port(), free_port()
    coordinator = consortium.start_serve("--metrics-port", str(coordinator_metrics))
    consortium.start_silo("silo-0", consortium.write_silo_config("silo-0", silo_metrics))
    for silo in SILOS[1:]:
        consortium.start_silo(silo)
    rounds = 100  # a few seconds here: still running once every silo has reconnected
    job = consortium.submit(consortium.write_policy(policy_document(rounds=rounds)))
    wait_for(lambda: last_round(consortium, job) >= 1, 60, "round 1", consortium)
    old = served_certificate(consortium)
    gauge = "fedsilo_certificate_expiry_days"
    assert 364 < metric(coordinator_metrics, gauge, party="coordinator") <= 365
    assert 364 < metric(silo_metrics, gauge, party="silo-0") <= 365

    fedsilo("consortium", "renew", "--kits", str(consortium.kits), "--days", "400")
    renewed_at = last_round(consortium, job)

    new = served_certificate(consortium)
    assert new.serial_number != old.serial_number
    assert new.serial_number == read(certificates(consortium.kits)["coordinator"]).serial_number
    assert new.not_valid_after_utc - old.not_valid_after_utc > timedelta(days=34)
    assert 399 < metric(coordinator_metrics, gauge, party="coordinator") <= 400
    assert 399 < metric(silo_metrics, gauge, party="silo-0") <= 400
    for silo in SILOS:
        consortium.wait_for_log(silo, "read the renewed certificate")
    assert renewed_at < rounds and job_status(consortium, job) == RUNNING

    wait_for(lambda: job_status(consortium, job) == COMPLETED, 120, "the job to end", consortium)
    assert coordinator.poll() is None  # the same process throughout
    assert last_round(consortium, job) == rounds
    assert [info.job_id for info in JobQueue(consortium.root / "state.db").jobs()] == [job]
    with StateStore(consortium.root / "state.db") as store:
        assert {s: status for s, (status, _) in store.participants(job).items()} == dict.fromkeys(
            SILOS, "active"
        )
    status = CliRunner().invoke(
        main,
        ["status", "--kit", str(consortium.kits / "coordinator")]
        + ["--state", str(consortium.root / "state.db")],
    )
    assert status.exit_code == 0, status.output
    assert f"valid until {new.not_valid_after_utc:%Y-%m-%d}" in status.output
