"""An answer under secure aggregation carries what the silo's contract releases, and nothing
beside it.

The answer to a masked input (`secagg_mask`), an encrypted input (`ckks_encrypt`) and a FedDC or
cyclic training (`daisy_train`, whose model leaves sealed to another silo or inside a sum) used
to copy the wrapped training's reports next to its tensors: the training loss (without DP), the
number of steps, DP-SGD's parameters and the sample count; and the engine recorded them, per
silo, in each round's record (results.json). Under a policy of one full-batch step a round,
that loss is the loss, on the silo's own rows, of the model the coordinator chose: two rounds
of chosen models give a directional derivative of the silo's loss, about 2P rounds its exact
gradient (one silo's update), beside a sum that is meant to hide it.

Each test runs the real engine (its secure aggregation, its hand-offs; tests/adversarial/
rewriting.py) against unmodified silos and asserts that those answers hold tensors only, and
that what the engine records of such a round comes from the reports the protocol releases (the
sample count of the advertise or join step), never from a masked or encrypted answer.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner

from fedsilo.coordinator.phases import Phase, PhaseOutcome, WeightedMean
from fedsilo.models.zoo import load_flat
from fedsilo.ops.cli import main
from fedsilo.silo.objectives import RowLoss
from fedsilo.wire.messages import TaskResult
from fedsilo.wire.tasks.tensor_names import MODEL
from tests.adversarial.rewriting import Consortium, policy
from tests.adversarial.test_red_team import feddc_task

METHODS = ["masking", "ckks"]
SECURE_STEP = {"masking": "secagg_mask", "ckks": "ckks_encrypt"}
# one full-batch step a round: the loss reported is the loss of the model sent
FULL_BATCH = {"steps": 1, "batch_size": 4096, "lr": 0.1}
DP_SGD = {"delta": 1e-5, "dp_sgd": {"noise_multiplier": 1.0}}
H = 1e-2  # the step of the coordinator's finite difference
# Model lineage, where the policy has it, refuses a model the coordinator chose before any step
# runs (tests/adversarial/test_model_lineage.py); off here, as a policy of another algorithm
# has it, to show what an answer carries whatever model it trained.
LINEAGE_OFF = {"lineage": False}


def secure(method: str, **overrides: object):
    """`rewriting.policy` under `method`, model lineage off (masking)."""
    section = {"method": method} | (LINEAGE_OFF if method == "masking" else {})
    return policy(method, secure_aggregation=section, **overrides)


def loss_on_rows(c: Consortium, silo: str, model: torch.Tensor) -> float:
    """The loss of `model` on `silo`'s training rows: what the silo must not tell."""
    ctx = c.agents[silo].context
    x, y = ctx.split("train")
    net = load_flat(ctx.new_model(seed=0), model)
    with torch.no_grad():
        return float(RowLoss(ctx.data.task, net, x, y).batch_loss(torch.arange(len(y))))


def secure_round(c: Consortium, engine, model: torch.Tensor, spec, round_no: int) -> PhaseOutcome:
    """FedAvg's round `round_no` from `model`, the coordinator's choice, as the engine runs it."""
    tasks = tuple(c.train_task(s, model, spec, round_no) for s in c.silos)
    return engine.execute(Phase("train", tasks, aggregate=WeightedMean((MODEL,))), round_no)


def answers(c: Consortium, kind: str, round_no: int) -> dict[str, TaskResult]:
    return {
        a.message.silo: a.result
        for a in c.answers
        if a.result.ok and a.message.kind == kind and a.message.round == round_no
    }


def released(c: Consortium, method: str, round_no: int) -> dict[str, int]:
    """Each silo's training count as the protocol released it for round `round_no`'s sum: at
    its join (CKKS), its advertise step, or with keys folded into the last unmask answer."""
    if method == "ckks":
        return {s: a.num_samples for s, a in answers(c, "ckks_join", round_no).items()}
    folded = answers(c, "secagg_unmask", round_no - 1)
    advertised = answers(c, "secagg_advertise", round_no)
    return {s: a.num_samples for s, a in (folded | advertised).items()}


def beside_tensors(result: TaskResult) -> dict[str, object]:
    """What an answer carries beside its tensors that a report could hold."""
    carried: dict[str, object] = dict(result.metrics)
    if result.num_samples:
        carried["num_samples"] = result.num_samples
    if result.spec is not None:
        carried["spec"] = result.spec.numel
    return carried


