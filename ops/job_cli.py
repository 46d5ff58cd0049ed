"""`fedsilo job ...`: the operator's commands for a running coordinator (`fedsilo coordinator
serve`), over the admin channel (ops/admin_client.py) with the operator's kit: submit a signed
policy as a job (or run an ended one again as a new attempt, `--retry`; `--wait` follows it to
its end), list the jobs, show, abort, read a job's log (`--follow`: as it is written), fetch its
results. JOB is a job's id, an unambiguous start of it, or its form shortened by `job list`
(`resolve_job`). The remote form of `fedsilo status` (`--kit OPERATOR_KIT`) is
`print_remote_status`. `--json` prints what `list`, `status` and `fedsilo status` show as one
JSON document of a versioned shape (`STATUS_SCHEMA`; docs/how-to/operator.md, "Scripting the
admin CLI").
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from nacl.signing import SigningKey
from rich.console import Console
from rich.table import Table
from rich.text import Text

from fedsilo.coordinator.admin_api import OPERATOR, AdminError
from fedsilo.coordinator.jobs import ENDED, JobInfo
from fedsilo.ops.admin_client import AdminChannelError, AdminConnection
from fedsilo.ops.cli_support import host_and_port
from fedsilo.ops.epsilon import fmt_epsilon
from fedsilo.ops.job_id import DIGEST_CHARS
from fedsilo.ops.options import kit_option as operator_kit_option
from fedsilo.ops.provision import KitError, OperatorKit, load_operator_kit
from fedsilo.ops.report import OutputFolderError, atomic_directory, check_output_folder
from fedsilo.ops.status import STATUS_SCHEMA, certificate_status
from fedsilo.ops.status_view import print_certificate, print_consortium
from fedsilo.policies.loading import PolicyError, example_file, example_name, load_policy
from fedsilo.privacy.identity import IdentityError, read_signing_key
from fedsilo.privacy.policy_signing import (
    PolicySignatureError,
    sign_attempt,
    sign_policy,
    signature_path,
    verify_policy,
)
from fedsilo.wire.admin import (
    ABORT,
    CONSORTIUM,
    LIST,
    LOG_LINES,
    LOGS,
    RESULTS,
    RETRY,
    STATUS,
    SUBMIT,
    VALIDATE,
    AdminReply,
)
from fedsilo.wire.durable import write_atomically

FINAL_MODEL = "final_model.safetensors"

console = Console()

COORDINATOR_ADDRESS = "fedsilo.coordinator_address"  # click context's meta key


def _remember_address(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    ctx.meta[COORDINATOR_ADDRESS] = host_and_port(ctx, param, value)


coordinator_option = click.option(
    "--coordinator",
    metavar="HOST:PORT",
    envvar="FEDSILO_COORDINATOR_ADDRESS",
    expose_value=False,
    callback=_remember_address,
    help="Reach the coordinator here instead of at the kit's address (a published container "
    "port, `kubectl port-forward`, a tunnel); its certificate is still checked for the kit's "
    "host. Default: $FEDSILO_COORDINATOR_ADDRESS.",
)


def kit_option(command: Callable) -> Callable:
    """--kit, the operator's kit, and --coordinator, where to reach its coordinator."""
    return operator_kit_option("The operator's kit (OUT/operator from `fedsilo provision`).")(
        coordinator_option(command)
    )


def connect(kit: OperatorKit) -> AdminConnection:
    """The admin channel to the kit's coordinator, at --coordinator when it was given."""
    context = click.get_current_context(silent=True)
    address = None if context is None else context.meta.get(COORDINATOR_ADDRESS)
    return AdminConnection(kit, address=address)


json_option = click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print one JSON document (docs/how-to/operator.md, 'Scripting the admin CLI') "
    "instead of tables.",
)


@click.group("job")
def job_group() -> None:
    """Submit and follow jobs on a running coordinator, with the operator's kit."""


