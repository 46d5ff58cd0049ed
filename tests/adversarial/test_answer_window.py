"""A deviating coordinator tries to empty a silo's answer store with one refused task.

A silo keeps its answers of the last rounds (silo/answers.py, `KEEP_ROUNDS` before the newest)
so that a task sent again (a retry, a restarted coordinator) gets the same bytes; older answers
are emptied, and a task whose answer is gone is refused. A task for a round far beyond the
policy is refused by the silo's contract, and the refusal is kept like every answer; if its
round counted as the newest, every answer kept afterwards would be emptied at once, and each
honest retry refused. The silo here is a deployed one: a DP policy of `ROUNDS` rounds, a
ledger and a state folder (tests/adversarial/helpers.py).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from fedsilo.silo.agent import SiloAgent
from fedsilo.wire.messages import task_id
from fedsilo.wire.tasks.tensor_names import MODEL
from tests.adversarial.helpers import ROUNDS, SiloSite, initial_model, task, train

pytestmark = [
    pytest.mark.filterwarnings("ignore:Full backward hook is firing"),
]

FAR = 10**6


def refused_far_ahead(agent: SiloAgent, round_no: int) -> None:
    """The round-1 train task, sent as round `round_no` under that position's id."""
    honest = task(agent, "train", round=1)
    ctx = agent.context
    far = replace(
        honest, round=round_no, task_id=task_id(ctx.deployment, round_no, "train", None, ctx.name)
    )
    refusal = agent.respond(far)[0]
    assert not refusal.ok and "outside this silo's policy" in (refusal.error or "")


@pytest.mark.parametrize("round_no", [FAR, ROUNDS], ids=["far beyond", "the last round"])
def test_a_refused_task_of_a_later_round_empties_no_answer(tmp_path, round_no: int) -> None:
    """A refusal moves the store's newest round no further than the answers of the policy's
    positions have: after it, an honest task answered and then sent again (by a coordinator
    retrying, or restarted) gets the same bytes, also from a silo restarted on its files."""
    site = SiloSite(tmp_path)
    agent = site.agent()
    model = initial_model(agent)
    if round_no == ROUNDS:  # the last round's position, but an invented phase: refused
        ctx = agent.context
        honest = task(agent, "train", model, round=1)
        invented = replace(honest, round=round_no, phase="train-again",
                           task_id=task_id(ctx.deployment, round_no, "train-again", None,
                                           ctx.name))  # fmt: skip
        refusal = agent.respond(invented)[0]
        assert not refusal.ok and "is not one of" in (refusal.error or "")
    else:
        refused_far_ahead(agent, round_no)
    result, first = train(agent, model)
    assert result.ok and MODEL in result.tensors
    _, again = train(agent, model)
    assert again == first, "the honest answer was emptied by the refusal's round"
    _, after_restart = train(site.agent(), model)
    assert after_restart == first, "a restarted silo lost the honest answer"
