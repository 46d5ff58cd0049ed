"""`fedsilo consortium add-silo`: the operator's command for a consortium's roster after
provisioning; it issues one more silo kit from the same CA and enrols it with the coordinator.
`fedsilo consortium issue-operator-kit` gives an operator folder provisioned before the
operator had a kit (for `fedsilo job` and `fedsilo status`) its kit.yaml and client certificate.

The consortium-wide `revoke` stays `fedsilo coordinator revoke` (it writes the coordinator's
state file, on the coordinator host).
"""

from __future__ import annotations

from pathlib import Path

import click
from rich.console import Console

from fedsilo.ops.provision import ProvisionError, add_silo, issue_operator_kit
from fedsilo.policies.consortium import load_consortium_file
from fedsilo.policies.loading import PolicyError

console = Console()


@click.group("consortium")
def consortium_group() -> None:
    """Change a provisioned consortium's roster."""


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
