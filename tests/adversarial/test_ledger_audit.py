"""A silo's ledger against the signed receipts the coordinator kept: every way to make the ledger
claim less than was released (rewrite every record with its hashes recomputed, delete the last
record, truncate, append a forged record, edit one record and re-chain the rest, book another
epsilon than the one signed) is caught by `fedsilo privacy audit --receipts`; without receipts
the audit says it proves internal consistency only; and a torn last line (a silo killed while
booking) is set aside and repaired with a record the audit shows."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from fedsilo.coordinator.engine import RoundEngine
from fedsilo.coordinator.state import StateStore, digest_policy
from fedsilo.coordinator.strategies import make_strategy
from fedsilo.coordinator.transport import InProcessTransport
from fedsilo.ops.cli import main
from fedsilo.policies.loading import parse_policy
from fedsilo.privacy.accounting import Mechanism, epsilon
from fedsilo.privacy.identity import public_key_hex
from fedsilo.privacy.ledger import GENESIS, LedgerRecord, PrivacyLedger
from fedsilo.privacy.receipts import Receipt
from tests.adversarial.helpers import DEPLOYMENT, DP, SiloSite

pytestmark = [
    pytest.mark.filterwarnings("ignore:Full backward hook is firing"),
]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> tuple[SiloSite, Path]:
    """A two-round DP deployment of one silo, run by a coordinator with a state store: the
    silo's site (ledger, identity) and the receipts the coordinator exported."""
    folder = tmp_path_factory.mktemp("deployment")
    policy = parse_policy(
        {
            "version": 1,
            "rounds": 2,
            "model": {"name": "linear"},
            "training": {"epochs": 1, "batch_size": 16, "lr": 0.1},
            "participants": {"min_silos": 1, "phase_timeout_s": 60},
            "privacy": DP,
        }
    )
    site = SiloSite(folder / "silo")
    agent = site.agent(digest_policy(policy), policy)
    with StateStore(folder / "state.db") as store:
        RoundEngine(
            make_strategy(policy),
            InProcessTransport({site.name: agent.handle_bytes}),
            policy,
            [site.name],
            deployment=DEPLOYMENT,
            store=store,
        ).run()
    receipts = folder / "receipts.json"
    exported = fedsilo(
        "receipts", "--state", folder / "state.db", "--silo", site.name, "--out", receipts
    )
    assert exported.exit_code == 0, exported.output
    return site, receipts


def fedsilo(*args: object) -> Result:
    return CliRunner().invoke(main, ["privacy", *map(str, args)])


def audit(site: SiloSite, receipts: Path | None) -> Result:
    key = ["--receipts", receipts, "--verify-key", public_key_hex(site.identity.verify_key)]
    return fedsilo("audit", "--ledger", site.ledger_path, *(key if receipts else []))


def copy_of(site: SiloSite, tmp_path: Path) -> SiloSite:
    copy = SiloSite(tmp_path / "silo", site.name, site.identity)
    copy.folder.mkdir()
    shutil.copy(site.ledger_path, copy.ledger_path)
    return copy


def records(site: SiloSite) -> list[LedgerRecord]:
    lines = site.ledger_path.read_bytes().splitlines()
    return [LedgerRecord.from_json(json.loads(line)) for line in lines]


def write_chain(site: SiloSite, kept: list[LedgerRecord]) -> None:
    """Write `kept` as a ledger whose chain is intact: seq, prev, epsilon and every hash
    recomputed, as a forger who knows the format would."""
    chained: list[LedgerRecord] = []
    for record in kept:
        same = [r.mechanism for r in chained if r.deployment == record.deployment]
        before = epsilon(same, record.delta) if record.delta is not None else None
        after = epsilon([*same, record.mechanism], record.delta) if before is not None else None
        unsealed = replace(
            record,
            seq=len(chained) + 1,
            prev=chained[-1].hash if chained else GENESIS,
            epsilon_increment=None if after is None else after - before,
            epsilon_cumulative=after,
            hash=GENESIS,
        )
        chained.append(replace(unsealed, hash=unsealed.computed_hash()))
    site.ledger_path.write_bytes(b"".join(r.line() for r in chained))


def quieter(record: LedgerRecord) -> LedgerRecord:
    if record.mechanism.kind != "dp_sgd":
        return record
    louder = replace(record.mechanism, noise_multiplier=record.mechanism.noise_multiplier * 4)
    return replace(record, mechanism=louder)


def test_the_untouched_ledger_passes_the_audit_with_the_coordinators_receipts(deployment) -> None:
    site, receipts = deployment
    result = audit(site, receipts)
    assert result.exit_code == 0, result.output
    assert "every release the coordinator received" in result.output


def test_without_receipts_the_audit_says_it_proves_internal_consistency_only(deployment) -> None:
    site, _ = deployment
    result = audit(site, None)
    assert result.exit_code == 0, result.output
    assert "internal consistency only" in result.output


