"""Reports of simulations and deployments: results.json, a per-silo CSV and table, PNG plots,
the final model with its card (models/card.py), and a side-by-side comparison when several
algorithms ran on the same consortium. Under DP: each silo's epsilon over rounds against the
cap (results.json's `privacy`, `epsilon_per_round.png`, an epsilon column per algorithm in the
table) and, for a simulation, each silo's ledger (`ledgers/<silo>.jsonl`). With
`evaluation.cross_site`: the matrix in results.json (`cross_site`) and `cross_site.csv`.

Everything goes into a temporary sibling of the output folder first and is moved into place
only when complete, so an interrupted or failed run never leaves a half-written folder. Nothing
of the user's is ever deleted: fedsilo marks its result folders (`MARKER`, with a hash of every
file it wrote), refuses a non-empty folder without the marker or an existing file, and replaces
a marked folder only when asked to (`overwrite`) and only if it holds nothing else.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from rich.table import Table

from fedsilo import __version__
from fedsilo.coordinator.cross_site import CrossSiteMatrix
from fedsilo.coordinator.engine import RunHistory
from fedsilo.coordinator.strategies.base import ServerState
from fedsilo.coordinator.summary import R2
from fedsilo.models.card import CARD_KEY, ModelCard
from fedsilo.ops.cross_site_view import CSV_NAME, write_cross_site_csv
from fedsilo.ops.epsilon import (
    epsilon_by_round,
    final_epsilons,
    fmt_epsilon,
    plot_epsilon,
    privacy_summary,
    single_lines,
)
from fedsilo.ops.plots import integer_ticks, pyplot
from fedsilo.ops.shown_metrics import MetricDisplay
from fedsilo.ops.synthetic import write_synthetic
from fedsilo.policies.schema import Policy
from fedsilo.wire.tasks.tensor_names import MODEL, SYNTHETIC
from fedsilo.wire.tensors import encode_tensors

if TYPE_CHECKING:  # the coordinator writes results without loading the silo side
    from fedsilo.ops.simulate import SimulationResult

MARKER = ".fedsilo-results.json"
LEDGERS = "ledgers"  # a DP simulation's folder of silo ledgers, one `<silo>.jsonl` each
log = logging.getLogger("fedsilo.report")


class OutputFolderError(ValueError):
    """An output folder that fedsilo may not write (it would destroy something of the user's)."""


def check_output_folder(target: Path, overwrite: bool = False) -> None:
    """Raise OutputFolderError unless results can go to `target` without deleting anything
    fedsilo did not write: `target` is new, an empty folder, or (with `overwrite`) a folder of
    fedsilo's results holding nothing else; and its parent can be created and written."""
    target = Path(target)
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        raise OutputFolderError(f"--out {target}: exists and is not a folder; fedsilo leaves it be")
    if target.is_dir():
        if not any(target.iterdir()):
            return
        if not (target / MARKER).is_file():
            raise OutputFolderError(
                f"--out {target}: a folder that fedsilo did not write (it has no {MARKER}) and "
                "that is not empty; choose a new or empty folder"
            )
        if not overwrite:
            raise OutputFolderError(
                f"--out {target}: holds earlier fedsilo results; pass --overwrite to replace "
                "them, or choose another folder"
            )
        foreign = _foreign_entries(target)
        if foreign:
            raise OutputFolderError(
                f"--out {target}: holds fedsilo results but also {', '.join(foreign[:5])}, which "
                "fedsilo did not write; move them out first (--overwrite replaces only "
                "fedsilo's own files)"
            )
        return
    ancestor = next(p for p in target.parents if p.exists() or p == p.parent)
    if not ancestor.is_dir():
        raise OutputFolderError(f"--out {target}: cannot create it, {ancestor} is not a folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise OutputFolderError(f"--out {target}: cannot create it, {ancestor} is not writable")


@contextlib.contextmanager
def atomic_directory(target: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty temporary folder that takes the place of `target` only if the block
    succeeds, with a marker listing what it holds. `target` must pass `check_output_folder`
    first; whatever is at `target` at the end is moved aside, and deleted only if it then holds
    exactly the files its marker lists (else it is kept beside `target`, and logged), so a file
    written into it while the block ran is never lost."""
    target = Path(target)
    check_output_folder(target, overwrite)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    except OSError as exc:
        raise OutputFolderError(f"--out {target}: cannot write there: {exc.strerror}") from None
    try:
        yield staging
        _write_marker(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if not (target.exists() or target.is_symlink()):
        staging.rename(target)
    elif target.is_dir() and not target.is_symlink() and not any(target.iterdir()):
        target.rmdir()
        staging.rename(target)
    else:
        aside = _set_aside(target)
        staging.rename(target)
        _delete_if_only_ours(aside, target)


def _set_aside(target: Path) -> Path:
    aside = target.with_name(f"{target.name}.replaced-{time.strftime('%Y%m%dT%H%M%S')}")
    target.rename(aside)
    return aside


def _delete_if_only_ours(aside: Path, target: Path) -> None:
    """Delete `aside` (the replaced `target`) if it holds only what its marker lists; else keep
    it, and say where. Checked after the move, so a file written meanwhile is never lost."""
    if _foreign_entries(aside):
        log.warning("kept %s as %s: it held files fedsilo did not write", target, aside)
    else:
        shutil.rmtree(aside)


def _write_marker(folder: Path) -> None:
    """`MARKER`: who wrote the folder, and the SHA-256 of every file it holds."""
    files = {
        path.relative_to(folder).as_posix(): _sha256(path)
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }
    document = {"written_by": f"fedsilo {__version__}", "files": files}
    (folder / MARKER).write_text(json.dumps(document, indent=2))


def _foreign_entries(folder: Path) -> list[str]:
    """What `folder` holds beyond the files its marker lists with their exact contents
    (everything but the marker, when the marker is unreadable; itself, when not a folder)."""
    if folder.is_symlink() or not folder.is_dir():
        return [folder.name]
    try:
        listed = json.loads((folder / MARKER).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        listed = {}
    foreign = []
    for path in sorted(folder.rglob("*")):
        name = path.relative_to(folder).as_posix()
        if name == MARKER or (path.is_dir() and not path.is_symlink()):
            continue
        if path.is_symlink() or listed.get(name) != _sha256(path):
            foreign.append(name)
    return foreign


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_results(
    out: str | Path, results: Mapping[str, SimulationResult], overwrite: bool = False
) -> None:
    """One subfolder per algorithm, plus a comparison when there are several."""
    with atomic_directory(Path(out), overwrite) as staging:
        for name, result in results.items():
            folder = staging / name if len(results) > 1 else staging
            folder.mkdir(exist_ok=True)
            write_run(folder, result)
        if len(results) > 1:
            write_comparison(staging, results)


def write_deployment_results(
    out: Path,
    policy: Policy,
    history: RunHistory,
    snapshots: Mapping[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
    overwrite: bool = False,
    job: str | None = None,
) -> None:
    """What a simulation writes (results.json, silos.csv, the plots, the final model with its
    card and, for FedEvg, the synthetic set), plus the per-round history (`history.json`). The
    silos' sizes are those they reported (the coordinator never learns a validation split's);
    `job`: the job id results.json names."""
    with atomic_directory(out, overwrite) as staging:
        (staging / "history.json").write_text(json.dumps(_finite(history.to_json()), indent=2))
        document = {
            **({"job": job} if job is not None else {}),
            "device": "each site's own",
            "seconds": sum(r.seconds for r in history.records),
            "silos": _reported_profiles(history),
        }
        metric = _headline_metric(history.final.summary or {})
        write_report(staging, policy, history, document, metric, snapshots or {})


def _headline_metric(summary: Mapping[str, Any]) -> str | None:
    return next((m for m in ("accuracy", "rmse") if m in summary), next(iter(summary), None))


def _reported_profiles(history: RunHistory) -> list[dict[str, Any]]:
    """Each evaluated silo as results.json lists a simulation's (`SiloProfile`), with the sizes
    it reported: its training rows in its last `train` answer and its test rows in the final
    evaluation (None where it reported none, and for the validation split and label rate)."""
    trained: dict[str, int] = {}
    for record in history.records:
        for silo, answer in record.phases.get("train", {}).get("answered", {}).items():
            trained[silo] = answer["num_samples"]
    tested = history.final.test_sizes or {}
    return [
        {
            "name": silo,
            "train": trained.get(silo),
            "val": None,
            "test": tested.get(silo),
            "positive_rate": None,
        }
        for silo in sorted(history.final.evaluation or {})
    ]


def write_run(folder: Path, result: SimulationResult) -> None:
    if result.ledgers:
        (folder / LEDGERS).mkdir()
        for silo, ledger in result.ledgers.items():
            (folder / LEDGERS / f"{silo}.jsonl").write_bytes(ledger)
    document = {
        "task": result.task,
        "device": result.device,
        "seconds": result.seconds,
        "silos": [profile.__dict__ for profile in result.silos],
    }
    write_report(
        folder, result.policy, result.history, document, result.headline_metric, result.snapshots
    )


def write_report(
    folder: Path,
    policy: Policy,
    history: RunHistory,
    document: Mapping[str, Any],
    metric: str | None,
    snapshots: Mapping[int, tuple[torch.Tensor, torch.Tensor]],
) -> None:
    """One run's results in `folder`; `document`: results.json's device, seconds and silos."""
    card = write_final_model(folder, policy, history.state)
    final = history.final
    epsilon = _epsilon_series(history)
    privacy = {"privacy": privacy_summary(policy.privacy, epsilon)} if epsilon else {}
    results = {
        "fedsilo_version": __version__,
        "policy": policy.model_dump(mode="json"),
        **document,
        **privacy,
        "model": card.to_json() if card else None,
        # under DP the metrics as the silos released them, noised (shown clipped elsewhere)
        "metrics_noised": policy.privacy.differentially_private,
        "final": {"round": final.round, "per_silo": final.evaluation, "summary": final.summary},
        "failed_rounds": [{"round": r.round, "error": r.error} for r in history.failed],
        # evaluation.cross_site: model row -> site -> metrics (coordinator/cross_site.py)
        **({"cross_site": final.cross_site} if final.cross_site is not None else {}),
        "history": history.to_json()["rounds"],
    }
    (folder / "results.json").write_text(json.dumps(_finite(results), indent=2))
    if final.cross_site is not None:
        write_cross_site_csv(folder / CSV_NAME, CrossSiteMatrix.from_json(final.cross_site))
    silos = [p["name"] for p in document["silos"]]
    with (folder / "silos.csv").open("w", newline="") as handle:
        metrics = sorted(
            {m for values in (final.evaluation or {}).values() for m in values if "@" not in m}
        )
        writer = csv.writer(handle)
        writer.writerow(["silo", "train", "val", "test", *metrics])
        for profile in document["silos"]:
            values = (final.evaluation or {}).get(profile["name"], {})
            sizes = (profile[k] for k in ("train", "val", "test"))
            writer.writerow(
                [profile["name"], *("" if n is None else n for n in sizes)]
                + [values.get(m, "") for m in metrics]
            )
    if metric is not None:
        display = MetricDisplay.of(policy.privacy)
        histories = {policy.algorithm.name: display.history(history)}
        _plot_rounds(folder / "metric_per_round.png", histories, metric, display)
        _plot_final(folder / "final_per_silo.png", histories, silos, metric, display)
    if epsilon:
        plot_epsilon(
            folder / "epsilon_per_round.png", single_lines(epsilon), policy.privacy.epsilon_cap
        )
    _plot_mixing(folder / "mixing_weights.png", history)
    _write_lambda_curves(folder, final.evaluation or {})
    write_synthetic(folder, history.state, snapshots)


def _epsilon_series(history: RunHistory) -> dict[str, list[tuple[int, float]]]:
    return epsilon_by_round([*history.records, history.final])


def write_final_model(folder: Path, policy: Policy, state: ServerState) -> ModelCard | None:
    """`final_model.safetensors`: the final state's tensors, parameter spec and extras, and the
    model's card, except for FedEvg, whose result is its synthetic set, not a trained model."""
    header: dict[str, Any] = {"spec": state.spec.to_json(), "extra": dict(state.extra)}
    card = None
    if MODEL in state.tensors and SYNTHETIC not in state.tensors:
        card = ModelCard.describe(
            fedsilo_version=__version__,
            algorithm=policy.algorithm.name,
            model=policy.model,
            spec=state.spec,
            scaling=policy.data.scaling,
            seed=policy.seed,
        )
        header[CARD_KEY] = card.to_json()
    (folder / "final_model.safetensors").write_bytes(encode_tensors(state.tensors, header))
    return card


def write_comparison(folder: Path, results: Mapping[str, SimulationResult]) -> None:
    first = next(iter(results.values()))
    metric = first.headline_metric
    document = {
        name: {
            "per_silo": r.history.final.evaluation,
            "summary": r.history.final.summary,
            "epsilon": final_epsilons(_epsilon_series(r.history)) or None,
            "seconds": r.seconds,
        }
        for name, r in results.items()
    }
    (folder / "comparison.json").write_text(json.dumps(_finite(document), indent=2))
    display = MetricDisplay.of(first.policy.privacy)  # every variant keeps the privacy section
    histories = {name: display.history(r.history) for name, r in results.items()}
    silos = [p.name for p in first.silos]
    _plot_rounds(folder / "comparison_per_round.png", histories, metric, display)
    _plot_final(folder / "comparison_per_silo.png", histories, silos, metric, display)


def comparison_table(results: Mapping[str, SimulationResult]) -> Table:
    """Per-silo test metric of every algorithm side by side (under DP with each silo's final
    epsilon beside it, the metric as shown: noised, clipped into its range), then mean and
    worst silo."""
    first = next(iter(results.values()))
    metric = first.headline_metric
    spent = {name: final_epsilons(_epsilon_series(r.history)) for name, r in results.items()}
    display = MetricDisplay.of(first.policy.privacy)  # every variant keeps the privacy section
    finals = {name: display.record(r.history.final) for name, r in results.items()}
    table = Table(title=f"test {display.label(metric)} per silo ({first.task} task)")
    table.add_column("silo")
    table.add_column("train/val/test", justify="right")
    if any(p.positive_rate is not None for p in first.silos):
        table.add_column("positive rate", justify="right")
    for name, result in results.items():
        table.add_column(name, justify="right")
        if spent[name]:
            table.add_column("ε", justify="right")
            table.caption = _epsilon_caption(
                result.policy.privacy.delta, result.policy.privacy.epsilon_cap
            )
    for profile in first.silos:
        row = [profile.name, f"{profile.train}/{profile.val}/{profile.test}"]
        if profile.positive_rate is not None:
            row.append(f"{profile.positive_rate:.0%}")
        for name in results:
            shown = (finals[name].evaluation or {}).get(profile.name, {})
            row.append(fmt_metric(shown.get(metric)))
            if spent[name]:
                row.append(fmt_epsilon(spent[name].get(profile.name)))
        table.add_row(*row)
    table.add_section()
    pad = [""] * (len(table.columns) - 1 - len(results) - sum(1 for s in spent.values() if s))
    rows = [("mean", metric, "mean"), ("worst silo", metric, "worst"), ("Gini", metric, "gini")]
    if any(R2 in (final.summary or {}) for final in finals.values()):
        rows.append(("pooled R²", R2, "weighted_mean"))
    for label, shown, key in rows:
        values = []
        for name in results:
            values.append(fmt_metric(((finals[name].summary or {}).get(shown) or {}).get(key)))
            if spent[name]:
                values.append("")
        table.add_row(label, *pad, *values)
    return table


def _epsilon_caption(delta: float, cap: float | None) -> str:
    return f"ε: booked at δ={delta:g}, " + ("no cap" if cap is None else f"cap {cap:g}")


def _plot_rounds(
    path: Path, histories: Mapping[str, RunHistory], metric: str, display: MetricDisplay
) -> None:
    """Each history's mean and worst silo of `metric` by round; the histories are as shown
    (`MetricDisplay.history`), the axis names the metric as `display` does."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, history in histories.items():
        rounds = [r for r in history.records if r.summary and metric in r.summary]
        xs = [r.round for r in rounds]
        line = ax.plot(xs, [r.summary[metric]["mean"] for r in rounds], label=f"{name} mean")[0]
        ax.plot(
            xs,
            [r.summary[metric]["worst"] for r in rounds],
            "--",
            color=line.get_color(),
            label=f"{name} worst silo",
        )
    ax.set_xlabel("round")
    integer_ticks(ax)
    ax.set_ylabel(f"test {display.label(metric)}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_final(
    path: Path,
    histories: Mapping[str, RunHistory],
    silos: list[str],
    metric: str,
    display: MetricDisplay,
) -> None:
    plt = pyplot()
    width = 0.8 / len(histories)
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(silos)), 4))
    for i, (name, history) in enumerate(histories.items()):
        values = [(history.final.evaluation or {}).get(s, {}).get(metric, math.nan) for s in silos]
        ax.bar([j + i * width for j in range(len(silos))], values, width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(silos))], silos, rotation=30, ha="right")
    ax.set_ylabel(f"final test {display.label(metric)}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_mixing(path: Path, history: RunHistory) -> None:
    """A mixing schedule's coefficient of each silo over rounds (no file for other algorithms)."""
    rounds = [r for r in history.records if r.mixing]
    if not rounds:
        return
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for silo in sorted({s for r in rounds for s in r.mixing or {}}):
        ax.plot(
            [r.round for r in rounds],
            [(r.mixing or {}).get(silo, math.nan) for r in rounds],
            label=silo,
        )
    ax.set_xlabel("round")
    integer_ticks(ax)
    ax.set_ylabel("mixing coefficient")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def lambda_curves(evaluation: Mapping[str, Mapping[str, float]]) -> dict[str, dict[str, Any]]:
    """SuPerFed's curves in an evaluation (metrics named `name@lambda`): per silo, the lambdas
    and each metric's values along them (nothing for other algorithms)."""
    curves: dict[str, dict[str, Any]] = {}
    for silo, metrics in evaluation.items():
        points: dict[str, dict[float, float]] = {}
        for key, value in metrics.items():
            if "@" in key:
                name, lam = key.rsplit("@", 1)
                points.setdefault(name, {})[float(lam)] = value
        if points:
            lambdas = sorted(next(iter(points.values())))
            curves[silo] = {"lambda": lambdas} | {
                name: [values[lam] for lam in lambdas] for name, values in sorted(points.items())
            }
    return curves


def _write_lambda_curves(folder: Path, evaluation: Mapping[str, Mapping[str, float]]) -> None:
    """`lambda_curves.csv` (silo, lambda, every curve's metric) and `lambda_curves.png` (the
    headline metric against lambda per silo, test solid, selection split dashed, lambda*
    marked), for an evaluation that has curves."""
    curves = lambda_curves(evaluation)
    if not curves:
        return
    names = sorted({n for curve in curves.values() for n in curve if n != "lambda"})
    with (folder / "lambda_curves.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["silo", "lambda", *names])
        for silo, curve in sorted(curves.items()):
            for i, lam in enumerate(curve["lambda"]):
                writer.writerow([silo, lam, *(curve.get(n, [""] * (i + 1))[i] for n in names)])
    metric = "accuracy" if "accuracy" in names else names[0]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for silo, curve in sorted(curves.items()):
        (line,) = ax.plot(curve["lambda"], curve[metric], label=silo)
        if f"selection_{metric}" in curve:
            ax.plot(curve["lambda"], curve[f"selection_{metric}"], "--", color=line.get_color())
        star = evaluation[silo].get("lambda_star")
        if star is not None:
            ax.plot([star], [evaluation[silo].get(metric, math.nan)], "o", color=line.get_color())
    ax.set_xlabel("lambda (0: global model, 1: local model)")
    ax.set_ylabel(metric)
    ax.set_title("test (solid), selection split (dashed), lambda* (o)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(folder / "lambda_curves.png", dpi=120)
    plt.close(fig)


def fmt_metric(value: float | None) -> str:
    """Three decimals; "-" for a metric that is absent or undefined (NaN)."""
    return (
        "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.3f}"
    )


def _finite(value: Any) -> Any:
    """JSON has no NaN: undefined metrics (e.g. AUROC on one class) are written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value
