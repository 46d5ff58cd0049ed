"""The `fedsilo` command line: validate policies, list algorithms, run simulations.

Every user error (policy, data, device, a run that cannot go on) is printed as one clear
message and exits non-zero before anything is written.
"""

from __future__ import annotations

from importlib.resources import as_file, files
from pathlib import Path

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from fedsilo import __version__
from fedsilo.coordinator.engine import RoundRecord, RunAborted
from fedsilo.coordinator.strategies import STRATEGIES
from fedsilo.coordinator.strategies.base import SetupError
from fedsilo.ops.report import comparison_table, write_results
from fedsilo.ops.simulate import SimulationResult, load_silos, simulate
from fedsilo.policies.loading import PolicyError, load_policy
from fedsilo.policies.schema import Policy
from fedsilo.silo.data import DataError
from fedsilo.silo.device import DeviceError

DEFAULT_POLICY = "examples/heart-fedavg.yaml"
USER_ERRORS = (PolicyError, DataError, DeviceError, RunAborted, SetupError)

console = Console()


@click.group()
@click.version_option(__version__, prog_name="fedsilo")
def main() -> None:
    """fedsilo: privacy-hardened cross-silo federated learning."""


@main.group()
def policy() -> None:
    """Work with policy files."""


@policy.command("validate")
@click.argument("file", type=click.Path(path_type=Path))
def validate(file: Path) -> None:
    """Check FILE against the policy schema and say what it selects."""
    loaded = _load(file)
    console.print(
        f"[green]OK[/green] {file}: policy '{loaded.name}' (version {loaded.version}), "
        f"algorithm {loaded.algorithm.name}, model {loaded.model.name}, {loaded.rounds} rounds, "
        f"data {loaded.data.source}"
    )


@main.command("algorithms")
def algorithms() -> None:
    """List the algorithms a policy may select."""
    for name, cls in STRATEGIES.items():
        console.print(f"{name:12s} {(cls.__doc__ or cls.__module__).strip().splitlines()[0]}")


@main.command("simulate")
@click.option(
    "--policy",
    "policy_file",
    type=click.Path(path_type=Path),
    help="Policy YAML (default: FedAvg on the bundled four-hospital heart data).",
)
@click.option("--silos", type=int, help="Override the number of silos (simulated partitions only).")
@click.option("--seed", type=int, help="Override the policy's seed.")
@click.option(
    "--out", type=click.Path(path_type=Path), help="Output folder (default: runs/<policy name>)."
)
@click.option(
    "--compare",
    "compare",
    multiple=True,
    type=click.Choice(sorted(STRATEGIES)),
    help="Also run this algorithm on the same silos, side by side (repeatable).",
)
def simulate_command(
    policy_file: Path | None,
    silos: int | None,
    seed: int | None,
    out: Path | None,
    compare: tuple[str, ...],
) -> None:
    """Run a consortium in this process and write results, tables and plots."""
    base = _load(policy_file) if policy_file else _default_policy()
    try:
        base = base.with_overrides(seed=seed, silos=silos)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    variants = {base.algorithm.name: base}
    variants.update({name: base.with_algorithm(name) for name in compare if name not in variants})
    base_dir = policy_file.parent if policy_file else None
    try:
        datasets = load_silos(base, base_dir)
        results = _run_all(variants, datasets)
    except USER_ERRORS as exc:
        raise click.ClickException(str(exc)) from None
    out = out or Path("runs") / base.name
    write_results(out, results)
    first = next(iter(results.values()))
    console.print(f"device: {first.device}")
    console.print(comparison_table(results))
    _explain_label_rates(first)
    console.print(f"results in {out}/")


def _run_all(variants: dict[str, Policy], datasets: list) -> dict[str, SimulationResult]:
    results: dict[str, SimulationResult] = {}
    columns = (
        TextColumn("{task.description:>10}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        for name, variant in variants.items():
            bar = progress.add_task(name, total=variant.rounds, status="")
            results[name] = simulate(
                variant, datasets, observers=[_ProgressObserver(progress, bar)]
            )
    return results


class _ProgressObserver:
    def __init__(self, progress: Progress, bar: object) -> None:
        self.progress, self.bar = progress, bar

    def on_round(self, record: RoundRecord, total_rounds: int) -> None:
        status = f"round {record.round} {record.status}"
        if record.summary:
            metric = "accuracy" if "accuracy" in record.summary else next(iter(record.summary))
            status += f"  mean {metric} {record.summary[metric]['mean']:.3f}"
        self.progress.update(self.bar, advance=1, status=status)


def _explain_label_rates(result: SimulationResult) -> None:
    rates = [p.positive_rate for p in result.silos if p.positive_rate is not None]
    if len(rates) >= 2 and max(rates) - min(rates) > 0.2:
        console.print(
            "Note: the silos' positive-label rates range from "
            f"{min(rates):.0%} to {max(rates):.0%}. "
            "A local model learns its own silo's base rate, so local-only training can rival one "
            "shared model; personalised methods (e.g. SuPerFed) exist for exactly this."
        )


def _load(file: Path) -> Policy:
    try:
        return load_policy(file)
    except PolicyError as exc:
        raise click.ClickException(str(exc)) from None


def _default_policy() -> Policy:
    with as_file(files("fedsilo.policies") / DEFAULT_POLICY) as path:
        return _load(path)
