"""The `fedsilo` command line: validate policies, list algorithms, run simulations, serve and
administer a consortium.

This module stays light: every command is loaded only when it runs (ops/lazy_group.py), and
the index of `fedsilo --help` comes from the summaries below, so `fedsilo --version` and
`fedsilo --help` load neither torch nor grpc nor pydantic (tests/test_cli_imports.py checks it).
Each command's summary here is its docstring's first sentence, which the same test checks.
"""

from __future__ import annotations

import click

import fedsilo.ops.openmp  # noqa: F401 (first, before torch loads: see the module)
from fedsilo import __version__
from fedsilo.ops.lazy_group import LazyGroup
from fedsilo.wire.version import PROTOCOL_VERSION

COMMANDS = "fedsilo.ops.commands"
# name -> ("module:attribute" of its click command, its summary in `fedsilo --help`)
SUBCOMMANDS = {
    "algorithms": (f"{COMMANDS}:algorithms", "List the algorithms a policy may select."),
    "consortium": (
        "fedsilo.ops.consortium_cli:consortium_group",
        "Change a provisioned consortium's roster (enrol or revoke a silo) and renew its "
        "certificates.",
    ),
    "coordinator": (
        f"{COMMANDS}:coordinator",
        "Run and administer the coordinator of a consortium.",
    ),
    "demo": (
        f"{COMMANDS}:demo",
        "Run a real consortium on this machine: coordinator and four hospitals over mTLS.",
    ),
    "examples": (
        "fedsilo.ops.examples_cli:examples_group",
        "List and copy the example policies and monitoring files that ship with fedsilo.",
    ),
    "job": (
        "fedsilo.ops.job_cli:job_group",
        "Submit and follow jobs on a running coordinator, with the operator's kit.",
    ),
    "model": ("fedsilo.ops.model_cli:model_group", "Work with a policy's model."),
    "new": (
        "fedsilo.ops.new_package:new_command",
        "Write a plug-in package NAME: a model factory, a data loader, optionally a task, a "
        "strategy and training steps, their entry points, a policy using them pinned, and tests.",
    ),
    "plugin": (
        "fedsilo.ops.plugin_cli:plugin_group",
        "List this site's plug-ins and print the pin of a strategy or training step.",
    ),
    "policy": (f"{COMMANDS}:policy", "Work with policy files."),
    "predict": (
        "fedsilo.ops.predict:predict_command",
        "Apply a run's final model to a CSV of this site's records.",
    ),
    "privacy": (
        "fedsilo.ops.privacy_cli:privacy_group",
        "Plan a job's budget; audit and plot the silos' privacy ledgers.",
    ),
    "provision": (
        "fedsilo.ops.provision_cli:provision_command",
        "Create the CA, every key and one startup kit per party of a consortium.",
    ),
    "silo": ("fedsilo.ops.silo_cli:silo", "Run a silo agent next to a hospital's data."),
    "simulate": (
        f"{COMMANDS}:simulate_command",
        "Run a consortium (in this process, or on Ray) and write results, tables and plots.",
    ),
    "status": (
        f"{COMMANDS}:status",
        "Show the consortium's running or latest job: its status, round, participants, last "
        "metrics and dropouts; and how long the kit's certificate is valid.",
    ),
}


@click.group(
    cls=LazyGroup,
    lazy_subcommands={name: target for name, (target, _) in SUBCOMMANDS.items()},
    summaries={name: summary for name, (_, summary) in SUBCOMMANDS.items()},
)
@click.version_option(
    __version__, prog_name="fedsilo", message=f"%(prog)s %(version)s (protocol {PROTOCOL_VERSION})"
)
def main() -> None:
    """fedsilo: privacy-hardened cross-silo federated learning."""
