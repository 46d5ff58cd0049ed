"""`fedsilo privacy plan`: what a job will book at each silo before anything is spent
(silo/budget_plan.py), for the policy's own simulated consortium, a silo of N training rows, or
this site (its silo.yaml: its own data, roster, caps and ledger) with its verdict. The helpers
here give `policy validate`, `simulate` and `silo check` the same numbers.

Registered on the `privacy` group by ops/privacy_cli.py. The silo side (data, Opacus) is
imported when a command runs, never when the command line loads (tests/test_cli_imports.py).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich import box
from rich.console import Console
from rich.table import Table

from fedsilo.ops.cli_support import DEPLOYMENT_ERRORS, within

if TYPE_CHECKING:
    from fedsilo.policies.schema import Policy
    from fedsilo.silo.budget_plan import BudgetPlan, Caps
    from fedsilo.silo.data import SiloDataset

console = Console()

NO_DP = "asks for no DP (no privacy.dp_sgd, no distributed privacy.client_dp): nothing is accounted"
WHAT_IT_IS = (
    "epsilon: the most this job can book at a silo, what it books there when the silo takes "
    "part in every round (less with client sampling). Each purpose is its releases composed "
    "alone: together they compose to less than their sum."
)


@dataclass(frozen=True)
class SitePlan:
    """This site's plan for a job, its caps and its verdict (`refusal` None: it accepts)."""

    plan: BudgetPlan
    caps: Caps
    roster: str  # where the consortium the plan counts comes from
    refusal: str | None


def consortium_plans(policy: Policy, datasets: Sequence[SiloDataset]) -> list[BudgetPlan]:
    """Each silo's plan, its agent built as `simulate` builds it (fresh keys for the whole
    consortium)."""
    import torch

    from fedsilo.ops.sim_silos import ConsortiumKeys, build_agent

    keys = ConsortiumKeys.generate(d.name for d in datasets)
    cpu = torch.device("cpu")
    return [build_agent(policy, d.name, d, cpu, keys).budget_plan() for d in datasets]


def planned_line(plans: Sequence[BudgetPlan]) -> str | None:
    """ "planned epsilon per silo: silo-0 8.563, ... (delta 1e-05)", or None without DP."""
    from fedsilo.silo.budget_plan import fmt

    if not plans or plans[0].delta is None:
        return None
    silos = ", ".join(f"{plan.silo} {fmt(plan.epsilon)}" for plan in plans)
    return f"planned epsilon per silo: {silos} (delta {plans[0].delta:g})"


def validate_line(policy: Policy, base_dir: Path | None) -> str | None:
    """What `policy validate` adds for a DP policy: the planned line of the consortium its
    data makes here; None without DP, where the data is not here, or where its plug-in model
    is not installed here (`policy validate` says so elsewhere)."""
    if not policy.privacy.differentially_private:
        return None
    from fedsilo.models.plugins import PluginError
    from fedsilo.ops.simulate import load_silos
    from fedsilo.policies.model import PluginModel
    from fedsilo.silo.errors import DataNotHere

    try:
        return planned_line(consortium_plans(policy, load_silos(policy, base_dir)))
    except DataNotHere:
        return None
    except PluginError:
        if isinstance(policy.model, PluginModel):
            return None
        raise


def over_policy_cap(policy: Policy, plans: Sequence[BudgetPlan]) -> str | None:
    """Why a silo would refuse the job under the policy's own privacy.epsilon_cap (the first
    silo whose plan is above it, with the numbers), or None."""
    from fedsilo.silo.budget_plan import Caps, refusal

    caps = Caps(job=policy.privacy.epsilon_cap, job_key="privacy.epsilon_cap")
    for plan in plans:
        problem = refusal(plan, caps)
        if problem is not None:
            return f"silo {plan.silo} would refuse this job: {problem}"
    return None


def rows_plan(policy: Policy, datasets: Sequence[SiloDataset], rows: int) -> BudgetPlan:
    """The plan of a silo with `rows` training rows in the policy's consortium: the first
    silo's data (its schema, validation and test splits) with its training split cut to `rows`
    rows, or its rows repeated up to `rows`. Only the count matters to the plan (DP-SGD's
    sample rate is batch / rows)."""
    import torch

    first = datasets[0]
    resized = first.with_train_rows(torch.arange(rows) % len(first.y_train))
    return consortium_plans(policy, [resized, *datasets[1:]])[0]


