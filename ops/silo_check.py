"""`fedsilo silo check`: a site's own data, loaded offline exactly as the silo agent will load
it, summarised before any job: the task (classification, regression, ...) and why (set in
the data section, the source's own, or inferred from the target column), rows, columns, each
column's inferred type and missing values, the label balance, and what the preprocessing
makes of it (features after encoding, split sizes). With a policy, also what that policy
asks of this site: its local rules, its domains, a model built for these features, and whether
the site accepts the job on privacy grounds (its plan, caps and what its ledger spent on other
jobs: ops/plan_cli.py). A data plug-in is called as the agent calls it; silo.yaml's `kit`
must be a silo's kit as `silo start` loads it.

A problem is one `DataError` (or `PolicyError`) naming the silo.yaml key to change
(`data.categorical`, `rules.max_rounds`, ...); nothing is written. A silo.yaml in the old
nested data shape gets a note saying how to write it flat.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import click
import pandas as pd

from fedsilo.models.zoo import build_model
from fedsilo.policies.data import PLUGIN_SOURCE, DataConfig, NaturalPartition
from fedsilo.policies.loading import PolicyError, load_policy
from fedsilo.policies.schema import Policy
from fedsilo.silo.config import SiloConfig, load_silo_config
from fedsilo.silo.data import DataError, SiloDataset
from fedsilo.silo.data.encoding import task_reason
from fedsilo.silo.data.sources import RawSource, read_source
from fedsilo.silo.domains import check_domains
from fedsilo.silo.errors import SECTION, DpSgdError

CHECK_SEED = 0  # the split seed without a policy (a policy's own seed replaces it)


@dataclass(frozen=True)
class ColumnSummary:
    name: str
    role: str  # feature, target, dropped, or not a feature
    kind: str  # pandas' inferred type, or "categorical (n declared)"
    missing: int


@dataclass(frozen=True)
class SiteDataSummary:
    origin: str
    rows: int
    columns: tuple[ColumnSummary, ...]
    labels: dict[str, int] | None  # classification: rows per class
    dataset: SiloDataset
    task_reason: str = ""  # where the task comes from: set, the source's, or inferred
    model_parameters: int | None = None  # with a policy: the size of its model on this data
    note: str | None = None  # how to write silo.yaml's data section in the current shape


def check_site_data(config_file: Path, policy: Policy | None = None) -> SiteDataSummary:
    """Load the site's data as `silo start` would (under `policy`'s seed, rules and model when
    given) and summarise it, then check its kit; a DataError or PolicyError names the silo.yaml
    key (and, for the kit, its folder) to change."""
    config = load_silo_config(config_file)
    summary = summarise(config, config_file.parent, policy)
    check_kit(config, config_file)
    return summary


def check_kit(config: SiloConfig, config_file: Path) -> None:
    """Refuse silo.yaml's `kit` unless it is a silo's kit as `silo start` loads it (not a
    missing folder, nor the coordinator's or the operator's kit): a DataError naming `kit`."""
    from fedsilo.ops.provision import KitError, load_silo_kit  # only here: its crypto imports

    folder = config.kit_path(config_file)
    try:
        load_silo_kit(folder)
    except (KitError, OSError, ValueError) as error:
        raise DataError(f"kit: {error}") from None


def summarise(config: SiloConfig, base_dir: Path, policy: Policy | None = None) -> SiteDataSummary:
    """`check_site_data` for a parsed silo.yaml whose relative paths start at `base_dir`."""
    if policy is not None:
        broken = config.rules.violations(policy)
        if broken:
            raise PolicyError(
                "this site's rules refuse the policy: "
                + "; ".join(f"rules.{rule}" for rule in broken)
            )
    source = config.data.site_source()
    raw = read_site_source(config, base_dir)
    dataset = config.data.load(CHECK_SEED if policy is None else policy.seed, base_dir)
    raw = _this_silos_rows(raw, source, dataset.name)
    parameters = None if policy is None else _model_parameters(policy, dataset)
    return SiteDataSummary(
        origin=raw.origin,
        rows=len(raw.frame),
        columns=_columns(raw, config),
        labels=_label_counts(raw) if dataset.task == "classification" else None,
        dataset=dataset,
        task_reason=task_reason(raw, source).replace(SECTION, config.data.section_key),
        model_parameters=parameters,
        note=config.data.shape_note(),
    )


def read_site_source(config: SiloConfig, base_dir: Path) -> RawSource:
    """The site's data as its source reads it (a file, a built-in set, a plug-in's loader); a
    DataError names the silo.yaml key, also when a plug-in's own code fails."""
    source = config.data.site_source()
    try:
        return read_source(source, base_dir)
    except DataError as error:
        raise error.within(config.data.section_key) from None
    except Exception as error:  # a plug-in's own code failing, as it would in the agent
        if source.source != PLUGIN_SOURCE:
            raise
        raise DataError(
            f"{config.data.section_key}.loader: data plug-in '{source.loader}' failed to load "
            f"this site's data: {error} ({type(error).__name__})"
        ) from None


