"""The consortium operator's commands: `fedsilo provision` writes the startup kits, and
`fedsilo policy sign` signs a deployment policy with the operator key.

Both are plain click commands; `ops/cli.py` registers `provision` on the main group and
`ops/commands.py` `sign` on the `policy` group.
"""

from __future__ import annotations

from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from fedsilo.ops.provision import (
    ProvisionedConsortium,
    ProvisionError,
    provision,
    write_example_consortium,
)
from fedsilo.policies.consortium import load_consortium_file
from fedsilo.policies.loading import PolicyError, load_policy, signable_policy_file
from fedsilo.privacy.identity import IdentityError, read_signing_key
from fedsilo.privacy.policy_signing import policy_digest, sign_policy

console = Console()


@click.command("provision")
@click.option(
    "--consortium",
    "consortium_file",
    type=click.Path(path_type=Path),
    help="consortium.yaml: the consortium's name, coordinator address, silos, lifetimes.",
)
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    help="New (or empty) folder for the kits; an existing kit is never replaced.",
)
@click.option(
    "--example",
    "example_file",
    type=click.Path(path_type=Path),
    help="Only write a commented consortium.yaml, every key explained, to this new path.",
)
def provision_command(
    consortium_file: Path | None, out: Path | None, example_file: Path | None
) -> None:
    """Create the CA, every key and one startup kit per party of a consortium."""
    if example_file is not None:
        if consortium_file is not None or out is not None:
            raise click.ClickException("--example writes an example only; drop --consortium/--out")
        try:
            write_example_consortium(example_file)
        except (ProvisionError, OSError) as exc:
            raise click.ClickException(str(exc)) from None
        console.print(f"wrote {example_file}: edit it, then provision --consortium {example_file}")
        return
    if consortium_file is None or out is None:
        raise click.ClickException("give --consortium FILE and --out FOLDER (or --example PATH)")
    try:
        config = load_consortium_file(consortium_file)
        provisioned = provision(config, out)
    except (PolicyError, ProvisionError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    console.print(f"Provisioned consortium '{config.consortium}' in {out}/")
    console.print(_kit_table(provisioned))
    console.print(
        "Each kit holds its own private keys (mode 0600); copy it only over a channel you trust.\n"
        "Let every party compare these out of band (for example by phone):\n"
        f"  CA certificate SHA-256  {provisioned.ca_fingerprint}\n"
        f"  operator verify key     {provisioned.operator_verify_key}",
        soft_wrap=True,
    )


@click.command("sign")
@click.argument("policy_file", metavar="POLICY", type=click.Path(path_type=Path))
@click.option(
    "--key",
    "key_file",
    required=True,
    type=click.Path(path_type=Path),
    help="The operator's signing key (operator/operator.key in the provisioned kits).",
)
def policy_sign(policy_file: Path, key_file: Path) -> None:
    """Validate POLICY and sign its exact bytes with the operator key, into POLICY.sig."""
    try:
        load_policy(signable_policy_file(policy_file))
        operator_key = read_signing_key(key_file)
    except (PolicyError, IdentityError) as exc:
        raise click.ClickException(str(exc)) from None
    try:
        signature = sign_policy(policy_file, operator_key)
    except OSError as exc:
        raise click.ClickException(f"{policy_file}: cannot write its signature: {exc}") from None
    console.print(f"Signed {policy_file}: signature in {signature}")
    digest = policy_digest(policy_file.read_bytes())
    console.print(f"policy digest (BLAKE2b-256)  {digest}", soft_wrap=True)


def _kit_table(provisioned: ProvisionedConsortium) -> Table:
    table = Table("kit", "goes to", box=None)
    table.add_row(
        f"{provisioned.operator}/",
        "stays with the operator, offline (CA key, policy-signing key)",
    )
    table.add_row(f"{provisioned.coordinator}/", "the coordinator host")
    for name, folder in provisioned.silos.items():
        table.add_row(f"{folder}/", f"silo '{name}': that institution's IT team")
    return table