def site_plan(config_file: Path, policy: Policy, job: str) -> SitePlan:
    """This site's plan for `policy` (its own rows, under the policy's seed), its caps (the
    tighter of rules.epsilon_cap and privacy.epsilon_cap per job; rules.total_epsilon_cap over
    all jobs, less what its ledger booked for other jobs than `job`) and its verdict. The
    consortium is the one the site knows: the newest signed roster it kept, else its kit's
    peers, else (no kit here) `participants.min_silos` silos."""
    import torch

    from fedsilo.ops.provision import KitError, load_silo_kit
    from fedsilo.ops.silo_process import roster_gate, silo_keys
    from fedsilo.ops.sim_silos import ConsortiumKeys
    from fedsilo.silo.agent import SiloAgent
    from fedsilo.silo.budget_plan import Caps, refusal
    from fedsilo.silo.config import load_silo_config

    config = load_silo_config(config_file)
    data = config.load_data(config_file, policy.seed)
    try:
        kit = load_silo_kit(config.kit_path(config_file))
    except KitError as exc:
        kit, why = None, str(exc)
    if kit is not None:
        newest = roster_gate(kit, config.state_path(config_file)).newest
        keys = silo_keys(kit, newest)
        roster = (
            f"signed roster version {newest.version}" if newest else f"kit {kit.name}'s peers"
        ) + f", {len(keys.roster)} silos"
    else:
        members = max(policy.participants.min_silos, 1)
        names = [data.name, *(f"member-{i}" for i in range(1, members))]
        keys = ConsortiumKeys.generate(names).of(data.name)
        roster = f"{members} silos (participants.min_silos; no kit: {why})"
    agent = SiloAgent(
        data.name,
        data,
        policy,
        device=torch.device("cpu"),
        epsilon_cap=config.rules.epsilon_cap,
        keys=keys,
    )
    plan = agent.budget_plan()
    caps = Caps(
        job=agent.epsilon_cap,
        job_key=agent.cap_key,
        total=config.rules.total_epsilon_cap,
        spent_elsewhere=_spent_elsewhere(config.ledger_path(config_file), job),
    )
    return SitePlan(plan, caps, roster, refusal(plan, caps))


def site_plan_lines(site: SitePlan) -> list[str]:
    """The site's plan, caps and verdict in a few lines (what `silo check` prints)."""
    from fedsilo.silo.budget_plan import describe, fmt

    plan, caps = site.plan, site.caps
    if plan.epsilon is None:
        return ["privacy: the policy " + NO_DP + "; this site accepts it on privacy grounds"]
    job_cap = f"{caps.job_key} {caps.job:g}" if caps.job is not None else "no per-job cap"
    total = (
        f"rules.total_epsilon_cap {caps.total:g}"
        if caps.total is not None
        else "no cap over all jobs"
    )
    verdict = (
        "this site accepts the job on privacy grounds"
        if site.refusal is None
        else f"this site refuses: {site.refusal}"
    )
    return [
        f"privacy: this job plans epsilon {fmt(plan.epsilon)} here ({describe(plan)}; "
        f"consortium: {site.roster})",
        f"caps: {job_cap}, {total}; spent by other jobs in the ledger: {fmt(caps.spent_elsewhere)}",
        verdict,
    ]


def _spent_elsewhere(ledger: Path, job: str) -> float:
    """What the site's ledger booked for jobs other than `job` (0 without a ledger yet); a
    ledger that fails its audit is an error."""
    from fedsilo.privacy import accounting
    from fedsilo.privacy.ledger import LedgerError, verify

    if not ledger.exists():
        return 0.0
    report = verify(ledger)
    if not report.ok:
        raise LedgerError(f"the site's ledger: {report.reason}")
    return accounting.total(d.booked for d in report.deployments if d.deployment != job)


def job_of(policy_file: str, policy: Policy) -> str:
    """The job id this policy runs under at its first attempt (the digest of its bytes)."""
    from fedsilo.ops.job_id import job_id
    from fedsilo.policies.loading import example_file, example_name
    from fedsilo.privacy.policy_signing import policy_digest

    name = example_name(policy_file)
    raw = example_file(name).read_bytes() if name is not None else Path(policy_file).read_bytes()
    return job_id(policy.name, policy_digest(raw))


