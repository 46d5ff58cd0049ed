"""`fedsilo consortium add-silo`: the operator's command for a consortium's roster after
provisioning; it issues one more silo kit from the same CA and enrols it with the coordinator
(the next version of the signed roster, privacy/roster.py). `fedsilo consortium revoke` revokes
a silo from anywhere with the operator's kit: it reads the running coordinator's signed roster
over the admin channel (ops/admin_client.py), checks the operator's own signature on it, signs
the next version without the silo (revoked, with the reason) and sends it back; the coordinator
applies it as `fedsilo coordinator revoke` (on its host, state file only) does, and every silo
learns it with the next job's policy. `fedsilo consortium issue-operator-kit` gives an operator
folder provisioned before the operator had a kit (for `fedsilo job` and `fedsilo status`) its
kit.yaml and client certificate. `fedsilo consortium renew` issues the parties' TLS
certificates again before they expire (ops/renewal.py).
"""

from __future__ import annotations

from pathlib import Path

import click
from rich.console import Console

from fedsilo.coordinator.admin_api import AdminError
from fedsilo.ops.admin_client import AdminChannelError, AdminConnection
from fedsilo.ops.job_cli import connect, coordinator_option
from fedsilo.ops.options import kit_option
from fedsilo.ops.provision import (
    KitError,
    OperatorKit,
    ProvisionError,
    add_silo,
    issue_operator_kit,
    load_operator_kit,
)
from fedsilo.ops.renewal import Renewal, renew_certificates
from fedsilo.policies.consortium import CertificateLifetimes, load_consortium_file
from fedsilo.policies.loading import PolicyError
from fedsilo.privacy.roster import DEFAULT_REASON, RosterError, sign_roster, verify_roster
from fedsilo.wire.admin import INSTALL_ROSTER, ROSTER

console = Console()


@click.group("consortium")
def consortium_group() -> None:
    """Change a provisioned consortium's roster (enrol or revoke a silo) and renew its
    certificates."""