@job_group.command("submit")
@click.argument("policy", required=False)
@kit_option
@click.option(
    "--key",
    "key_file",
    type=click.Path(path_type=Path),
    help="The operator key, to sign POLICY first when POLICY.sig does not exist, or no longer "
    "matches the policy's bytes.",
)
@click.option(
    "--retry",
    "retry_job",
    metavar="JOB",
    help="Run ended job JOB's signed policy again as a new attempt (JOB failed, was refused or "
    "was aborted); the attempt is signed with the operator kit's key.",
)
@click.option(
    "--wait",
    is_flag=True,
    help="Wait until the job ends, printing its status as it changes (round R of N); exit "
    "status 0 when it completed, 1 when it failed, was refused or aborted (with the reason).",
)
def submit(
    policy: str | None, kit_dir: Path, key_file: Path | None, retry_job: str | None, wait: bool
) -> None:
    """Submit POLICY (a file, or example:NAME) and its operator signature as a new job, or
    run an ended job again (--retry JOB)."""
    if retry_job is not None:
        if policy is not None or key_file is not None:
            raise click.ClickException(
                "--retry: it runs JOB's own signed policy again; give no POLICY and no --key"
            )
        info = _retry(kit_dir, resolve_job(kit_dir, retry_job))
    else:
        if policy is None:
            raise click.ClickException("POLICY: give the policy to submit, or --retry JOB")
        text, signature = _signed_policy(policy, key_file, _kit(kit_dir))
        info = JobInfo.from_json(_call(kit_dir, SUBMIT, policy=text, signature=signature).data)
        console.print(f"submitted {policy} as job {info.job_id} ({info.status})", soft_wrap=True)
    if wait:
        wait_for_job(kit_dir, info.job_id)


@job_group.command("list")
@kit_option
@json_option
def list_jobs(kit_dir: Path, as_json: bool) -> None:
    """Every job of the coordinator, in submission order."""
    jobs = [JobInfo.from_json(data) for data in _call(kit_dir, LIST).data]
    if as_json:
        print_json({"schema": STATUS_SCHEMA, "jobs": [info.to_json() for info in jobs]})
        return
    table = jobs_table(jobs, console.width)
    console.print(table if jobs else "no jobs yet")


@job_group.command("status")
@click.argument("job")
@kit_option
@json_option
def job_status(job: str, kit_dir: Path, as_json: bool) -> None:
    """Where job JOB stands, and whom it waits for while it runs."""
    data = _call(kit_dir, STATUS, job=resolve_job(kit_dir, job)).data
    info, awaiting = JobInfo.from_json(data), list(data.get("awaiting", []))
    if as_json:
        job_document = {**info.to_json(), "awaiting": awaiting, "progress": data.get("progress")}
        print_json({"schema": STATUS_SCHEMA, "job": job_document})
        return
    _print_job(info, awaiting, data.get("progress"))


@job_group.command("abort")
@click.argument("job")
@kit_option
def abort(job: str, kit_dir: Path) -> None:
    """Abort job JOB: a queued job at once, a running one at its next check."""
    info = JobInfo.from_json(_call(kit_dir, ABORT, job=resolve_job(kit_dir, job)).data)
    said = "aborted" if info.status == "aborted" else f"abort requested ({info.status})"
    console.print(f"job {info.job_id}: {said}", soft_wrap=True)


@job_group.command("logs")
@click.argument("job")
@kit_option
@click.option("--tail", type=click.IntRange(min=1), help="Only the last N lines.")
@click.option(
    "--follow",
    "-f",
    is_flag=True,
    help="Print the log's lines as the coordinator writes them, until the job ends.",
)
def logs(job: str, kit_dir: Path, tail: int | None, follow: bool) -> None:
    """The coordinator's log of job JOB."""
    job = resolve_job(kit_dir, job)
    if follow:
        if tail is not None:
            raise click.ClickException("--tail: not with --follow, which prints the whole log")
        follow_log(kit_dir, job)
        return
    text = str(_call(kit_dir, LOGS, job=job, tail=tail).data["text"])
    click.echo(text, nl=not text.endswith("\n"))