def _plans_table(policy: Policy, plans: Sequence[BudgetPlan]) -> Table:
    from fedsilo.silo.budget_plan import fmt

    purposes: list[str] = []
    for plan in plans:
        purposes += [p for p in plan.by_purpose() if p not in purposes]
    first = plans[0]
    table = Table(
        title=f"{policy.name}: {policy.rounds} rounds, delta {first.delta:g} ({first.accountant})",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    table.add_column("silo")
    table.add_column("rows", justify="right")
    table.add_column("epsilon", justify="right")
    for purpose in purposes:
        table.add_column(purpose, justify="right")
    for plan in plans:
        split = plan.by_purpose()
        table.add_row(
            plan.silo,
            str(plan.train_rows),
            fmt(plan.epsilon),
            *(fmt(split[p]) if p in split else "-" for p in purposes),
        )
    return table


def _document(policy: Policy, plans: Sequence[BudgetPlan]) -> dict[str, Any]:
    return {
        "policy": policy.name,
        "rounds": policy.rounds,
        "differentially_private": plans[0].delta is not None,
        "silos": [plan.to_json() for plan in plans],
    }


@click.command("plan")
@click.argument("policy_file", metavar="POLICY")
@click.option(
    "--config",
    "config_file",
    type=click.Path(path_type=Path),
    help="This site's silo.yaml: plan with its own data and roster, against its caps and "
    "ledger, and say whether it accepts the job.",
)
@click.option(
    "--rows",
    type=int,
    callback=within(1, 10**9),
    help="Plan for a silo with this many training rows (the policy's data for the schema).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the plan as one JSON document.")
def plan_command(
    policy_file: str, config_file: Path | None, rows: int | None, as_json: bool
) -> None:
    """What a job (POLICY, a file or example:NAME) will book at each silo, before it runs.

    Walks each silo's contract round by round and asks every task what it would release, as
    the silo's ledger will book it: the epsilon per silo, split by purpose (training,
    evaluation, probes, point clouds). With --config, this site's plan, caps and verdict."""
    from fedsilo.ops.simulate import load_silos
    from fedsilo.policies.loading import load_policy, policy_folder
    from fedsilo.privacy.ledger import LedgerError
    from fedsilo.privacy.roster import RosterError
    from fedsilo.silo.budget_plan import json_epsilon

    if config_file is not None and rows is not None:
        raise click.ClickException("--config and --rows: give one of them")
    try:
        policy = load_policy(policy_file)
        if config_file is not None:
            site = site_plan(config_file, policy, job_of(policy_file, policy))
            plans = [site.plan]
        else:
            datasets = load_silos(policy, policy_folder(policy_file))
            if rows is not None:
                plans = [rows_plan(policy, datasets, rows)]
            else:
                plans = consortium_plans(policy, datasets)
    except (*DEPLOYMENT_ERRORS, LedgerError, RosterError) as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        document = _document(policy, plans)
        if config_file is not None:
            caps = site.caps
            document["site"] = {
                "roster": site.roster,
                "job_cap": caps.job,
                "job_cap_key": caps.job_key,
                "total_cap": caps.total,
                "spent_elsewhere": json_epsilon(caps.spent_elsewhere),
                "accepts": site.refusal is None,
                "refusal": site.refusal,
            }
        click.echo(json.dumps(document, indent=2))
        return
    if plans[0].delta is None:
        console.print(f"policy {policy.name} {NO_DP}, no epsilon", soft_wrap=True)
        return
    console.print(_plans_table(policy, plans))
    if rows is not None:
        console.print(
            f"a silo of {rows} training rows in {policy.name}'s consortium (the schema of "
            f"{plans[0].silo}'s data)",
            soft_wrap=True,
        )
    console.print(WHAT_IT_IS)
    if config_file is not None:
        console.print(f"consortium of this site: {site.roster}", soft_wrap=True)
        for line in site_plan_lines(site)[1:]:
            console.print(line, soft_wrap=True, markup=False, highlight=False)