@consortium_group.command("add-silo")
@click.argument("name")
@click.option(
    "--ca-kit",
    "operator",
    required=True,
    type=click.Path(path_type=Path),
    help="The operator's folder from `fedsilo provision` (ca.crt, ca.key, operator.key).",
)
@click.option(
    "--coordinator-kit",
    "coordinator",
    required=True,
    type=click.Path(path_type=Path),
    help="The coordinator kit (or a copy of it); its kit.yaml roster gets the new silo.",
)
@click.option(
    "--consortium",
    "consortium_file",
    required=True,
    type=click.Path(path_type=Path),
    help="consortium.yaml: the certificate lifetimes, and the consortium's name as a check.",
)
@click.option(
    "--out",
    required=True,
    type=click.Path(path_type=Path),
    help="The kits folder; the new kit goes to OUT/silos/NAME (never replaced).",
)
def add_silo_command(
    name: str, operator: Path, coordinator: Path, consortium_file: Path, out: Path
) -> None:
    """Issue silo NAME a kit from the consortium's CA and enrol it in the coordinator's roster."""
    try:
        config = load_consortium_file(consortium_file)
        added = add_silo(name, config, operator, coordinator, out)
    except (PolicyError, ProvisionError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    console.print(
        f"Issued silo '{name}' a kit in {added.kit}/: give it to that institution's IT team "
        "over a channel you trust.\n"
        f"Enrolled '{name}' in {added.coordinator_roster} and signed roster version "
        f"{added.roster_version} (roster.json beside it). If that is a copy, put both files in "
        "place in the coordinator host's kit. A serving coordinator (`coordinator serve`) "
        f"admits '{name}' from its next job on, one started afterwards from its start.\n"
        f"The kits of {', '.join(added.existing_silos)} were not changed: they learn '{name}' "
        "from the signed roster their coordinator hands them with each job.",
        soft_wrap=True,
    )


@consortium_group.command("revoke")
@click.argument("name")
@kit_option("The operator's kit (OUT/operator from `fedsilo provision`): it signs the roster.")
@coordinator_option
@click.option("--reason", default=DEFAULT_REASON, show_default=True, help="Why, as recorded.")
def revoke_command(name: str, kit_dir: Path, reason: str) -> None:
    """Revoke silo NAME: sign the next roster without it and send it to the coordinator."""
    try:
        kit = load_operator_kit(kit_dir)
        with connect(kit) as connection:
            installed = revoke_remotely(connection, kit, name, reason)
    except (KitError, RosterError, AdminError, AdminChannelError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    console.print(
        f"Revoked '{name}' ({reason}) in roster version {installed['version']}: the coordinator "
        f"refuses it from now on; members: {', '.join(installed['silos']) or 'none'}.",
        soft_wrap=True,
    )


def revoke_remotely(connection: AdminConnection, kit: OperatorKit, name: str, reason: str) -> dict:
    """The coordinator's signed roster, checked under the operator's own key, its next version
    without `name` signed and installed; the coordinator's answer."""
    current = connection.call(ROSTER).data
    if not isinstance(current, dict):
        raise RosterError("the coordinator's roster reply is not a signed roster")
    roster = verify_roster(
        str(current.get("roster")),
        str(current.get("signature")),
        kit.signing_key.verify_key,
        kit.consortium,
    )
    following = sign_roster(roster.document.revoking(name, reason), kit.signing_key)
    return connection.call(INSTALL_ROSTER, **following.to_json()).data


@consortium_group.command("issue-operator-kit")
@click.option(
    "--operator",
    required=True,
    type=click.Path(path_type=Path),
    help="The operator's folder from `fedsilo provision` (ca.crt, ca.key, operator.key).",
)
@click.option(
    "--coordinator-kit",
    "coordinator",
    required=True,
    type=click.Path(path_type=Path),
    help="The coordinator kit (or a copy of it): its address and verify key go in kit.yaml.",
)
def issue_operator_kit_command(operator: Path, coordinator: Path) -> None:
    """Add kit.yaml and a client certificate for `operator` to an older operator folder."""
    try:
        issue_operator_kit(operator, coordinator)
    except (ProvisionError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    console.print(
        f"Wrote {operator}/kit.yaml, client.crt and client.key: `fedsilo job ... --kit "
        f"{operator}` now administers the coordinator.",
        soft_wrap=True,
    )


@consortium_group.command("renew")
@click.option(
    "--kits",
    required=True,
    type=click.Path(path_type=Path),
    help="The kits folder of `fedsilo provision --out` (coordinator/, silos/NAME/, operator/).",
)
@click.option(
    "--ca-kit",
    "operator",
    type=click.Path(path_type=Path),
    help="The operator's folder (ca.crt, ca.key, client.crt)  [default: KITS/operator]",
)
@click.option(
    "--coordinator-kit",
    "coordinator",
    type=click.Path(path_type=Path),
    help="The coordinator kit (server.crt; its roster gets the silos' new fingerprints)  "
    "[default: KITS/coordinator]",
)
@click.option(
    "--party",
    "parties",
    multiple=True,
    help="Renew only this party's certificate: coordinator, operator or a silo's name "
    "(repeatable; default: every party).",
)
@click.option(
    "--days",
    type=click.IntRange(min=1),
    default=CertificateLifetimes().client_days,
    show_default=True,
    help="Validity of the renewed certificates, from now.",
)
@click.option(
    "--within",
    type=click.IntRange(min=0),
    help="Renew only certificates that expire within this many days (e.g. from a daily job).",
)
def renew_command(
    kits: Path,
    operator: Path | None,
    coordinator: Path | None,
    parties: tuple[str, ...],
    days: int,
    within: int | None,
) -> None:
    """Issue the parties' TLS certificates again from the consortium's CA, for the same names
    and keys, before they expire."""
    try:
        renewal = renew_certificates(
            operator or kits / "operator",
            coordinator or kits / "coordinator",
            kits,
            days,
            parties,
            within,
        )
    except (ProvisionError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    _print_renewal(renewal)


def _print_renewal(renewal: Renewal) -> None:
    for item in renewal.renewed:
        console.print(
            f"renewed {item.party}'s {item.path}: valid until {item.new_expiry:%Y-%m-%d} (was "
            f"{item.old_expiry:%Y-%m-%d}; the old certificate kept as {item.backup.name})",
            soft_wrap=True,
        )
    for party, path, expiry in renewal.not_due:
        console.print(f"kept {party}'s {path}: valid until {expiry:%Y-%m-%d}", soft_wrap=True)
    for party in renewal.missing:
        console.print(f"[yellow]not renewed:[/yellow] {party}: no kit folder here", soft_wrap=True)
    for silo, reason in renewal.revoked:
        console.print(
            f"[yellow]not renewed:[/yellow] {silo}: revoked ({reason})",
            soft_wrap=True,
            highlight=False,
        )
    if renewal.roster is not None:
        console.print(f"the roster {renewal.roster} lists the silos' new fingerprints")
    if renewal.renewed:
        console.print(
            "Keys are unchanged: a renewed certificate is public, give each party its new file "
            "(a silo its client.crt, the coordinator host its server.crt and kit.yaml). Running "
            "parties use them without a restart: the coordinator for new connections, a silo "
            "from its next exchange.",
            soft_wrap=True,
        )
