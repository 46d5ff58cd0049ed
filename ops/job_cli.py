"""`fedsilo job ...`: the operator's commands for a running coordinator (`fedsilo coordinator
serve`), over the admin channel (ops/admin_client.py) with the operator's kit: submit a signed
policy as a job, list the jobs, show, abort, read a job's log, fetch its results. The remote
form of `fedsilo status` (`--kit OPERATOR_KIT`) is `print_remote_status`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from fedsilo.coordinator.admin_api import AdminError
from fedsilo.coordinator.jobs import JobInfo
from fedsilo.ops.admin_client import AdminChannelError, AdminConnection
from fedsilo.ops.provision import KitError, load_operator_kit
from fedsilo.ops.report import OutputFolderError, atomic_directory, check_output_folder
from fedsilo.ops.status_view import print_status, status_from_json
from fedsilo.policies.loading import PolicyError, example_file, example_name, load_policy
from fedsilo.privacy.identity import IdentityError, read_signing_key
from fedsilo.privacy.policy_signing import sign_policy, signature_path
from fedsilo.wire.admin import ABORT, CONSORTIUM, LIST, LOGS, RESULTS, STATUS, SUBMIT, AdminReply
from fedsilo.wire.durable import write_atomically

console = Console()

kit_option = click.option(
    "--kit",
    "kit_dir",
    required=True,
    type=click.Path(path_type=Path),
    help="The operator's kit (OUT/operator from `fedsilo provision`).",
)


@click.group("job")
def job_group() -> None:
    """Submit and follow jobs on a running coordinator, with the operator's kit."""


@job_group.command("submit")
@click.argument("policy")
@kit_option
@click.option(
    "--key",
    "key_file",
    type=click.Path(path_type=Path),
    help="The operator key, to sign POLICY first when POLICY.sig does not exist.",
)
def submit(policy: str, kit_dir: Path, key_file: Path | None) -> None:
    """Submit POLICY (a file, or example:NAME) and its operator signature as a new job."""
    text, signature = _signed_policy(policy, key_file)
    info = JobInfo.from_json(_call(kit_dir, SUBMIT, policy=text, signature=signature).data)
    console.print(f"submitted {policy} as job {info.job_id} ({info.status})", soft_wrap=True)


@job_group.command("list")
@kit_option
def list_jobs(kit_dir: Path) -> None:
    """Every job of the coordinator, in submission order."""
    jobs = [JobInfo.from_json(data) for data in _call(kit_dir, LIST).data]
    table = Table(title="jobs")
    table.add_column("job", no_wrap=True)
    table.add_column("status", no_wrap=True)
    for column in ("submitted", "ended", "note"):
        table.add_column(column)
    for info in jobs:
        table.add_row(
            info.job_id,
            info.status,
            _when(info.submitted_at, "%m-%d %H:%M"),
            _when(info.finished_at, "%m-%d %H:%M"),
            _note(info),
        )
    console.print(table if jobs else "no jobs yet")


@job_group.command("status")
@click.argument("job")
@kit_option
def job_status(job: str, kit_dir: Path) -> None:
    """Where job JOB stands."""
    _print_job(JobInfo.from_json(_call(kit_dir, STATUS, job=job).data))


@job_group.command("abort")
@click.argument("job")
@kit_option
def abort(job: str, kit_dir: Path) -> None:
    """Abort job JOB: a queued job at once, a running one at its next check."""
    info = JobInfo.from_json(_call(kit_dir, ABORT, job=job).data)
    said = "aborted" if info.status == "aborted" else f"abort requested ({info.status})"
    console.print(f"job {info.job_id}: {said}", soft_wrap=True)


@job_group.command("logs")
@click.argument("job")
@kit_option
@click.option("--tail", type=click.IntRange(min=1), help="Only the last N lines.")
def logs(job: str, kit_dir: Path, tail: int | None) -> None:
    """The coordinator's log of job JOB."""
    text = str(_call(kit_dir, LOGS, job=job, tail=tail).data["text"])
    click.echo(text, nl=not text.endswith("\n"))


