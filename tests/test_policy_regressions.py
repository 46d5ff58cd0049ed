"""What the policy-space property test (tests/test_policy_space.py) found, each as the policy
that found it: each one crashed, or ran to metrics that meant nothing, on the code before
issue 37; each is now refused in one message naming the field, or runs."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner, Result

from fedsilo.coordinator.engine import RoundEngine
from fedsilo.coordinator.strategies import make_strategy
from fedsilo.coordinator.transport import InProcessTransport
from fedsilo.ops.cli import main
from fedsilo.ops.sim_silos import ConsortiumKeys, build_agent
from fedsilo.ops.simulate import load_silos
from fedsilo.policies.loading import PolicyError, parse_policy
from fedsilo.wire.messages import TaskResult

MASKING_OVER_A_NATURAL_PARTITION = {
    "version": 1,
    "rounds": 2,
    "data": {"source": "heart", "partition": {"kind": "natural", "column": "dataset"}},
    "secure_aggregation": {"method": "masking"},
}


def cli(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


def write(tmp_path: Path, document: dict) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def simulated(tmp_path: Path, document: dict) -> dict:
    """`fedsilo simulate` of `document` to its end: results.json."""
    result = cli(
        "simulate", "--policy", str(write(tmp_path, document)), "--out", str(tmp_path / "out")
    )
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 0, result.output
    return json.loads((tmp_path / "out" / "results.json").read_text())


@pytest.mark.parametrize("method", ["masking", "ckks"])
def test_secure_aggregation_over_a_natural_partition_runs(tmp_path: Path, method: str) -> None:
    # was: AttributeError: 'NaturalPartition' object has no attribute 'silos' (validate,
    # simulate and parse_policy alike)
    document = {**MASKING_OVER_A_NATURAL_PARTITION, "secure_aggregation": {"method": method}}
    parse_policy(document)
    validated = cli("policy", "validate", str(write(tmp_path, document)))
    assert validated.exit_code == 0, validated.output
    assert "data: 4 silos" in validated.output
    results = simulated(tmp_path, document)
    assert [r["status"] for r in results["history"]] == ["completed", "completed"]


def test_a_secure_group_larger_than_a_natural_partition_is_refused_once_the_data_is_read(
    tmp_path: Path,
) -> None:
    # was: accepted, every round failed at the silos, and simulate wrote the untrained
    # model's metrics as the run's result
    document = {
        **MASKING_OVER_A_NATURAL_PARTITION,
        "secure_aggregation": {"method": "masking", "min_group": 5},
    }
    parse_policy(document)  # the policy alone cannot know: the silos are the data's hospitals
    path = write(tmp_path, document)
    for command in (["policy", "validate", str(path)], ["simulate", "--policy", str(path)]):
        result = cli(*command)
        assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
        assert "secure_aggregation.min_group: 5 silos at least, and the consortium has 4" in (
            result.output
        )


def test_a_policy_whose_every_round_fails_writes_no_result(tmp_path: Path) -> None:
    # was: exit 0 and a table of the initial model's metrics, because the final evaluation
    # of the untouched model counted as an evaluated round (here: the silos refuse every
    # masked sum, whose sample-count weights give two of the four hospitals less than the
    # policy's min_weight, where it needs three above it; the plain evaluation goes on)
    document = {
        "version": 1,
        "rounds": 2,
        "secure_aggregation": {"method": "masking", "min_group": 3, "min_weight": 0.25},
        "participants": {"max_consecutive_failed_rounds": 5},
    }
    result = cli(
        "simulate", "--policy", str(write(tmp_path, document)), "--out", str(tmp_path / "o")
    )
    assert result.exit_code == 1, result.output
    assert "every round failed" in result.output and not (tmp_path / "o").exists()


def test_aaggff_reads_noised_losses_within_their_domain(tmp_path: Path) -> None:
    # was: ValueError: losses must be non-negative, mid-run (a noised loss can be negative)
    document = {
        "version": 1,
        "rounds": 3,
        "algorithm": {"name": "aaggff"},
        "privacy": {"dp_sgd": {"noise_multiplier": 1.0}, "reports": {"noise_multiplier": 50}},
    }
    results = simulated(tmp_path, document)
    assert [r["status"] for r in results["history"]] == ["completed"] * 3
    raw = [m["loss"] for r in results["history"] for m in r["phases"]["loss"]["answered"].values()]
    assert min(raw) < 0  # the raw noised reports, kept as the silos sent them


def test_federated_scaling_of_a_source_without_validation_rows_runs(tmp_path: Path) -> None:
    # was: setup failed at every silo: cannot reshape tensor of 0 elements into shape [0, -1]
    # (TCGA-BRCA's published split has no validation rows)
    document = {"version": 1, "rounds": 1, "data": {"source": "tcga_brca", "scaling": "federated"}}
    results = simulated(tmp_path, document)
    assert all(math.isfinite(m["c_index"]) for m in results["final"]["per_silo"].values())


def test_a_quorum_larger_than_a_partitions_silos_is_refused_when_the_policy_is_read() -> None:
    with pytest.raises(PolicyError, match="participants.min_silos"):
        parse_policy(
            {
                **MASKING_OVER_A_NATURAL_PARTITION,
                "data": {"source": "sklearn:wine", "partition": {"kind": "iid", "silos": 2}},
                "participants": {"min_silos": 3},
            }
        )


def test_tcga_brca_dealt_into_iid_silos_runs(tmp_path: Path) -> None:
    # was: refused, "column 'region' ... is not numeric; declare its categories under
    # data.categorical", which a bundled source cannot: the region names the natural silo,
    # it is no feature
    document = {
        "version": 1,
        "rounds": 1,
        "data": {"source": "tcga_brca", "partition": {"kind": "iid", "silos": 3}},
    }
    results = simulated(tmp_path, document)
    assert len(results["final"]["per_silo"]) == 3


@pytest.mark.parametrize(
    ("section", "field"),
    [
        ({"algorithm": {"name": "propfair", "baseline": 5e-324}}, "baseline"),
        ({"privacy": {"client_dp": {"clip": 5e-324, "noise_multiplier": 1.0}}}, "clip"),
    ],
)
def test_a_subnormal_setting_is_refused_when_the_policy_is_read(
    tmp_path: Path, section: dict, field: str
) -> None:
    # was: PropFair's "needs every loss below the baseline M = 5e-324" mid-run (its clip to
    # M (1 - 1e-6) rounds back to M), and client DP's noise std z * 5e-324 / m underflowing
    # to 0 at every silo ("AccountingError: noise_std must be positive")
    document = {"version": 1, "rounds": 1, **section}
    result = cli("policy", "validate", str(write(tmp_path, document)))
    assert result.exit_code == 1, result.output
    assert f"{field}: 5e-324 is below the smallest normal float" in result.output


@pytest.mark.parametrize(
    ("algorithm", "source", "says"),
    [
        (
            {"name": "multiboost"},
            "sklearn:wine",
            "multiboost boosts binary classifiers; this data is a classification task of 3 classes",
        ),
        ({"name": "multiboost"}, "sklearn:diabetes", "this data is a regression task"),
        (
            {"name": "fedevg"},
            "tcga_brca",
            "fedevg works per class (classification only); this data is a survival task",
        ),
    ],
)
def test_an_algorithm_the_datas_task_does_not_fit_is_refused_when_the_data_is_read(
    tmp_path: Path, algorithm: dict, source: str, says: str
) -> None:
    # was: accepted; every round failed at the silos ("multiboost needs a binary
    # classification task")
    data = {"source": source} | ({"scaling": "none"} if algorithm["name"] == "fedevg" else {})
    document = {"version": 1, "rounds": 1, "algorithm": algorithm, "data": data}
    result = cli("policy", "validate", str(write(tmp_path, document)))
    assert result.exit_code == 1 and says in result.output, result.output


def test_a_noise_multiplier_that_leaves_no_guarantee_is_refused_when_the_policy_is_read(
    tmp_path: Path,
) -> None:
    # was: simulate crashed with "AccountingError: gaussian: noise_std must be positive and
    # finite, not 0.0": client DP's std z * clip / m underflowed to 0 for the smallest normal
    # z and clip (2.2e-308), which the schema took
    tiny = 2.2250738585072014e-308
    document = {
        "version": 1,
        "rounds": 1,
        "data": {"source": "sklearn:digits", "partition": {"kind": "iid", "silos": 1}},
        "privacy": {"client_dp": {"clip": tiny, "noise_multiplier": tiny}},
    }
    result = cli("policy", "validate", str(write(tmp_path, document)))
    assert result.exit_code == 1, result.output
    assert "privacy.client_dp.noise_multiplier: noise_multiplier 2.22507e-308 is below 0.01" in (
        result.output
    )


def test_a_training_that_diverges_says_so_beside_its_metrics(tmp_path: Path) -> None:
    # was: exit 0 and a table of "-" for every silo, with nothing said: 56 training molecules
    # standardised one atom type at a time make the graph network's outputs overflow
    document = {
        "version": 1,
        "seed": 242160,
        "rounds": 2,
        "data": {
            "source": "molecules:esol",
            "partition": {"kind": "iid", "silos": 1},
            "split": {"train": 0.05, "val": 0.0, "test": 0.95},
        },
        "algorithm": {"name": "central"},
        "model": {"name": "gcn"},
    }
    path = write(tmp_path, document)
    result = cli("simulate", "--policy", str(path), "--out", str(tmp_path / "out"))
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert "the final rmse is not finite at silo-0" in said and "training.lr" in said


def test_a_delta_that_guarantees_nothing_is_refused_when_the_policy_is_read(tmp_path: Path) -> None:
    # was: every round failed at every silo, "RuntimeError: Cannot compute epsilon" (the PRV
    # accountant calibrating DP-SGD to a target epsilon at delta 0.98)
    document = {
        "version": 1,
        "rounds": 1,
        "privacy": {"delta": 0.98, "accountant": "prv", "dp_sgd": {"target_epsilon": 2.0}},
    }
    result = cli("policy", "validate", str(write(tmp_path, document)))
    assert result.exit_code == 1 and "privacy.delta" in result.output, result.output


@pytest.mark.parametrize("key", ["key_holder", "decryptor"])
def test_a_ckks_key_holder_or_decryptor_outside_the_consortium_is_refused_when_the_data_is_read(
    tmp_path: Path, key: str
) -> None:
    # was: accepted; every round failed ("the key holder 'nobody' is not a member of this
    # consortium")
    document = {"version": 1, "rounds": 1, "secure_aggregation": {"method": "ckks", key: "nobody"}}
    result = cli("policy", "validate", str(write(tmp_path, document)))
    assert result.exit_code == 1, result.output
    assert f"secure_aggregation.{key}: 'nobody' is not a silo of this consortium" in result.output


DIVERGING = {
    "version": 1,
    "seed": 16384,
    "rounds": 1,
    "data": {"source": "molecules:esol", "partition": {"kind": "scaffold", "silos": 2}},
    "algorithm": {"name": "superfed", "ortho_nu": 2.3, "prox_mu": 2.3, "start_fraction": 0.0},
    "model": {"name": "linear"},
}


@pytest.mark.parametrize("method", ["masking", "ckks"])
def test_a_diverged_update_enters_no_secure_sum(tmp_path: Path, method: str) -> None:
    # was, under masking: the NaN update fixed-point encoded into the sum as garbage, and the
    # run ended "completed" with a model whose every metric was not finite; under CKKS:
    # "CkksError: values must be finite", naming no setting
    document = {**DIVERGING, "secure_aggregation": method}
    result = cli(
        "simulate", "--policy", str(write(tmp_path, document)), "--out", str(tmp_path / "o")
    )
    assert result.exit_code == 1, result.output
    said = " ".join(result.output.split())
    assert "every round failed" in said
    assert (
        "the trained 'model' is not finite, so it enters no sum" in said and "training.lr" in said
    )


def test_a_radon_aggregation_a_round_cannot_feed_is_refused_when_the_model_is_known(
    tmp_path: Path,
) -> None:
    # was: simulate crashed mid-run, "RadonError: 1 models given, but the Radon point of
    # models with d = 40 parameters needs at least r = d + 2 = 42"
    document = {
        "version": 1,
        "rounds": 1,
        "data": {"source": "tcga_brca"},
        "algorithm": {"name": "feddc", "aggregator": "radon", "aggregation_period": 1},
    }
    result = cli("policy", "validate", str(write(tmp_path, document)))
    assert result.exit_code == 1, result.output
    said = " ".join(result.output.split())
    assert (
        "algorithm.aggregator: the Radon point of models of 40 parameters takes r = d + 2 = 42"
        in said
    )


def test_dp_or_loss_probes_on_a_task_without_per_row_losses_are_refused_when_the_data_is_read(
    tmp_path: Path,
) -> None:
    # was: accepted; every round failed at every silo ("the survival task's Cox
    # partial-likelihood loss has no per-row loss") under client DP's noised reports, and under
    # a mixing schedule's loss probes
    for extra, says in (
        ({"privacy": {"client_dp": {"clip": 1.0, "noise_multiplier": 1.0}}}, "privacy: under DP"),
        ({"algorithm": {"name": "aaggff"}}, "algorithm: aaggff probes each silo's loss"),
    ):
        document = {"version": 1, "rounds": 1, "data": {"source": "tcga_brca"}, **extra}
        result = cli("policy", "validate", str(write(tmp_path, document)))
        assert result.exit_code == 1, result.output
        said = " ".join(result.output.split())
        assert says in said and "has no per-row loss" in said


def test_masking_with_the_smallest_bound_runs(tmp_path: Path) -> None:
    # was: every round failed at every silo, "OverflowError: cannot convert float infinity to
    # integer" (the finest fixed point for a bound of 2.2e-308 asked for 2^1053)
    document = {
        "version": 1,
        "rounds": 1,
        "secure_aggregation": {"method": "masking", "bound": 2.2250738585072014e-308},
    }
    results = simulated(tmp_path, document)
    assert results["history"][0]["status"] == "completed"


def test_a_probe_in_which_no_silo_reports_a_finite_loss_fails_its_round_naming_why() -> None:
    # was: simulate crashed, "ValueError: no silo reported a finite loss; there is nothing to
    # aggregate" (AAggFF after its server optimizer's tau of 2.2e-308 blew the model up; here
    # the silos' loss reports are made non-finite on the way)
    policy = parse_policy({"version": 1, "rounds": 1, "algorithm": {"name": "aaggff"}})
    datasets = load_silos(policy, None)
    keys = ConsortiumKeys.generate(d.name for d in datasets)

    def diverged(endpoint):
        def answer(payload):
            result = TaskResult.decode(endpoint(payload))
            if result.kind == "loss":
                result = replace(result, metrics={**result.metrics, "loss": math.nan})
            return result.encode()

        return answer

    agents = {d.name: build_agent(policy, d.name, d, torch.device("cpu"), keys) for d in datasets}
    transport = InProcessTransport({n: diverged(a.handle_bytes) for n, a in agents.items()})
    (record,) = RoundEngine(make_strategy(policy), transport, policy, sorted(agents)).run().records
    assert record.status == "failed"
    assert record.error.startswith("no silo reported a finite loss: the model diverged")


def test_a_delta_the_prv_accountant_cannot_resolve_is_refused_when_the_policy_is_read(
    tmp_path: Path,
) -> None:
    # was: every round failed, each silo "crashed: ValueError('cannot convert float NaN to
    # integer')" accounting DP-SGD at delta 2.2e-308 with the PRV accountant
    document = {
        "version": 1,
        "rounds": 1,
        "privacy": {
            "accountant": "prv",
            "delta": 2.2250738585072014e-308,
            "dp_sgd": {"noise_multiplier": 0.3},
        },
    }
    result = cli("policy", "validate", str(write(tmp_path, document)))
    assert result.exit_code == 1, result.output
    assert "delta: 2.22507e-308 is below 1e-10, which the prv accountant cannot resolve" in (
        " ".join(result.output.split())
    )


def test_a_survival_model_that_diverged_is_evaluated_to_a_c_index_it_says_is_not_finite(
    tmp_path: Path,
) -> None:
    # was: every round failed at the evaluation, "ValueError: NaNs detected in inputs" from
    # lifelines (FedAdam's server step with tau 2.2e-308 blew the model up)
    document = {
        "version": 1,
        "seed": 218382,
        "rounds": 1,
        "data": {
            "source": "tcga_brca",
            "partition": {"kind": "iid", "silos": 1},
            "scaling": "federated",
        },
        "algorithm": {"name": "fedadam", "tau": 2.2250738585072014e-308},
    }
    result = cli(
        "simulate", "--policy", str(write(tmp_path, document)), "--out", str(tmp_path / "o")
    )
    assert result.exit_code == 0, result.output
    assert "the final c_index is not finite at silo-0" in " ".join(result.output.split())


def test_a_classifier_that_diverged_is_evaluated_to_an_auroc_that_is_not_finite(
    tmp_path: Path,
) -> None:
    # was: every round failed at every silo's evaluation, "ValueError: Input contains NaN" from
    # scikit-learn's AUROC (FedAdam's server step with tau 2.2e-308, drawn by
    # tests/test_policy_space.py, made the model NaN)
    document = {
        "version": 1,
        "seed": 0,
        "rounds": 1,
        "data": {"source": "heart"},
        "algorithm": {"tau": 2.2250738585072014e-308, "name": "fedadam", "client_fraction": 0.25},
    }
    out = tmp_path / "o"
    result = cli("simulate", "--policy", str(write(tmp_path, document)), "--out", str(out))
    assert result.exit_code == 0, result.output
    final = json.loads((out / "results.json").read_text())["final"]["per_silo"]
    assert all(metrics.get("auroc") is None for metrics in final.values())  # NaN in JSON