def _this_silos_rows(raw: RawSource, source: DataConfig, silo: str) -> RawSource:
    """The raw rows of this silo when a natural partition names them (the bundled hospitals);
    a simulated partition deals rows at random, so its summary is of the whole source."""
    partition = source.resolved_partition()
    if not isinstance(partition, NaturalPartition):
        return raw
    rows = raw.frame[partition.column].astype(str) == silo
    return replace(raw, frame=raw.frame[rows], origin=f"{raw.origin}, {partition.column} {silo}")


def _model_parameters(policy: Policy, dataset: SiloDataset) -> int:
    try:
        check_domains(policy, dataset)
        model = build_model(policy.model, dataset.input_shape, dataset.output_dim, policy.seed)
    except ValueError as error:
        raise DataError(f"the policy does not fit this site's data: {error}") from None
    return sum(parameter.numel() for parameter in model.parameters())


def _columns(raw: RawSource, config: SiloConfig) -> tuple[ColumnSummary, ...]:
    source = config.data.site_source()
    markers = {**raw.dictionary.missing_values, **source.missing_values}
    summaries = []
    for name in raw.frame.columns:
        series = raw.frame[name]
        missing = series.isna() | series.isin(list(markers.get(str(name), ())))
        summaries.append(
            ColumnSummary(
                str(name), _role(str(name), raw, config), _kind(series, raw), int(missing.sum())
            )
        )
    return tuple(summaries)


def _role(name: str, raw: RawSource, config: SiloConfig) -> str:
    if name == raw.dictionary.target:
        return "target"
    if name in config.data.source.drop_columns:
        return "dropped"
    if name in raw.dictionary.not_features:
        return "not a feature"
    return "feature"


def _kind(series: pd.Series, raw: RawSource) -> str:
    categories = raw.dictionary.categorical.get(str(series.name))
    if categories is not None:
        return f"categorical ({len(categories)} declared)"
    return pd.api.types.infer_dtype(series, skipna=True)


def _label_counts(raw: RawSource) -> dict[str, int] | None:
    """Rows per class: of the target column, or of the labels a source keeps beside its frame
    (a data plug-in's); None when the labels are not one class per row."""
    if raw.labels is not None:
        if raw.labels.ndim != 1:
            return None
        labels = pd.Series(raw.labels)
    else:
        labels = raw.frame[raw.dictionary.target]
    counts = labels.value_counts().sort_index()
    return {str(label): int(count) for label, count in counts.items()}


def render(summary: SiteDataSummary) -> list[str]:
    """The summary as lines of text."""
    data = summary.dataset
    sizes = (len(data.y_train), len(data.y_val), len(data.y_test))
    lines = [
        f"{summary.origin}: {summary.rows} rows, {len(summary.columns)} columns "
        f"(this silo, {data.name!r}: {sizes[0] + sizes[1] + sizes[2]} rows)",
        f"task: {data.task} ({summary.task_reason})",
        f"  {'column':<24} {'role':<14} {'type':<26} missing",
    ]
    for column in summary.columns:
        lines.append(f"  {column.name:<24} {column.role:<14} {column.kind:<26} {column.missing}")
    if summary.labels is not None:
        balance = ", ".join(
            f"{label}: {count} ({count / summary.rows:.0%})"
            for label, count in summary.labels.items()
        )
        lines.append(f"labels ({data.num_classes} classes): {balance}")
    elif data.task == "classification":
        lines.append(f"labels ({data.num_classes} classes): one row may hold several")
    else:
        lines.append(f"targets: {len(data.y_train)} for training")
    lines.append(
        f"after encoding: {len(data.feature_names)} features ({', '.join(data.feature_names)})"
    )
    lines.append(f"splits: train {sizes[0]}, val {sizes[1]}, test {sizes[2]}")
    if summary.model_parameters is not None:
        lines.append(f"the policy's model: {summary.model_parameters} parameters on this data")
    if summary.note is not None:
        lines.append(f"note: {summary.note}")
    return lines


@click.command("check")
@click.option(
    "--config",
    "config_file",
    required=True,
    type=click.Path(path_type=Path),
    help="This site's silo.yaml.",
)
@click.option(
    "--policy",
    "policy_file",
    help="A policy (file or example:NAME) to check this site's data and rules against.",
)
def silo_check(config_file: Path, policy_file: str | None) -> None:
    """Load this site's data offline and say what a job will see, or what is wrong."""
    from fedsilo.ops.plan_cli import job_of, site_plan, site_plan_lines
    from fedsilo.privacy.ledger import LedgerError

    try:
        policy = None if policy_file is None else load_policy(policy_file)
        summary = check_site_data(config_file, policy)
        site = None
        if policy is not None and policy_file is not None:
            site = site_plan(config_file, policy, job_of(policy_file, policy))
    except (PolicyError, DataError, DpSgdError, LedgerError) as exc:
        raise click.ClickException(str(exc)) from None
    for line in render(summary):
        click.echo(line)
    if site is not None:  # whether this site accepts the job on privacy grounds
        for line in site_plan_lines(site):
            click.echo(line)