@pytest.mark.parametrize("method", METHODS)
def test_a_secure_sums_answer_carries_no_loss_of_a_model_the_coordinator_chose(
    method: str,
) -> None:
    """Two rounds of one full-batch step from two models the coordinator chose, m and
    m + h d: the masked (or encrypted) answers carry tensors only, so no loss of either model
    on a silo's rows, whose difference over h would be the silo's directional derivative along
    d; and the round's reports, which the engine records, hold only the count each silo released
    at its advertise (join) step."""
    c = Consortium(secure(method, training=FULL_BATCH))
    model, spec = c.initial_model()
    direction = torch.randn(model.shape, generator=torch.Generator().manual_seed(7))
    chosen = {1: model, 2: model + H * direction.to(model.dtype)}
    engine = c.engine()
    outcomes = {r: secure_round(c, engine, m, spec, r) for r, m in chosen.items()}
    step = SECURE_STEP[method]
    for silo in c.silos:
        leaked = [answers(c, step, r)[silo].metrics.get("train_loss") for r in chosen]
        truth = [loss_on_rows(c, silo, m) for m in chosen.values()]
        assert leaked == [None, None], (
            f"{silo}'s {step} answers carry the loss of each chosen model on its rows: {leaked} "
            f"(its rows give {truth}), so the coordinator reads the silo's directional "
            f"derivative {(leaked[1] - leaked[0]) / H:.6f} (truth {(truth[1] - truth[0]) / H:.6f})"
        )
    for round_no, outcome in outcomes.items():
        counts = released(c, method, round_no)
        for silo, answer in answers(c, step, round_no).items():
            assert beside_tensors(answer) == {}, f"{silo}'s {step} answer carries {answer}"
        for silo, report in outcome.reports.items():
            assert report.metrics == {}, f"the engine records {report.metrics} of {silo}"
            assert report.num_samples == counts[silo] > 0
            assert report.num_samples == len(c.datasets[silo].y_train)  # exact: no DP


@pytest.mark.parametrize("method", METHODS)
def test_under_dp_sgd_a_secure_sums_answer_carries_no_training_parameters(method: str) -> None:
    """DP-SGD's sample rate, steps and noise multiplier (public under DP-SGD, docs/privacy.md)
    reach the coordinator nowhere beside a masked or encrypted input: the answer holds tensors
    only, and the round's reports hold only the noised count the advertise (join) step
    released."""
    c = Consortium(secure(method, privacy=DP_SGD))
    model, spec = c.initial_model()
    outcome = secure_round(c, c.engine(), model, spec, 1)
    step = SECURE_STEP[method]
    sent = answers(c, step, 1)
    assert sorted(sent) == c.silos
    for silo, answer in sent.items():
        assert beside_tensors(answer) == {}, f"{silo}'s {step} answer carries {answer.metrics}"
    counts = released(c, method, 1)
    for silo, report in outcome.reports.items():
        assert report.metrics == {} and report.num_samples == counts[silo]


def test_a_daisy_train_answer_carries_no_clear_metric() -> None:
    """FedDC's daisy round through the engine's sealed hand-offs: each silo's `daisy_train`
    answer holds its sealed hand-off and nothing beside it (no training loss of the model it
    hosts, no steps, no count), and the phase's reports are empty."""
    c = Consortium(
        policy(
            "none",
            algorithm={"name": "feddc", "daisy_period": 1, "aggregation_period": None},
            training=FULL_BATCH,
            channel={"sealed_handoffs": True},
        )
    )
    model, spec = c.initial_model()
    tasks = tuple(feddc_task(c, s, 1, model, spec, adopt=model) for s in c.silos)
    route = dict(zip(c.silos, c.silos[1:] + c.silos[:1], strict=True))
    outcome = c.engine().execute(Phase("daisy", tasks, route=route), 1)
    assert dict(outcome.routes) == route
    trained = answers(c, "daisy_train", 1)
    assert sorted(trained) == c.silos
    for silo, answer in trained.items():
        leaked = beside_tensors(answer)
        assert leaked == {}, (
            f"{silo}'s daisy_train answer carries {leaked} beside its sealed hand-off (the loss "
            f"of the model it adopted on its rows: {loss_on_rows(c, silo, model)})"
        )
        assert set(answer.tensors) == {"handoff"}
    for silo, report in outcome.reports.items():
        assert report.metrics == {} and report.num_samples == 0, (silo, report)


def test_simulate_under_masking_writes_no_per_silo_training_loss(tmp_path: Path) -> None:
    """`fedsilo simulate` of a masking policy: each round's record in results.json names, per
    silo, only the count it released at the advertise step (its training rows, exact without
    DP): no training loss, no steps."""
    document = {
        "version": 1,
        "seed": 5,
        "rounds": 2,
        "algorithm": {"name": "fedavg"},
        "model": {"name": "linear"},
        "training": FULL_BATCH,
        "participants": {"min_silos": 2, "phase_timeout_s": 60},
        "data": {"source": "sklearn:breast_cancer", "partition": {"kind": "iid", "silos": 3}},
        "secure_aggregation": {"method": "masking"},
    }
    path = tmp_path / "masked.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    out = tmp_path / "out"
    ran = CliRunner().invoke(main, ["simulate", "--policy", str(path), "--out", str(out)])
    assert ran.exit_code == 0, ran.output
    results = json.loads((out / "results.json").read_text())
    rows = {silo["name"]: silo["train"] for silo in results["silos"]}
    trained = [r for r in results["history"] if "train" in r.get("phases", {})]
    assert len(trained) == 2
    for record in trained:
        answered = record["phases"]["train"]["answered"]
        assert sorted(answered) == sorted(rows)
        for silo, reported in answered.items():
            assert reported == {"num_samples": rows[silo]}, (
                f"round {record['round']}: results.json records {reported} of {silo}, beside a "
                "masked sum"
            )