@job_group.command("results")
@click.argument("job")
@kit_option
@click.option("--out", required=True, type=click.Path(path_type=Path), help="New or empty folder.")
@click.option("--overwrite", is_flag=True, help="Replace an --out folder of earlier results.")
def results(job: str, kit_dir: Path, out: Path, overwrite: bool) -> None:
    """Fetch the results folder of ended job JOB into --out (written whole or not at all). A
    job that failed or was aborted after some rounds completed has the results of its last
    completed round, marked partial (results.json's `ended`), and it says what each silo spent."""
    try:
        check_output_folder(out, overwrite)
        job = resolve_job(kit_dir, job)
        files = _call(kit_dir, RESULTS, job=job).files
        with atomic_directory(out, overwrite) as staging:
            for name, content in files.items():
                target = staging / name
                target.parent.mkdir(parents=True, exist_ok=True)
                write_atomically(target, [content])
    except (OutputFolderError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    console.print(f"results of job {job} in {out}/", soft_wrap=True)
    _print_partial(job, files.get("results.json"))
    table = Table("file", "bytes")
    for name, content in sorted(files.items()):
        table.add_row(name, str(len(content)))
    console.print(table)
    _print_init_block(out / FINAL_MODEL)


def _print_init_block(model_file: Path) -> None:
    """The `init:` block that starts a next job from this job's final model, where it has one
    (FedEvg's result is its synthetic set)."""
    from fedsilo.models.warm_start import WarmStartError, init_block, read_warm_start  # torch

    try:
        warm = read_warm_start(model_file)
    except WarmStartError:
        return
    click.echo(f"to start a job from this model:\n{init_block(model_file.resolve(), warm.digest)}")


@job_group.command("validate")
@click.argument("job")
@kit_option
@json_option
def validate(job: str, kit_dir: Path, as_json: bool) -> None:
    """The cross-site validation matrix of job JOB: every model the coordinator held in the
    clear (the global model, each site's where its policy lets one reach the coordinator) on
    every site's test split, run once after the job's final evaluation when its policy asks
    for it (evaluation.cross_site)."""
    from fedsilo.ops.cross_site_view import print_job_cross_site  # loads torch

    data = _call(kit_dir, VALIDATE, job=resolve_job(kit_dir, job)).data
    if as_json:
        print_json({"schema": STATUS_SCHEMA, **data})
        return
    print_job_cross_site(console, data)


def _print_partial(job: str, results_json: bytes | None) -> None:
    """Say so when `results_json` is a job's that did not complete (its `ended`): whose round
    its model is, why the job ended, and each silo's epsilon spent on it."""
    try:
        document = json.loads(results_json or b"{}")
    except ValueError:
        return
    ended = document.get("ended") if isinstance(document, dict) else None
    if not isinstance(ended, dict) or not ended.get("partial"):
        return
    console.print(
        f"partial results: job {job} ended {ended.get('status')} ({ended.get('reason')}); these "
        f"are the results of its last completed round {ended.get('model_round')} of "
        f"{ended.get('rounds')}",
        soft_wrap=True,
        highlight=False,
    )
    spent = (document.get("privacy") or {}).get("epsilon") or {}
    for silo, epsilon in sorted(spent.items()):
        shown = fmt_epsilon(math.inf if epsilon is None else float(epsilon))
        console.print(f"  {silo} spent epsilon {shown} on this job", soft_wrap=True)


def print_remote_status(kit_dir: Path, as_json: bool = False) -> None:
    """`fedsilo status --kit OPERATOR_KIT`: the consortium as the running coordinator sees it,
    then its running or latest job as the local `fedsilo status` shows one."""
    document = _call(kit_dir, CONSORTIUM).data
    if as_json:
        print_json(
            {**document, "certificate": certificate_status(OPERATOR, kit_dir / "client.crt")}
        )
        return
    print_consortium(console, document)
    print_certificate(console, OPERATOR, kit_dir / "client.crt")


def _retry(kit_dir: Path, job: str) -> JobInfo:
    """Sign the next attempt at `job`'s policy with the operator kit's key and submit it."""
    ended = JobInfo.from_json(_call(kit_dir, STATUS, job=job).data)
    attempt = ended.attempt + 1
    signature = sign_attempt(_kit(kit_dir).signing_key, ended.policy_digest, attempt)
    info = JobInfo.from_json(
        _call(kit_dir, RETRY, job=job, attempt=attempt, signature=signature).data
    )
    console.print(
        f"submitted attempt {info.attempt} at the policy of job {job} as job {info.job_id} "
        f"({info.status})",
        soft_wrap=True,
    )
    return info


POLL_S = 1.0  # how often `submit --wait` and `logs --follow` ask the coordinator again
WHOLE_ID = re.compile(rf".+-[0-9a-f]{{{DIGEST_CHARS},}}(?:-attempt\d+)?")  # ops/job_id.py


def resolve_job(kit_dir: Path, job: str) -> str:
    """The full id of the job JOB names: its id, an unambiguous start of it, or its shortened
    form as `job list` prints it ("name…-digest", `short_id`); a ClickException naming the
    candidates when it names several. A JOB shaped as a whole id (ending in its digest, or
    attempt) is taken as it is, without asking for the list; one that names no job is sent as
    given (the coordinator says it knows no such job)."""
    if "…" not in job and WHOLE_ID.fullmatch(job):
        return job
    ids = [str(data["job_id"]) for data in _call(kit_dir, LIST).data]
    return match_job(job, ids)


def match_job(job: str, ids: list[str]) -> str:
    """`resolve_job` over the ids `ids`."""
    if job in ids:
        return job
    if "…" in job:
        head, _, tail = job.partition("…")
        candidates = [i for i in ids if i.startswith(head) and i.endswith(tail)]
        candidates = [i for i in candidates if len(i) >= len(head) + len(tail)]
    else:
        candidates = [i for i in ids if i.startswith(job)]
    if len(candidates) > 1:
        raise click.ClickException(
            f"JOB {job!r} is ambiguous: it names {len(candidates)} jobs, "
            f"{', '.join(candidates)}; give more of the id"
        )
    return candidates[0] if candidates else job


def wait_for_job(kit_dir: Path, job: str, poll_s: float = POLL_S) -> None:
    """Print job `job`'s status and round each time they change until it ends; return when it
    completed, else a ClickException (exit status 1) saying how it ended and why."""
    shown = None
    while True:
        data = _call(kit_dir, STATUS, job=job).data
        info = JobInfo.from_json(data)
        line = f"job {info.job_id}: {info.status}"
        rounds = _rounds(data.get("progress"))
        if rounds is not None and info.status != "queued":
            line += f", {rounds}"
        if line != shown:
            console.print(line, soft_wrap=True, highlight=False)
            shown = line
        if info.status in ENDED:
            break
        time.sleep(poll_s)
    if info.status == "completed":
        return
    for silo, reason in info.refusals.items():
        console.print(f"  refused by {silo}: {reason}", soft_wrap=True, highlight=False)
    why = f": {info.error}" if info.error else ""
    raise click.ClickException(f"job {info.job_id} {info.status}{why}")


def follow_log(kit_dir: Path, job: str, poll_s: float = POLL_S) -> None:
    """Print job `job`'s log from its start, each line as the coordinator writes it, until the
    job has ended and its log is read to the end."""
    offset = 0
    while True:
        data = _call(kit_dir, LOG_LINES, job=job, offset=offset).data
        if data["text"]:
            click.echo(data["text"], nl=False)
        offset = int(data["offset"])
        if data["ended"]:
            return
        if not data["text"]:
            time.sleep(poll_s)


def _rounds(progress: dict[str, Any] | None) -> str | None:
    """The "round R of N" of a STATUS reply's `progress`; None before a round was saved."""
    if not progress or not progress.get("round"):
        return None
    planned = f" of {progress['rounds']}" if progress.get("rounds") else ""
    return f"round {progress['round']}{planned}"


def print_json(document: Any) -> None:
    """A `--json` document, standard JSON (no NaN or infinity)."""
    click.echo(json.dumps(document, indent=2, allow_nan=False))


def _kit(kit_dir: Path) -> OperatorKit:
    try:
        return load_operator_kit(kit_dir)
    except (KitError, OSError) as exc:
        raise click.ClickException(str(exc)) from None


def _call(kit_dir: Path, command: str, **args: Any) -> AdminReply:
    try:
        kit = load_operator_kit(kit_dir)
        with connect(kit) as connection:
            return connection.call(command, **args)
    except (KitError, AdminError, AdminChannelError, OSError) as exc:
        raise click.ClickException(str(exc)) from None


def _signed_policy(policy: str, key_file: Path | None, kit: OperatorKit) -> tuple[str, str]:
    """POLICY's exact text and its operator signature; with --key, signed first when it has no
    signature, or one older than its bytes (said so). Its fields and signature are checked
    here, before anything is sent."""
    name = example_name(policy)
    try:
        load_policy(policy)
        key = None if key_file is None else _operator_key(key_file, kit)
        if name is not None:
            if key is None:
                raise click.ClickException(
                    f"{policy}: a packaged example carries no signature; pass --key to sign it"
                )
            data = example_file(name).read_bytes()
            return data.decode("utf-8"), key.sign(data).signature.hex()
        path = Path(policy)
        signature = signature_path(path)
        if not signature.exists():
            if key is None:
                raise click.ClickException(
                    f"{signature}: not found; sign the policy first (`fedsilo policy sign "
                    f"{path} --key OPERATOR_KEY`) or pass --key"
                )
            sign_policy(path, key)
        elif not _verifies(path, signature, kit):
            if key is None:
                raise click.ClickException(
                    f"{signature}: the signature is older than the policy (it does not verify "
                    f"for {path} as it is now); sign it again (`fedsilo policy sign {path} --key "
                    "OPERATOR_KEY`) or pass --key"
                )
            sign_policy(path, key)
            console.print(
                f"re-signed {path}: {signature} was older than the policy", soft_wrap=True
            )
        return path.read_bytes().decode("utf-8"), signature.read_text(encoding="ascii")
    except (PolicyError, IdentityError, OSError, UnicodeDecodeError) as exc:
        raise click.ClickException(str(exc)) from None


def _operator_key(key_file: Path, kit: OperatorKit) -> SigningKey:
    """The key in --key, refused unless it is the kit's operator key (the coordinator would
    refuse what another key signed)."""
    key = read_signing_key(key_file)
    if key.verify_key != kit.signing_key.verify_key:
        raise click.ClickException(
            f"--key {key_file}: not the operator key of the kit {kit.folder}"
        )
    return key


def _verifies(path: Path, signature: Path, kit: OperatorKit) -> bool:
    try:
        verify_policy(
            path.read_bytes(), signature.read_text(encoding="ascii"), kit.signing_key.verify_key
        )
    except (PolicySignatureError, UnicodeDecodeError):
        return False
    return True


KEY_COLUMNS = ("job", "status", "submitted", "ended")
NOTE_MIN_WIDTH = 12  # the least a note keeps beside ids that are shortened for it
ID_MIN_WIDTH = 24  # the least a shortened id keeps: a start of its name, its digest, attempt


def jobs_table(jobs: list[JobInfo], width: int) -> Table:
    """`job list`'s table, one line a job within `width` columns: its id, status, submitted and
    ended whole (an id too long for the width shortened in its name, keeping its digest and
    attempt), then its note cut with an ellipsis into what is left (`job status JOB` or --json
    shows all of it; no note column when nothing is left)."""
    rows = [
        [
            info.job_id,
            info.status,
            _when(info.submitted_at, "%m-%d %H:%M"),
            _when(info.finished_at, "%m-%d %H:%M"),
        ]
        for info in jobs
    ]
    widths = [
        max([len(column), *(len(row[i]) for row in rows)]) for i, column in enumerate(KEY_COLUMNS)
    ]
    notes = [info.note for info in jobs]
    # each column has one space either side and a rule after it, and the table one before all
    left = width - 1 - sum(w + 3 for w in widths[1:]) - 3
    note_width = max((len(note) for note in notes), default=0)
    room = left - (3 + min(note_width, NOTE_MIN_WIDTH) if note_width else 0)
    id_width = min(widths[0], max(room, ID_MIN_WIDTH))
    for row in rows:
        row[0] = short_id(row[0], id_width)
    table = Table(title="jobs")
    for column, widest in zip(KEY_COLUMNS, [id_width, *widths[1:]], strict=True):
        table.add_column(column, no_wrap=True, min_width=widest, max_width=widest)
    note_room = left - id_width - 3
    if note_width and note_room >= len("note"):
        table.add_column("note", no_wrap=True, overflow="ellipsis", max_width=note_room)
        for row, note in zip(rows, notes, strict=True):
            table.add_row(*row, Text(note, no_wrap=True, overflow="ellipsis"))
    else:
        for row in rows:
            table.add_row(*row)
    return table


def short_id(job_id: str, width: int) -> str:
    """`job_id` in `width` characters: whole when it fits, else its policy's name cut with "…"
    before the digest (and attempt) that tell jobs apart (ops/job_id.py)."""
    if len(job_id) <= width:
        return job_id
    match = re.fullmatch(rf"(.*)(-[0-9a-f]{{{DIGEST_CHARS}}}(?:-attempt\d+)?)", job_id)
    name, tail = (match.group(1), match.group(2)) if match else (job_id, "")
    keep = width - len(tail) - 1
    if keep < 1:
        return job_id[: width - 1] + "…"
    return f"{name[:keep]}…{tail}"


def _print_job(
    info: JobInfo, awaiting: list[dict[str, Any]], progress: dict[str, Any] | None = None
) -> None:
    """`job status`'s detail view; `progress` (the STATUS reply's, absent from a coordinator
    older than it, None before a round was saved) says "round R of N"."""
    table = Table(box=None, show_header=False, title=f"job {info.job_id}")
    table.add_column(no_wrap=True)
    table.add_column(overflow="fold")
    rounds = _rounds(progress)
    for label, value in (
        ("policy", info.name),
        ("attempt", str(info.attempt)),
        ("status", info.status),
        *((("progress", rounds),) if rounds else ()),
        *((("metrics", metrics),) if (metrics := _metrics(progress)) else ()),
        ("submitted", f"{_when(info.submitted_at)} by {info.submitted_by}"),
        ("started", _when(info.started_at)),
        ("finished", _when(info.finished_at)),
        ("policy digest", info.policy_digest),
        ("note", info.note),
        *((f"refused by {silo}", reason) for silo, reason in info.refusals.items()),
        *((f"awaiting {wait['silo']}", _awaited(wait)) for wait in awaiting),
    ):
        table.add_row(label, value)
    console.print(table)


def _metrics(progress: dict[str, Any] | None) -> str | None:
    """`round 30: accuracy 0.9474, loss 0.1765`: the cross-silo means of the last evaluated
    round in a STATUS reply's `progress`; None before a round evaluated."""
    metrics = (progress or {}).get("metrics")
    if not metrics or not metrics.get("values"):
        return None
    values = ", ".join(f"{name} {value:.4g}" for name, value in metrics["values"].items())
    return f"round {metrics['round']}: {values}"


def _awaited(wait: dict[str, Any]) -> str:
    """`its join since 12:00:01, until 12:10:01` (the coordinator's `Awaited`)."""
    what = "its join" if wait["task_id"] is None else f"task {wait['task_id']}"
    until = "" if wait["until"] is None else f", until {_when(wait['until'], '%H:%M:%S')}"
    return f"{what} since {_when(wait['since'], '%H:%M:%S')}{until}"


def _when(timestamp: float | None, form: str = "%Y-%m-%d %H:%M:%S") -> str:
    return "-" if timestamp is None else time.strftime(form, time.localtime(timestamp))
