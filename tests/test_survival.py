"""The built-in survival task (`task: survival`): FLamby's Cox loss, the concordance index by
lifelines, c_index read as higher-is-better, training on TCGA-BRCA, and DP-SGD refused (the Cox
loss has no per-row decomposition)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from lifelines.utils import concordance_index as lifelines_c_index

from fedsilo.coordinator.summary import summarize_metrics
from fedsilo.ops.simulate import load_silos, simulate
from fedsilo.policies.loading import PolicyError, load_policy
from fedsilo.policies.schema import Policy
from fedsilo.silo.data.plugins import task_plugin
from fedsilo.silo.data.survival import SurvivalTask, concordance_index, cox_loss
from fedsilo.silo.evaluation import HIGHER_IS_BETTER, loss_function, per_sample_loss_function

EXAMPLE = Path(__file__).resolve().parents[1] / "policies" / "examples"
TCGA = EXAMPLE / "flamby-tcga-brca-fedavg.yaml"


def targets(times: list[float], events: list[float]) -> torch.Tensor:
    return torch.tensor([times, events]).T  # y: (time, event) per row


def test_the_cox_loss_is_flambys_by_hand() -> None:
    scores = torch.tensor([0.5, -1.0, 2.0])
    y = targets([5.0, 3.0, 8.0], [1.0, 0.0, 1.0])
    # latest first: t=8 (s 2.0, event), t=5 (s 0.5, event), t=3 (s -1.0, censored)
    # terms: 0; log(e^2 + e^0.5) - 0.5; censored row: 0; mean over the 3 rows
    by_hand = (math.log(math.exp(2.0) + math.exp(0.5)) - 0.5) / 3
    assert SurvivalTask().loss(scores[:, None], y).item() == pytest.approx(by_hand)
    assert loss_function("survival")(scores[:, None], y).item() == pytest.approx(by_hand)


def test_tied_times_keep_their_batch_order_as_in_flamby() -> None:
    """FLamby sorts with Python's stable sort: of two rows dying the same day, only the later
    one in the batch has the other in its risk set."""
    y = targets([4.0, 4.0], [1.0, 1.0])
    first_low = cox_loss(torch.tensor([1.0, 2.0]), y[:, 0], y[:, 1])
    first_high = cox_loss(torch.tensor([2.0, 1.0]), y[:, 0], y[:, 1])
    assert first_low.item() == pytest.approx((math.log(math.exp(1.0) + math.exp(2.0)) - 2.0) / 2)
    assert first_high.item() == pytest.approx((math.log(math.exp(1.0) + math.exp(2.0)) - 1.0) / 2)


def test_the_cox_loss_is_differentiable_and_large_scores_stay_finite() -> None:
    scores = torch.tensor([300.0, -200.0, 50.0], requires_grad=True)
    loss = cox_loss(scores, torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 1.0, 1.0]))
    loss.backward()
    assert torch.isfinite(loss) and scores.grad is not None and torch.isfinite(scores.grad).all()


def test_the_c_index_is_lifelines_with_a_higher_score_an_earlier_death() -> None:
    times, events = [1.0, 2.0, 3.0, 4.0], [1.0, 1.0, 0.0, 1.0]
    scores = torch.tensor([4.0, 1.0, 3.0, 2.0])
    # comparable pairs (the earlier time an event): (1,2) (1,3) (1,4) (2,3) (2,4);
    # concordant when the earlier death scores higher: the first three
    c_index = concordance_index(scores, torch.tensor(times), torch.tensor(events))
    assert c_index == pytest.approx(3 / 5)
    assert c_index == lifelines_c_index(times, (-scores).tolist(), events)
    metrics = task_plugin("survival").metrics(scores[:, None], targets(times, events))
    assert metrics == {"c_index": c_index}


def test_the_c_index_without_a_comparable_pair_is_nan() -> None:
    no_events = concordance_index(
        torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0]), torch.zeros(2)
    )
    assert math.isnan(no_events)


def test_c_index_is_summarised_higher_is_better() -> None:
    assert HIGHER_IS_BETTER["c_index"] and SurvivalTask.higher_is_better["c_index"]
    summary = summarize_metrics(
        {"a": {"c_index": 0.6}, "b": {"c_index": 0.8}}, {"a": 10, "b": 10}, {}
    )
    assert summary["c_index"].worst == 0.6


def test_survival_has_no_per_row_loss() -> None:
    with pytest.raises(ValueError, match="Cox partial-likelihood loss has no per-row loss"):
        per_sample_loss_function("survival")


def test_dp_sgd_is_refused_for_survival_naming_why_before_round_1() -> None:
    policy = load_policy(TCGA)
    document = {
        **policy.model_dump(),
        "rounds": 1,
        "training": {**policy.training.model_dump(), "steps": 2},
        "privacy": {"delta": 1e-5, "dp_sgd": {"noise_multiplier": 1.0}},
    }
    private = Policy.model_validate(document)
    with pytest.raises(PolicyError, match="privacy.dp_sgd: DP-SGD clips each row's gradient") as e:
        simulate(private, load_silos(private, EXAMPLE))
    assert "each row's term depends on its risk set" in str(e.value)


def test_fedavg_on_tcga_brca_ranks_patients_better_than_chance() -> None:
    policy = load_policy(TCGA)
    short = Policy.model_validate({**policy.model_dump(), "rounds": 2})
    result = simulate(short, load_silos(short, EXAMPLE))
    summary = result.history.final.summary
    assert summary is not None
    assert summary["c_index"]["mean"] > 0.6  # a random score ranks at 0.5