def test_every_record_rewritten_with_recomputed_hashes_is_caught_as_a_rewrite(
    deployment, tmp_path
) -> None:
    site = copy_of(deployment[0], tmp_path)
    write_chain(site, [quieter(r) for r in records(site)])
    assert audit(site, None).exit_code == 0  # internally consistent: only receipts catch it
    result = audit(site, deployment[1])
    assert result.exit_code == 1, result.output
    assert "rewritten" in result.output and "deleted" not in result.output


def test_the_deleted_last_record_is_caught(deployment, tmp_path) -> None:
    site = copy_of(deployment[0], tmp_path)
    lines = site.ledger_path.read_bytes().splitlines(keepends=True)
    site.ledger_path.write_bytes(b"".join(lines[:-1]))
    result = audit(site, deployment[1])
    assert result.exit_code == 1, result.output
    assert "deleted" in result.output


def test_a_truncated_ledger_is_caught(deployment, tmp_path) -> None:
    site = copy_of(deployment[0], tmp_path)
    lines = site.ledger_path.read_bytes().splitlines(keepends=True)
    site.ledger_path.write_bytes(b"".join(lines[: len(lines) // 2]))
    result = audit(site, deployment[1])
    assert result.exit_code == 1, result.output
    assert "deleted" in result.output


def test_an_appended_forged_record_for_a_received_release_is_caught(deployment, tmp_path) -> None:
    site = copy_of(deployment[0], tmp_path)
    booked = records(site)
    trained = next(r for r in booked if r.mechanism.kind == "dp_sgd")
    write_chain(site, [*booked, trained])
    assert audit(site, None).exit_code == 0
    result = audit(site, deployment[1])
    assert result.exit_code == 1, result.output
    assert trained.task_id in result.output


def test_one_record_edited_and_the_rest_rechained_is_caught(deployment, tmp_path) -> None:
    site = copy_of(deployment[0], tmp_path)
    booked = records(site)
    middle = next(i for i, r in enumerate(booked) if r.mechanism.kind == "dp_sgd")
    booked[middle] = quieter(booked[middle])
    write_chain(site, booked)
    result = audit(site, deployment[1])
    assert result.exit_code == 1, result.output
    assert f"seq {booked[middle].seq}" in result.output


def test_a_signed_epsilon_that_differs_from_the_recomputed_one_is_caught(
    deployment, tmp_path
) -> None:
    site, receipts = deployment
    document = json.loads(receipts.read_text())
    last = Receipt.from_json(document["receipts"][-1])
    lowered = replace(last, epsilon=last.epsilon / 2).signed(site.identity)
    document["receipts"][-1] = lowered.to_json()
    forged = tmp_path / "receipts.json"
    forged.write_text(json.dumps(document))
    result = audit(site, forged)
    assert result.exit_code == 1, result.output
    assert "epsilon" in result.output and last.task_id in result.output


def test_a_receipt_not_signed_by_the_silo_is_refused(deployment, tmp_path) -> None:
    site, receipts = deployment
    stranger = SiloSite(tmp_path, site.name, identity=type(site.identity)(b"\x09" * 32))
    result = fedsilo(
        "audit",
        "--ledger",
        site.ledger_path,
        "--receipts",
        receipts,
        "--verify-key",
        public_key_hex(stranger.identity.verify_key),
    )
    assert result.exit_code == 1, result.output
    assert "signature" in result.output


def test_a_torn_last_line_is_set_aside_and_repaired_with_a_record_the_audit_shows(
    deployment, tmp_path
) -> None:
    site = copy_of(deployment[0], tmp_path)
    intact = site.ledger_path.read_bytes()
    torn = intact.splitlines(keepends=True)[-1][:40]  # a silo killed while booking
    site.ledger_path.write_bytes(intact + torn)
    assert audit(site, None).exit_code == 1  # before the silo opens it again
    ledger = PrivacyLedger(site.ledger_path)
    aside = list(site.folder.glob(f"{site.ledger_path.name}.torn-*"))
    assert [path.read_bytes() for path in aside] == [torn]
    assert ledger.records()[-1].mechanism == Mechanism.public()
    assert site.ledger_path.read_bytes().startswith(intact)
    result = audit(site, deployment[1])
    assert result.exit_code == 0, result.output
    assert "repair" in result.output and aside[0].name in result.output


def test_a_torn_line_before_the_last_is_an_error_the_audit_names(deployment, tmp_path) -> None:
    site = copy_of(deployment[0], tmp_path)
    lines = site.ledger_path.read_bytes().splitlines(keepends=True)
    lines[1] = lines[1][:40] + b"\n"
    site.ledger_path.write_bytes(b"".join(lines))
    result = audit(site, None)
    assert result.exit_code == 1 and "line 2" in result.output, result.output
