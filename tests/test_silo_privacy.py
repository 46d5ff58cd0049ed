"""Privacy at the silo: every answer is booked in the silo's ledger before it leaves, the budget
is enforced before a task runs, a silo out of budget is retired (not crashed) while the
deployment goes on, scalar reports are clipped and noised, and forbidden reports never leave."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from nacl.signing import SigningKey

from fedsilo.coordinator.engine import RoundEngine
from fedsilo.coordinator.strategies import make_strategy
from fedsilo.coordinator.transport import InProcessTransport
from fedsilo.ops.metrics import CoordinatorMetrics
from fedsilo.policies.loading import PolicyError, parse_policy
from fedsilo.policies.privacy import PrivacyConfig
from fedsilo.policies.schema import Policy
from fedsilo.privacy.accounting import Mechanism, epsilon
from fedsilo.privacy.ledger import GENESIS, PrivacyLedger, payload_digest, verify
from fedsilo.privacy.receipts import Receipt
from fedsilo.silo.agent import SiloAgent
from fedsilo.silo.config import LocalRules
from fedsilo.silo.reports import Reports
from fedsilo.silo.tasks import TASK_KINDS
from fedsilo.silo.tasks.base import SiloKeys
from fedsilo.wire.messages import STATUS_BUDGET_EXHAUSTED, TaskResult, task_id
from fedsilo.wire.payload import Payload
from fedsilo.wire.tasks import FeatureMoments, LossProbe
from tests.silos import agent as built
from tests.silos import honest, policy_with, run_handler
from tests.test_dp_training import LINEAR
from tests.test_tasks import separable

pytestmark = [
    pytest.mark.filterwarnings("ignore:Full backward hook is firing"),
]

DP = {"delta": 1e-5, "dp_sgd": {"noise_multiplier": 1.0}}
# Each round: 5 epochs of SGD at 0.5 in batches of 16 (13 steps an epoch over 200 rows).
TRAINING = {"epochs": 5, "batch_size": 16, "lr": 0.5}


def privacy(**section: object) -> PrivacyConfig:
    return PrivacyConfig.model_validate({**DP, **section})


def silo(
    tmp_path,
    name: str = "a",
    cap: float | None = None,
    policy: Policy | None = None,
    **section: object,
) -> SiloAgent:
    """Silo `name` of deployment "d", booking in its ledger in `tmp_path`: under `policy`, or
    ten rounds of `TRAINING` of a linear model with DP-SGD (the privacy `section` added). It
    has no identity, so its answers carry no receipt (the last test signs them)."""
    policy = policy or policy_with(
        rounds=10, model=LINEAR, training=TRAINING, privacy=privacy(**section)
    )
    return built(
        separable(),
        policy,
        name,
        secret=name.encode(),
        ledger=PrivacyLedger(tmp_path / f"{name}.jsonl"),
        deployment="d",
        epsilon_cap=cap,
        keys=SiloKeys(),
    )


def answer(
    agent: SiloAgent, phase: str, round_no: int, model: TaskResult | None = None
) -> tuple[TaskResult, Payload]:
    """The agent's result and encoded answer to the task its contract asks for at
    (`round_no`, `phase`), carrying `model`."""
    tensors, spec = (model.tensors, model.spec) if model else (None, None)
    return agent.respond(honest(agent, phase, round_no, tensors, spec))


def test_every_answer_is_booked_with_the_digest_of_the_bytes_that_leave(tmp_path) -> None:
    agent = silo(tmp_path)
    init, init_bytes = answer(agent, "init", 0)
    trained, trained_bytes = answer(agent, "train", 1, init)
    evaluated, evaluated_bytes = answer(agent, "evaluate", 1, trained)
    records = agent.ledger.records()
    assert [r.mechanism.kind for r in records] == ["public", "dp_sgd", "gaussian", "gaussian"]
    assert [r.payload_digest for r in records] == [
        payload_digest(init_bytes),
        payload_digest(trained_bytes),
        payload_digest(trained_bytes),  # the model and its noisy count leave together
        payload_digest(evaluated_bytes),
    ]
    sent = TaskResult.decode(trained_bytes)
    assert sent.tensors["model"].equal(trained.tensors["model"])
    assert (sent.epsilon, sent.ledger_head) == (trained.epsilon, trained.ledger_head)
    # An answer carries the epsilon its release brings the deployment to, and the ledger head
    # before its booking: the anchor an audit checks the ledger still holds.
    assert init.epsilon == 0.0 and init.ledger_head == GENESIS
    assert trained.epsilon == records[2].epsilon_cumulative
    assert evaluated.epsilon == records[3].epsilon_cumulative == agent.ledger.spent("d")
    assert evaluated.ledger_head == records[2].hash
    assert verify(agent.ledger.path, anchor=evaluated.ledger_head).ok


def test_a_task_that_would_exceed_the_cap_is_refused_before_it_runs(tmp_path) -> None:
    init, _ = answer(silo(tmp_path), "init", 0)
    capped = silo(tmp_path, "capped", cap=0.5)
    result, _ = answer(capped, "train", 1, init)
    assert result.status == STATUS_BUDGET_EXHAUSTED
    assert "above the cap 0.5" in result.error and result.epsilon == 0.0
    assert [r.mechanism.kind for r in capped.ledger.records()] == ["public"]  # only the refusal
    assert capped.ledger.spent("d") == 0.0


def test_the_stricter_of_the_policys_and_the_silos_cap_holds(tmp_path) -> None:
    assert silo(tmp_path, "a", cap=3.0, epsilon_cap=5.0).epsilon_cap == 3.0
    assert silo(tmp_path, "b", cap=9.0, epsilon_cap=5.0).epsilon_cap == 5.0
    assert silo(tmp_path, "c").epsilon_cap is None


def deployment(tmp_path, caps: dict[str, float | None], rounds: int = 4):
    policy = parse_policy(
        {
            "version": 1,
            "rounds": rounds,
            "model": {"name": "linear"},
            "training": {"epochs": 1, "batch_size": 16, "lr": 0.1},
            "participants": {"min_silos": 1, "phase_timeout_s": 60},
            "privacy": DP,
        }
    )
    agents = {name: silo(tmp_path, name, cap, policy) for name, cap in caps.items()}
    metrics = CoordinatorMetrics(deployment="d")
    engine = RoundEngine(
        make_strategy(policy),
        InProcessTransport({n: a.handle_bytes for n, a in agents.items()}),
        policy,
        sorted(agents),
        observers=[metrics],
        deployment="d",
    )
    return engine.run(), agents, metrics


def test_a_silo_out_of_budget_is_retired_and_the_deployment_goes_on(tmp_path) -> None:
    one_epoch = Mechanism.dp_sgd(noise_multiplier=1.0, sample_rate=0.08, steps=13, max_grad_norm=1)
    one_round = epsilon([one_epoch], 1e-5)
    history, agents, metrics = deployment(tmp_path, {"rich": None, "poor": 1.5 * one_round})
    retired_in = [r for r in history.records if r.retired]
    assert len(retired_in) == 1 and "poor" in retired_in[0].retired
    assert STATUS_BUDGET_EXHAUSTED in retired_in[0].retired["poor"]
    later = [r for r in history.records if r.round > retired_in[0].round]
    assert later and all("poor" not in r.phases["train"]["answered"] for r in later)
    assert all("poor" not in r.phases["train"]["dropped"] for r in later)  # not asked again
    assert history.records[-1].status == "completed"
    assert agents["poor"].ledger.spent("d") <= 1.5 * one_round
    # The coordinator's view: the silo is retired, and each silo's epsilon is exported.
    sample = metrics.registry.get_sample_value
    assert sample("fedsilo_silo_status", {"silo": "poor", "status": "retired"}) == 1
    spent_rich = agents["rich"].ledger.spent("d")
    assert sample("fedsilo_privacy_epsilon", {"silo": "rich", "deployment": "d"}) == spent_rich
    last = history.records[-1].privacy["rich"]
    assert verify(agents["rich"].ledger.path, anchor=last["ledger_head"]).ok


def test_a_deployment_without_dp_books_every_answer_without_epsilon(tmp_path) -> None:
    plain = policy_with(rounds=10, model=LINEAR, training=TRAINING)
    agent = silo(tmp_path, policy=plain)
    init, _ = answer(agent, "init", 0)
    trained, _ = answer(agent, "train", 1, init)
    assert trained.ok and trained.epsilon is None
    assert [r.mechanism.kind for r in agent.ledger.records()] == ["public", "none"]
    assert agent.ledger.spent("d") is None


# -- noisy reports ------------------------------------------------------------------------------


def test_a_noisy_mean_loss_is_clipped_to_its_bound_and_has_the_stated_noise() -> None:
    config = privacy(reports={"noise_multiplier": 2.0, "loss_bound": 5.0})
    reports = Reports(config, torch.Generator().manual_seed(0))
    n, draws = 50, 4000
    huge = torch.full((n,), 1e6)  # every row's loss far above the bound
    values = torch.tensor([reports.mean_loss(huge) for _ in range(draws)], dtype=torch.float64)
    std = 2.0 * 5.0 / n  # noise multiplier x sensitivity (bound / n)
    assert abs(values.mean().item() - 5.0) < 4 * std / math.sqrt(draws)
    assert values.std().item() == pytest.approx(std, rel=0.05)


def test_a_noisy_count_and_accuracy_have_sensitivities_one_and_one_over_n() -> None:
    reports = Reports(privacy(reports={"noise_multiplier": 3.0}), torch.Generator().manual_seed(1))
    counts = torch.tensor([float(reports.count(1000)) for _ in range(4000)])
    assert counts.std().item() == pytest.approx(3.0, rel=0.05)
    correct = torch.arange(100) < 70
    accuracy = torch.tensor([reports.accuracy(correct) for _ in range(4000)])
    assert accuracy.mean().item() == pytest.approx(0.7, abs=0.01)
    assert accuracy.std().item() == pytest.approx(3.0 / 100, rel=0.05)


def test_under_dp_evaluation_reports_only_bounded_metrics(tmp_path) -> None:
    agent = silo(tmp_path)
    init, _ = answer(agent, "init", 0)
    evaluated, _ = answer(agent, "evaluate", 1, init)
    assert sorted(evaluated.metrics) == ["accuracy", "loss"]  # AUROC has no bounded sensitivity
    plain = built(separable(), policy_with(model=LINEAR))
    assert sorted(answer(plain, "evaluate", 1, init)[0].metrics) == ["accuracy", "auroc", "loss"]


def test_a_forbidden_report_kind_never_leaves(tmp_path) -> None:
    agent = silo(tmp_path, reports={"forbidden": ["losses"]})
    init, _ = answer(agent, "init", 0)
    assert "loss" not in answer(agent, "evaluate", 1, init)[0].metrics
    # No algorithm that asks for loss reports runs under a policy that forbids them (below), so
    # the silo's contract has no phase that probes a loss; were one sent, the handler refuses.
    evaluate = honest(agent, "evaluate", 1, init.tensors, init.spec)
    probe = replace(evaluate, task_id=task_id("d", 1, "loss", None, "a"), phase="loss")
    refused = agent.handle(replace(probe, config=LossProbe()))
    assert not refused.ok and "phase 'loss' is not one of fedavg's phases" in refused.error
    with pytest.raises(ValueError, match="forbids loss reports"):
        run_handler(agent, LossProbe(), init.tensors, init.spec)


def test_forbidding_a_report_the_algorithm_needs_is_refused_when_the_policy_is_read() -> None:
    with pytest.raises(PolicyError, match=r"privacy.reports.forbidden: fedavg cannot run without"):
        parse_policy({"version": 1, "privacy": {"reports": {"forbidden": ["counts"]}}})
    parse_policy({"version": 1, "privacy": {"reports": {"forbidden": ["losses"]}}})


def test_exact_feature_moments_are_refused_in_a_dp_deployment(tmp_path) -> None:
    with pytest.raises(PolicyError, match="data.scaling: 'federated' sends each silo's exact"):
        parse_policy({"version": 1, "data": {"scaling": "federated"}, "privacy": DP})
    # So a DP silo's contract has no phase for them (federated scaling's "moments" in round 0);
    # were one sent, what the silo books for it is refused too.
    agent = silo(tmp_path)
    init = honest(agent, "init", 0)
    moments = replace(
        init,
        task_id=task_id("d", 0, "moments", None, "a"),
        phase="moments",
        config=FeatureMoments(),
    )
    refused, _ = agent.respond(moments)
    assert not refused.ok and "phase 'moments' is not one of fedavg's phases" in refused.error
    with pytest.raises(ValueError, match="not released in a DP deployment"):
        TASK_KINDS["feature_moments"].releases(moments, agent.context)


# -- the site's own rules -------------------------------------------------------------------------


def test_site_rules_on_privacy_name_the_rule_a_policy_breaks() -> None:
    plain = parse_policy({"version": 1})
    private = parse_policy({"version": 1, "privacy": DP})
    assert LocalRules(require_dp=True).violations(plain) == [
        "require_dp: the policy trains without DP (no privacy.dp_sgd)"
    ]
    assert LocalRules(require_dp=True, epsilon_cap=4.0).violations(private) == []
    assert LocalRules(epsilon_cap=4.0).violations(plain)[0].startswith("epsilon_cap:")
    (problem,) = LocalRules(allowed_reports=["counts", "metrics"]).violations(private)
    assert problem.startswith("allowed_reports: the policy lets ['losses'] reports leave")
    muted = parse_policy({"version": 1, "privacy": {**DP, "reports": {"forbidden": ["losses"]}}})
    assert LocalRules(allowed_reports=["counts", "metrics"]).violations(muted) == []


def test_a_splits_count_is_released_once_and_repeated_for_free(tmp_path) -> None:
    agent = silo(tmp_path)
    init, _ = answer(agent, "init", 0)
    first, _ = answer(agent, "train", 1, init)
    second, _ = answer(agent, "train", 2, init)
    assert first.num_samples == second.num_samples  # the same noisy value, not a new draw
    kinds = [r.mechanism.kind for r in agent.ledger.records()]
    assert kinds == ["public", "dp_sgd", "gaussian", "dp_sgd"]


def test_every_answer_carries_a_signed_receipt_of_its_own_booking(tmp_path) -> None:
    identity = SigningKey(b"\x05" * 32)
    agent = built(
        separable(),
        policy_with(rounds=10, model=LINEAR, training=TRAINING, privacy=privacy()),
        ledger=PrivacyLedger(tmp_path / "a.jsonl"),
        deployment="d",
        keys=SiloKeys(identity=identity, roster={"a": identity.verify_key}),
    )
    init, _ = answer(agent, "init", 0)
    trained, sent = answer(agent, "train", 1, init)
    receipt = Receipt.from_json(TaskResult.decode(sent).receipt)
    last = agent.ledger.records()[-1]  # the answer's last record: the head AFTER its booking
    body = replace(TaskResult.decode(sent), receipt=None).encode()
    assert (receipt.seq, receipt.ledger_head, receipt.epsilon) == (
        last.seq,
        last.hash,
        last.epsilon_cumulative,
    )
    assert receipt.payload_digest == last.payload_digest == payload_digest(body)
    assert trained.ok and (receipt.task_id, receipt.silo) == ("d/r1/train/a", "a")
    assert receipt.signed_by(identity.verify_key)
    assert not replace(receipt, epsilon=receipt.epsilon / 2).signed_by(identity.verify_key)
