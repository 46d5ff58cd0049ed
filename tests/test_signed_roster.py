"""The consortium's signed roster: the operator signs its membership (privacy/roster.py),
provisioning and `consortium add-silo` write growing versions into the coordinator kit, and a
silo takes its peers from the roster its coordinator hands it only when the operator signed it,
for its consortium, no older than the newest it has seen, and listing the silo as it knows
itself; the coordinator is never trusted (the attacks below answer the real `SiloClient`'s
join with a doctored POLICY reply)."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from click.testing import CliRunner
from nacl.encoding import HexEncoder
from nacl.signing import SigningKey

from fedsilo.coordinator.admin_api import AdminError
from fedsilo.coordinator.jobs import COMPLETED, JobQueue
from fedsilo.ops.cli import main
from fedsilo.ops.coordinator_process import close_serving, open_serving
from fedsilo.ops.coordinator_serve import ServeBackend
from fedsilo.ops.provision import KitError, load_coordinator_kit, load_silo_kit
from fedsilo.ops.silo_process import roster_gate, silo_keys
from fedsilo.privacy.identity import read_signing_key
from fedsilo.privacy.roster import (
    ROSTER_FILE,
    RosterDocument,
    RosterError,
    SignedRoster,
    not_older,
    sign_roster,
    verify_roster,
)
from fedsilo.silo.client import SiloClient, SiloIdentity
from fedsilo.wire.control import ACCEPT, ACK, JOIN, POLICY, REFUSE, Control, decode_control
from tests.deployment import SILOS, Consortium, fedsilo, policy_document, provision
from tests.test_serve import participants, wait_until_ended

POLICY_TEXT = (
    Path(__file__).parents[1] / "policies" / "examples" / "heart-fedavg.yaml"
).read_text()
CONSORTIUM = "test-consortium"


@pytest.fixture(scope="module")
def consortium(tmp_path_factory: pytest.TempPathFactory) -> Consortium:
    return provision(tmp_path_factory.mktemp("roster"))


def operator_key(consortium: Consortium) -> SigningKey:
    return read_signing_key(consortium.kits / "operator" / "operator.key")


def first_roster(consortium: Consortium) -> SignedRoster:
    roster = load_coordinator_kit(consortium.kits / "coordinator").roster
    assert roster is not None
    return roster


# -- the document ---------------------------------------------------------------------------


def test_provisioning_signs_version_1_listing_every_silo_as_the_coordinator_kit_has_it(
    consortium: Consortium,
) -> None:
    kit = load_coordinator_kit(consortium.kits / "coordinator")
    roster = first_roster(consortium)
    assert (roster.version, roster.document.consortium) == (1, CONSORTIUM)
    assert sorted(roster.document.silos) == list(SILOS) and roster.document.revoked == {}
    for name, silo in kit.silos.items():
        assert roster.document.silos[name].verify == silo.verify_key
        assert roster.document.silos[name].sealing == silo.sealing_public_key
        fingerprint = roster.document.silos[name].certificate_fingerprint
        assert fingerprint == silo.certificate_fingerprint


def test_a_signed_roster_verifies_under_the_operator_key_only(consortium: Consortium) -> None:
    roster = first_roster(consortium)
    key = operator_key(consortium)
    assert verify_roster(roster.text, roster.signature, key.verify_key, CONSORTIUM) == roster
    with pytest.raises(RosterError, match="does not verify"):
        verify_roster(roster.text, roster.signature, SigningKey.generate().verify_key, CONSORTIUM)


def test_a_tampered_roster_is_refused(consortium: Consortium) -> None:
    roster = first_roster(consortium)
    key = operator_key(consortium).verify_key
    tampered = roster.text.replace('"version":1', '"version":9')
    assert tampered != roster.text
    with pytest.raises(RosterError, match="does not verify"):
        verify_roster(tampered, roster.signature, key, CONSORTIUM)
    with pytest.raises(RosterError, match="not hex"):
        verify_roster(roster.text, "unsigned", key, CONSORTIUM)


def test_a_roster_of_another_consortium_or_not_canonical_is_refused() -> None:
    key = SigningKey.generate()
    other = sign_roster(RosterDocument(consortium="other", version=1, silos={}), key)
    with pytest.raises(RosterError, match="consortium 'other'"):
        verify_roster(other.text, other.signature, key.verify_key, CONSORTIUM)
    spaced = json.dumps(json.loads(other.text), indent=1)
    signature = HexEncoder.encode(key.sign(spaced.encode()).signature).decode()
    with pytest.raises(RosterError, match="canonical"):
        verify_roster(spaced, signature, key.verify_key, "other")


def test_an_older_roster_or_another_with_the_same_version_is_refused(
    consortium: Consortium,
) -> None:
    first = first_roster(consortium)
    key = operator_key(consortium)
    second = sign_roster(first.document.revoking("silo-2", "left"), key)
    not_older(second, first)
    not_older(second, second)
    with pytest.raises(RosterError, match="rolled-back"):
        not_older(first, second)
    rival = sign_roster(first.document.revoking("silo-0", "left"), key)
    with pytest.raises(RosterError, match="same version 2"):
        not_older(rival, second)


def test_revoking_moves_a_member_to_revoked_with_its_reason_and_refuses_a_stranger(
    consortium: Consortium,
) -> None:
    document = first_roster(consortium).document.revoking("silo-1", "audit failed")
    assert (document.version, sorted(document.silos)) == (2, ["silo-0", "silo-2"])
    assert document.revoked == {"silo-1": "audit failed"}
    with pytest.raises(RosterError, match="already revoked"):
        document.revoking("silo-1", "again")
    with pytest.raises(RosterError, match="not a member"):
        document.revoking("nobody", "why")


# -- the coordinator kit --------------------------------------------------------------------


def test_add_silo_signs_the_next_version_and_a_kit_without_a_roster_still_loads(
    tmp_path: Path,
) -> None:
    consortium = provision(tmp_path)
    consortium.add_silo("silo-3")
    roster = first_roster(consortium)
    assert (roster.version, sorted(roster.document.silos)) == (2, [*SILOS, "silo-3"])

    (consortium.kits / "coordinator" / ROSTER_FILE).unlink()  # a kit from before rosters
    kit = load_coordinator_kit(consortium.kits / "coordinator")
    assert kit.roster is None and sorted(kit.silos) == [*SILOS, "silo-3"]
    consortium.add_silo("silo-4")  # its first roster, from kit.yaml's silos
    roster = first_roster(consortium)
    assert (roster.version, sorted(roster.document.silos)) == (1, [*SILOS, "silo-3", "silo-4"])


def test_a_coordinator_kit_whose_roster_and_kit_yaml_disagree_on_a_member_is_refused(
    tmp_path: Path,
) -> None:
    consortium = provision(tmp_path)
    first = first_roster(consortium)
    impostor = SigningKey.generate().verify_key.encode(HexEncoder).decode()
    entry = first.document.silos["silo-0"].model_copy(update={"verify_key": impostor})
    forged = first.document.following({**first.document.silos, "silo-0": entry}, {})
    path = consortium.kits / "coordinator" / ROSTER_FILE
    path.write_text(json.dumps(sign_roster(forged, operator_key(consortium)).to_json()))
    with pytest.raises(KitError, match="silo 'silo-0' of roster version 2 is not as in"):
        load_coordinator_kit(consortium.kits / "coordinator")


def test_a_serving_coordinator_installs_only_a_newer_signed_roster_and_revokes_as_it_says(
    tmp_path: Path,
) -> None:
    consortium = provision(tmp_path)
    kit = load_coordinator_kit(consortium.kits / "coordinator")
    serving = open_serving(kit, tmp_path / "state.db", None, 0.5, 1 << 20, None, workers=4)
    jobs = JobQueue(tmp_path / "state.db")
    try:
        backend = ServeBackend(serving, jobs, tmp_path / "state.jobs", tmp_path / "state.db")
        key, first = operator_key(consortium), first_roster(consortium)
        assert backend.roster() == first.to_json()
        second = sign_roster(first.document.revoking("silo-1", "audit failed"), key)
        forged = sign_roster(second.document, SigningKey.generate())
        with pytest.raises(AdminError, match="does not verify"):
            backend.install_roster(forged.text, forged.signature)

        installed = backend.install_roster(second.text, second.signature)

        assert installed == {
            "version": 2,
            "silos": ["silo-0", "silo-2"],
            "revoked": {"silo-1": "audit failed"},
        }
        assert first_roster(consortium) == second  # kept in the kit
        assert backend.consortium_status()["silos"]["silo-1"] == {
            "connected": False,
            "revoked": True,
            "reason": "audit failed",
        }
        assert serving.service.roster == second
        for stale, why in [(first, "rolled-back"), (second, "installed already")]:
            with pytest.raises(AdminError, match=why):
                backend.install_roster(stale.text, stale.signature)
        reinstated = sign_roster(second.document.following(first.document.silos, {}), key)
        with pytest.raises(AdminError, match="stays revoked: silo-1"):
            backend.install_roster(reinstated.text, reinstated.signature)
    finally:
        jobs.close()
        close_serving(serving)


# -- a silo never trusts its coordinator with the roster ---------------------------------------


@dataclass
class DoctoringCoordinator:
    """Answers a join with the signed policy and whatever roster fields it is told to."""

    operator: SigningKey
    roster_fields: dict
    stop: threading.Event = field(default_factory=threading.Event)
    sent: list[tuple[str, bytes]] = field(default_factory=list)

    @property
    def identity(self) -> SiloIdentity:
        key = SigningKey.generate()
        return SiloIdentity("silo-0", CONSORTIUM, key, key.verify_key)

    def exchange(self, payload: bytes, label: str, round_no: int = 0) -> bytes:
        self.sent.append((label, payload))
        if label == JOIN:
            signature = HexEncoder.encode(self.operator.sign(POLICY_TEXT.encode()).signature)
            fields = {"policy": POLICY_TEXT, "signature": signature.decode(), "more": True}
            return Control(POLICY, {**fields, **self.roster_fields}).encode()
        return Control(ACK, {"accepted": True, "reason": ""}).encode()

    def control(self, kind: str, fields: dict | None = None) -> bytes:
        return Control(kind, fields or {}).encode()

    def refusal(self) -> str | None:
        refused = [decode_control(p) for label, p in self.sent if label == REFUSE]
        return str(refused[0].get("reason")) if refused else None


def join(
    consortium: Consortium, state: Path, roster_fields: dict, silo: str = "silo-0"
) -> tuple[DoctoringCoordinator, list[SignedRoster | None]]:
    """The real join path of `silo`'s agent (its kit, its roster gate keeping state in
    `state`) against a coordinator that answers with `roster_fields`; the rosters its agent was
    started with."""
    coordinator = DoctoringCoordinator(operator_key(consortium), roster_fields)
    started: list[SignedRoster | None] = []

    def start_agent(policy, digest, attempt, roster):
        started.append(roster)
        return lambda payload: payload

    kit = load_silo_kit(consortium.kits / "silos" / silo)
    client = SiloClient(
        coordinator,  # type: ignore[arg-type]
        coordinator.operator.verify_key,
        check_policy=lambda policy, digest: [],
        start_agent=start_agent,
        roster_gate=roster_gate(kit, state),
    )
    client.join()
    return coordinator, started


def fields(roster: SignedRoster) -> dict:
    return {"roster": roster.text, "roster_signature": roster.signature}


def test_a_silo_takes_its_peers_from_a_signed_roster_and_keeps_its_version(
    tmp_path: Path, consortium: Consortium
) -> None:
    key = operator_key(consortium)
    first = first_roster(consortium)
    newcomer = first.document.silos["silo-2"]  # the keys of one more member, for the test
    grown = sign_roster(
        first.document.following({**first.document.silos, "new": newcomer}, {}), key
    )
    coordinator, started = join(consortium, tmp_path / "state", fields(grown))
    assert coordinator.refusal() is None and started == [grown]
    keys = silo_keys(load_silo_kit(consortium.kits / "silos" / "silo-0"), grown)
    assert sorted(keys.roster) == sorted(keys.sealing_roster) == ["new", *SILOS]
    assert keys.roster["new"] == newcomer.verify
    stored = json.loads((tmp_path / "state" / ROSTER_FILE).read_text())
    assert stored == grown.to_json()


@pytest.mark.parametrize(
    ("doctor", "refusal"),
    [
        (lambda r, key: {**fields(r), "roster_signature": "00" * 64}, "does not verify"),
        (
            lambda r, key: {**fields(r), "roster": r.text.replace("silo-1", "silo-9")},
            "does not verify",
        ),
        (
            lambda r, key: fields(sign_roster(r.document, SigningKey.generate())),
            "does not verify",
        ),
        (
            lambda r, key: fields(
                sign_roster(r.document.model_copy(update={"consortium": "other"}), key)
            ),
            "consortium 'other'",
        ),
        (
            lambda r, key: fields(sign_roster(r.document.revoking("silo-0", "stolen laptop"), key)),
            "revokes this silo: stolen laptop",
        ),
        (
            lambda r, key: fields(
                sign_roster(
                    r.document.following(
                        {
                            "silo-0": r.document.silos["silo-1"],
                            "silo-1": r.document.silos["silo-1"],
                        },
                        {},
                    ),
                    key,
                )
            ),
            "another certificate_fingerprint, verify_key, sealing_public_key",
        ),
        (
            lambda r, key: fields(
                sign_roster(r.document.following({"silo-1": r.document.silos["silo-1"]}, {}), key)
            ),
            "does not list this silo",
        ),
    ],
    ids=[
        "bad-signature",
        "tampered",
        "another-key",
        "other-consortium",
        "revoked",
        "not-me",
        "missing",
    ],
)
def test_a_silo_refuses_the_job_of_a_roster_it_cannot_trust_naming_why(
    tmp_path: Path, consortium: Consortium, doctor, refusal: str
) -> None:
    doctored = doctor(first_roster(consortium), operator_key(consortium))
    coordinator, started = join(consortium, tmp_path / "state", doctored)
    assert started == []
    assert refusal in (coordinator.refusal() or "")
    assert "roster refused" in (coordinator.refusal() or "")


def test_a_silo_refuses_a_rolled_back_or_withheld_roster_also_after_a_restart(
    tmp_path: Path, consortium: Consortium
) -> None:
    key = operator_key(consortium)
    first = first_roster(consortium)
    second = sign_roster(first.document.revoking("silo-2", "left"), key)
    assert join(consortium, tmp_path / "state", fields(second))[0].refusal() is None
    # a new gate (a restarted agent) reads the newest version seen from the state folder
    rolled_back, started = join(consortium, tmp_path / "state", fields(first))
    assert started == [] and "rolled-back" in (rolled_back.refusal() or "")
    withheld, started = join(consortium, tmp_path / "state", {})
    assert started == [] and "sent no roster" in (withheld.refusal() or "")


def test_a_silo_that_never_saw_a_roster_works_with_its_kit_peers(
    tmp_path: Path, consortium: Consortium
) -> None:
    coordinator, started = join(consortium, tmp_path / "state", {})
    assert coordinator.refusal() is None and started == [None]
    assert [label for label, _ in coordinator.sent] == [JOIN, ACCEPT]


# -- real processes: a silo enrolled while serving, then one revoked from afar ----------------


def test_a_silo_enrolled_while_serving_masks_with_all_and_a_remote_revocation_refuses_one(
    tmp_path: Path,
) -> None:
    consortium = provision(tmp_path)
    data = {"source": "sklearn:breast_cancer", "partition": {"kind": "iid", "silos": 4}}
    masked = {"secure_aggregation": {"method": "masking"}, "data": data}
    try:
        consortium.start_serve()
        for silo in SILOS:
            consortium.start_silo(silo, consortium.write_silo_config(silo, data=data))
        consortium.wait_for_log("coordinator", "serving mTLS gRPC")
        consortium.add_silo("silo-3")  # no other kit is issued again
        consortium.start_silo("silo-3", consortium.write_silo_config("silo-3", data=data))
        everyone = [*SILOS, "silo-3"]
        first = consortium.submit(
            consortium.write_policy(
                policy_document(
                    rounds=1,
                    name="all",
                    participants={"min_silos": 4, "phase_timeout_s": 20},
                    **masked,
                ),
                "all.yaml",
            )
        )
        assert wait_until_ended(consortium, first).status == COMPLETED
        assert participants(consortium, first) == dict.fromkeys(everyone, "active")

        fedsilo(
            "consortium",
            "revoke",
            "silo-1",
            "--kit",
            str(consortium.kits / "operator"),
            "--reason",
            "audit failed",
        )
        assert consortium.wait("silo-1", timeout=30) != 0  # refused: the agent ends
        consortium.processes.pop("silo-1")
        assert "revoked" in consortium.log("silo-1")
        assert first_roster(consortium).document.revoked == {"silo-1": "audit failed"}
        again = CliRunner().invoke(
            main, ["consortium", "revoke", "silo-1", "--kit", str(consortium.kits / "operator")]
        )
        assert again.exit_code == 1 and "silo-1: already revoked" in again.output
        second = consortium.submit(
            consortium.write_policy(policy_document(rounds=1, name="after", **masked), "after.yaml")
        )
        assert wait_until_ended(consortium, second).status == COMPLETED
        assert participants(consortium, CONSORTIUM)["silo-1"] == "revoked"
        left = ["silo-0", "silo-2", "silo-3"]
        assert participants(consortium, second) == dict.fromkeys(left, "active")
        assert "roster version 3" in consortium.log("silo-0")
    finally:
        consortium.stop_all()
