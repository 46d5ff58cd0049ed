"""`fedsilo silo start`: a hospital's silo agent as a service.

It reads the site's own configuration (silo/config.py) and kit, refuses a certificate that is
expired or not yet valid, connects out to the coordinator over mTLS (directly or through the
HTTP CONNECT proxy silo/proxy.py chooses, said in its log), joins, checks the operator's
signature on the policy and the site's local rules, records the digest of every policy it
accepted, loads its own data, and runs tasks until the deployment is complete. Under a
coordinator that serves several jobs (`coordinator serve`) it stays connected and takes part in
job after job, each with an agent of its own (`_start_agent`), refusing the jobs its rules do
not allow. silo.yaml is read again for each job, so a site changes its rules or its data
between jobs without restarting the agent (the kit, the metrics port and the route to the
coordinator stay those it started with), and the installed plug-ins are read afresh
(policies/plugin_loading.py): a plug-in package installed while the agent runs is used from the
next job on, and one that changed on disk since the agent loaded it is refused, the refusal
saying the agent must restart. A renewed certificate in the kit is used from the next exchange
on (silo/channel.py), and its days left are the gauge
`fedsilo_certificate_expiry_days{party=<silo>}`. A job's peers (whose signatures and sealing
keys the silo trusts: secure aggregation, hand-offs) are those of the operator-signed roster
that comes with its policy (silo/roster_gate.py; the newest one seen is kept in the silo's
state folder), so a silo enrolled later takes part without any kit being issued again; before
any roster (kits provisioned before rosters were signed) they are the kit's `peers`.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from fedsilo.ops.health import HealthFile
from fedsilo.ops.job_id import job_id
from fedsilo.ops.metrics import SiloMetrics, serve_metrics
from fedsilo.ops.provision import SiloKit, load_silo_kit
from fedsilo.ops.silo_check import read_site_source
from fedsilo.policies.plugin_loading import read_afresh
from fedsilo.policies.schema import Policy
from fedsilo.privacy.accounting import total
from fedsilo.privacy.certificate_files import TlsFileWatch
from fedsilo.privacy.certificates import certificate_fingerprint
from fedsilo.privacy.identity import noise_secret, public_key_hex
from fedsilo.privacy.ledger import LedgerError, PrivacyLedger
from fedsilo.privacy.roster import RosterEntry, SignedRoster
from fedsilo.silo.agent import SiloAgent
from fedsilo.silo.budget_plan import describe, fmt
from fedsilo.silo.channel import ChannelSettings
from fedsilo.silo.client import CoordinatorConnection, SiloClient, SiloIdentity
from fedsilo.silo.config import SiloConfig, load_silo_config
from fedsilo.silo.device import resolve_device
from fedsilo.silo.domains import check_domains
from fedsilo.silo.heartbeat import Heartbeat
from fedsilo.silo.proxy import route
from fedsilo.silo.readiness import check_model_for
from fedsilo.silo.roster_gate import RosterGate
from fedsilo.silo.tasks.base import SiloKeys
from fedsilo.wire.messages import STATUS_BUDGET_EXHAUSTED, BadTaskConfig, TaskMessage
from fedsilo.wire.payload import AnyPayload

log = logging.getLogger("fedsilo.silo")

ACCEPTED_POLICIES = "accepted_policies.jsonl"


class BudgetRefused(ValueError):
    """A job this site cannot afford: its plan is above the site's caps (the message has the
    numbers)."""


def run_silo(
    config_path: Path,
    stop: threading.Event | None = None,
    poll_seconds: float = 5.0,
    health_file: Path | None = None,
) -> str:
    """Take part in the deployment; returns why the agent stopped. `health_file`: kept up to
    date for `fedsilo-health` (ops/health.py), ready while the coordinator answers heartbeats."""
    stop = stop or threading.Event()
    config = load_silo_config(config_path)
    note = config.data.shape_note()
    if note is not None:
        log.warning("%s: %s", config_path, note)
    kit = load_silo_kit(config.kit_path(config_path))
    read_site_source(config, config_path.parent)  # data no job could read: refused at start
    settings = _settings(kit, config, poll_seconds)
    log.info(
        "silo %s reaches the coordinator at %s %s",
        kit.name,
        kit.coordinator_address,
        settings.route.describe(),
    )
    metrics = SiloMetrics()
    metrics.watch_certificate(kit.name, settings.tls.days_left)
    server = (
        serve_metrics(metrics.registry, config.metrics_port)
        if config.metrics_port is not None
        else None
    )
    connection = CoordinatorConnection(settings, silo_identity(kit), stop)
    at_job_end: list[Callable[[], None]] = []  # the running job's agent's check, at its end

    def on_finish(check: Callable[[], None]) -> None:
        at_job_end[:] = [check]

    def job_finished() -> None:
        while at_job_end:
            at_job_end.pop()()

    client = SiloClient(
        connection,
        kit.operator_verify_key,
        # silo.yaml is read again for each job: a site changes its rules or data between jobs
        # without restarting its agent (the kit and metrics port are the ones it started with)
        check_policy=lambda policy, digest: load_silo_config(config_path).rules.violations(policy),
        start_agent=lambda policy, digest, attempt, roster: _start_agent(
            load_silo_config(config_path),
            config_path,
            kit,
            policy,
            digest,
            attempt,
            metrics,
            roster,
            on_finish,
        ),
        record_decision=lambda policy, digest, attempt, problems: _record_decision(
            config_path, policy, digest, attempt, problems
        ),
        roster_gate=roster_gate(kit, config.state_path(config_path)),
        job_finished=job_finished,
    )
    heartbeat = Heartbeat(connection).start()
    health = (
        HealthFile(health_file, "silo", lambda: heartbeat.answered_at).start()
        if health_file is not None
        else None
    )
    try:
        metrics.set_connected(True)
        reason = client.run()
        log.info("silo %s stops: %s", kit.name, reason)
        return reason
    finally:
        metrics.set_connected(False)
        if health is not None:
            health.stop()
        heartbeat.stop()
        connection.close()
        if server is not None:
            server.close()


def _record_decision(
    config_path: Path, policy: Policy, digest: str, attempt: int, problems: list[str]
) -> None:
    """The silo's final word on an attempt at a policy (its rules, then its data, model and
    device), kept in `accepted_policies.jsonl` beside the site's privacy ledger (by default
    beside silo.yaml; in the container image on its state volume, as silo.yaml is read-only)."""
    record = {
        "at": time.time(),
        "policy": policy.name,
        "digest": digest,
        "attempt": attempt,
        "accepted": not problems,
        "broken_rules": problems,
    }
    folder = load_silo_config(config_path).ledger_path(config_path).parent
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / ACCEPTED_POLICIES).open("a") as log_file:
        log_file.write(json.dumps(record) + "\n")


def _start_agent(
    config: SiloConfig,
    config_path: Path,
    kit: SiloKit,
    policy: Policy,
    digest: str,
    attempt: int,
    metrics: SiloMetrics,
    roster: SignedRoster | None = None,
    on_finish: Callable[[Callable[[], None]], None] = lambda check: None,
) -> Callable[[bytes], bytes]:
    for package, changes in read_afresh().items():
        log.warning(
            "silo %s: plug-in package %s changed since this agent loaded it (%s): a job using it "
            "is refused until the agent restarts",
            kit.name,
            package,
            changes,
        )
    device, why = resolve_device((config.compute or policy.compute).device)
    data = config.load_data(config_path, policy.seed)
    check_domains(policy, data)
    check_model_for(policy, data)  # acceptance means ready: the model builds and trains here
    log.info("silo %s: %d training rows, device %s", kit.name, len(data.y_train), why)
    ledger = PrivacyLedger(config.ledger_path(config_path))
    job = job_id(policy.name, digest, attempt)
    agent = SiloAgent(
        kit.name,
        data,
        policy,
        device=device,
        policy_digest=digest,
        secret=noise_secret(kit.signing_key),
        ledger=ledger,
        deployment=job,
        epsilon_cap=config.rules.epsilon_cap,
        total_epsilon_cap=config.rules.total_epsilon_cap,
        keys=silo_keys(kit, roster),
        state=config.state_path(config_path),
    )
    plan = agent.budget_plan()
    problem = agent.budget_refusal(plan)
    if problem is not None:  # refused before anything is booked
        raise BudgetRefused(problem)
    if plan.epsilon is not None:
        log.info("silo %s plans epsilon %s for %s (%s)", kit.name, fmt(plan.epsilon), job,
                 describe(plan))  # fmt: skip
    spent = ledger.spent(job)
    log.info(
        "silo %s books every answer in %s (epsilon spent on %s: %s)",
        kit.name,
        ledger.path,
        job,
        "none, the policy asks for no DP" if spent is None else f"{spent:.6g}",
    )

    def export_epsilon() -> None:  # fedsilo_silo_epsilon_*: this job's, and over all jobs
        try:
            booked = ledger.spent(job)
            over_all = total([booked, ledger.spent_elsewhere(job)])
        except LedgerError as exc:  # never costs an answer: the next booking refuses instead
            log.warning("silo %s: epsilon metrics not updated: %s", kit.name, exc)
            return
        metrics.set_epsilon(kit.name, job, booked, over_all, config.rules.total_epsilon_cap)

    export_epsilon()

    def compare_with_plan() -> None:  # at the job's end: planned equals spent
        difference = agent.spent_against_plan(plan)
        if difference is not None:
            log.warning("silo %s: %s", kit.name, difference)

    on_finish(compare_with_plan)

    def endpoint(payload: bytes) -> AnyPayload:
        metrics.count_bytes("to_silo", len(payload))
        try:
            task = TaskMessage.decode(payload)
        except BadTaskConfig:  # a task it names but cannot read: refused unrun, and booked
            return agent.handle_bytes(payload)
        result, encoded = agent.respond(task)
        export_epsilon()
        metrics.observe_task(task.kind, result.status, result.compute_seconds)
        if task.kind == "train" and result.ok:
            metrics.observe_local_train(result.compute_seconds)
        if result.status == STATUS_BUDGET_EXHAUSTED:
            log.warning("silo %s refuses %s: %s", kit.name, task.task_id, result.error)
        metrics.count_bytes("from_silo", len(encoded))
        return encoded

    return endpoint


def roster_gate(kit: SiloKit, state: Path) -> RosterGate:
    """The gate of the rosters the coordinator sends, keeping the newest in `state`; the silo's
    own entry is read when a roster comes, so a certificate renewed meanwhile is the one
    compared."""

    def own() -> RosterEntry:
        return RosterEntry(
            certificate_fingerprint=certificate_fingerprint(kit.tls.certificate.read_bytes()),
            verify_key=public_key_hex(kit.signing_key.verify_key),
            sealing_public_key=public_key_hex(kit.sealing_key.public_key),
        )

    return RosterGate(kit.name, kit.consortium, kit.operator_verify_key, own, state)


def silo_keys(kit: SiloKit, roster: SignedRoster | None = None) -> SiloKeys:
    """The silo's identity and its peers' keys: the signed roster's members (the silo checked
    its own entry), or, without a roster, its kit's peers as provisioning pinned them."""
    if roster is not None:
        members = roster.document.silos
        verify = {name: entry.verify for name, entry in members.items()}
        sealing = {name: entry.sealing for name, entry in members.items()}
    else:
        verify = {name: peer.verify_key for name, peer in kit.peers.items()}
        sealing = {name: peer.sealing_public_key for name, peer in kit.peers.items()}
    return SiloKeys(
        identity=kit.signing_key,
        roster={**verify, kit.name: kit.signing_key.verify_key},
        sealing_key=kit.sealing_key,
        sealing_roster={**sealing, kit.name: kit.sealing_key.public_key},
    )


def _settings(kit: SiloKit, config: SiloConfig, poll_seconds: float) -> ChannelSettings:
    """The channel's settings; a certificate that is not valid now (`CertificateError`) or a
    malformed proxy URL in the environment (`ProxyError`) is refused, naming it."""
    return ChannelSettings(
        address=kit.coordinator_address,
        tls=TlsFileWatch(
            kit.tls.ca_certificate, kit.tls.certificate, kit.tls.private_key, kit.name, log
        ),
        route=route(kit.coordinator_address, config.coordinator.proxy, os.environ),
        poll_seconds=poll_seconds,
    )


def silo_identity(kit: SiloKit) -> SiloIdentity:
    return SiloIdentity(kit.name, kit.consortium, kit.signing_key, kit.coordinator_verify_key)