@job_group.command("results")
@click.argument("job")
@kit_option
@click.option("--out", required=True, type=click.Path(path_type=Path), help="New or empty folder.")
@click.option("--overwrite", is_flag=True, help="Replace an --out folder of earlier results.")
def results(job: str, kit_dir: Path, out: Path, overwrite: bool) -> None:
    """Fetch the results folder of ended job JOB into --out (written whole or not at all)."""
    try:
        check_output_folder(out, overwrite)
        files = _call(kit_dir, RESULTS, job=job).files
        with atomic_directory(out, overwrite) as staging:
            for name, content in files.items():
                target = staging / name
                target.parent.mkdir(parents=True, exist_ok=True)
                write_atomically(target, [content])
    except (OutputFolderError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    console.print(f"results of job {job} in {out}/", soft_wrap=True)
    table = Table("file", "bytes")
    for name, content in sorted(files.items()):
        table.add_row(name, str(len(content)))
    console.print(table)


def print_remote_status(kit_dir: Path) -> None:
    """`fedsilo status --kit OPERATOR_KIT`: the consortium as the running coordinator sees it,
    then its running or latest job as the local `fedsilo status` shows one."""
    data = _call(kit_dir, CONSORTIUM).data
    silos = data["silos"]
    connected = [name for name, silo in sorted(silos.items()) if silo["connected"]]
    console.print(
        f"consortium {data['consortium']}: running {data['running'] or 'no job'}, "
        f"{len(data['queued'])} queued; connected silos: {', '.join(connected) or 'none'}",
        soft_wrap=True,
    )
    if data["job"] is None:
        console.print("no job has run yet")
        return
    print_status(console, status_from_json(data["job"]), silos)


def _call(kit_dir: Path, command: str, **args: Any) -> AdminReply:
    try:
        kit = load_operator_kit(kit_dir)
        with AdminConnection(kit) as connection:
            return connection.call(command, **args)
    except (KitError, AdminError, AdminChannelError, OSError) as exc:
        raise click.ClickException(str(exc)) from None


def _signed_policy(policy: str, key_file: Path | None) -> tuple[str, str]:
    """POLICY's exact text and its operator signature (signing it first with --key when it has
    none yet); its fields are checked here, before anything is sent."""
    name = example_name(policy)
    try:
        load_policy(policy)
        if name is not None:
            if key_file is None:
                raise click.ClickException(
                    f"{policy}: a packaged example carries no signature; pass --key to sign it"
                )
            data = example_file(name).read_bytes()
            return data.decode("utf-8"), read_signing_key(key_file).sign(data).signature.hex()
        path = Path(policy)
        signature = signature_path(path)
        if not signature.exists():
            if key_file is None:
                raise click.ClickException(
                    f"{signature}: not found; sign the policy first (`fedsilo policy sign "
                    f"{path} --key OPERATOR_KEY`) or pass --key"
                )
            sign_policy(path, read_signing_key(key_file))
        return path.read_bytes().decode("utf-8"), signature.read_text(encoding="ascii")
    except (PolicyError, IdentityError, OSError, UnicodeDecodeError) as exc:
        raise click.ClickException(str(exc)) from None


def _print_job(info: JobInfo) -> None:
    table = Table(box=None, show_header=False, title=f"job {info.job_id}")
    for label, value in (
        ("policy", info.name),
        ("status", info.status),
        ("submitted", f"{_when(info.submitted_at)} by {info.submitted_by}"),
        ("started", _when(info.started_at)),
        ("finished", _when(info.finished_at)),
        ("policy digest", info.policy_digest),
        ("note", _note(info)),
    ):
        table.add_row(label, value)
    console.print(table)


def _note(info: JobInfo) -> str:
    if info.error:
        return info.error
    return "abort requested" if info.abort_requested and info.status == "running" else ""


def _when(timestamp: float | None, form: str = "%Y-%m-%d %H:%M:%S") -> str:
    return "-" if timestamp is None else time.strftime(form, time.localtime(timestamp))
