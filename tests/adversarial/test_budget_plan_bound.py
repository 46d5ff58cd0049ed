"""A silo's privacy plan is the most any coordinator can make it spend (silo/budget_plan.py).

The plan walks the silo's own contract; a coordinator that asks for more than an honest job
would (a position the contract lets it name twice in a round) must be refused by the silo,
or the plan a site accepted a job on would not bind. Each attack speaks the real protocol to
unmodified silos.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from fedsilo.policies.algorithms.contract import Position
from fedsilo.wire.messages import SIMULATION
from fedsilo.wire.tasks.tensor_names import MODEL
from tests.adversarial.rewriting import Consortium, policy

TARGET = "silo-0"


def feddc_consortium(periods: dict[str, int]) -> Consortium:
    """FedDC with `periods` (round 1 an aggregation's or a hand-off's), DP-SGD at a fixed
    noise, no secure sum."""
    return Consortium(
        policy(
            "none",
            algorithm={"name": "feddc", **periods},
            participants={"min_silos": 1, "phase_timeout_s": 60},
            privacy={"dp_sgd": {"noise_multiplier": 1.0}},
        )
    )


@pytest.mark.parametrize(
    ("second", "periods"),
    [
        ("aggregate", {"aggregation_period": 1}),
        ("daisy", {"daisy_period": 1, "aggregation_period": 2}),
    ],
)
def test_a_feddc_silo_takes_one_local_step_a_round_whatever_phase_names_a_second(
    second: str, periods: dict[str, int]
) -> None:
    """FedDC gives a silo one local step a round: the plain step, or an aggregation's, or a
    hand-off's. Its contract admits each phase in such a round, so a coordinator could ask
    for the plain step and then an aggregation's in the same round: a second DP-SGD run on the
    same round's budget, beyond the plan the site accepted. The second is refused, and the
    silo's epsilon stays within its plan."""
    c = feddc_consortium(periods)
    model, spec = c.initial_model()
    agent = c.agents[TARGET]
    facts = agent.context.facts
    rules = {rule.name: rule for rule in agent.context.contract.rules}

    def ask(phase: str):
        position = Position(1, phase, TARGET)
        derived = rules[phase].planned_config(position, facts)  # the silo's own derivation
        config = rules[phase].expected(replace(derived, adopt=True), position, facts)
        return c.ask(c.message(TARGET, config, phase=phase, tensors={MODEL: model}, spec=spec))

    assert ask("local").ok
    answer = ask(second)
    assert not answer.ok
    assert f"{SIMULATION}/r1/local-step" in answer.error, answer.error
    trained = [a for a in c.answers if a.message.kind == "daisy_train" and a.result.ok]
    assert len(trained) == 1  # one DP-SGD run this round, as planned
    planned = [t for t in agent.budget_plan().tasks if t.round == 1 and t.kind == "daisy_train"]
    assert len(planned) == 1
