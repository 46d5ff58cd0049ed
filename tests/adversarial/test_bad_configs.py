"""A deviating coordinator can send any JSON as a task's config: keys no handler reads (a
`weight` beside the `weights`, say), values of another type, kinds that do not exist, and
keys that decode but differ from what the silo's own policy sets. The silo refuses every such
task unrun, naming the key (or the kind), and books the refusal as a public release like every
refusal, so its ledger still accounts for every task id it answered."""

from __future__ import annotations

import pytest

from fedsilo.privacy.accounting import Mechanism
from fedsilo.wire.messages import STATUS_ERROR, TaskResult
from tests.adversarial.helpers import DEPLOYMENT, SiloSite, initial_model, task
from tests.wire_tasks import reworded

pytestmark = [
    pytest.mark.filterwarnings("ignore:Full backward hook is firing"),
]


@pytest.mark.parametrize(
    ("changed", "kind", "why"),
    [
        ({"weight": 0.5}, None, "train task: unknown config key(s) ['weight']"),
        ({"lr": "0.1"}, None, "train task: config key 'lr' must be float, not str"),
        ({"checkpoint_step": 2.5}, None, "config key 'checkpoint_step' must be int"),
        (None, "transmogrify", "unknown task kind 'transmogrify'"),
        # well-typed, but not what the silo's policy says (silo/contract_gate.py)
        ({"lr": 0.1}, None, "config key 'lr' is 0.1; this silo's policy says 0.5"),
        ({"checkpoint_step": 2}, None, "config key 'checkpoint_step' is set; this silo's policy"),
    ],
    ids=[
        "unknown key",
        "mistyped value",
        "fractional step",
        "unknown kind",
        "another value",
        "a key the policy sets none of",
    ],
)
def test_a_task_whose_config_is_not_its_kinds_is_refused_and_booked_as_public(
    tmp_path, changed: dict | None, kind: str | None, why: str
) -> None:
    agent = SiloSite(tmp_path).agent()
    model = initial_model(agent)
    message = task(agent, "train", model)  # the task round 1 asks for, then reworded
    config = {"seed": 0} if changed is None else message.config.to_json() | changed
    booked = len(agent.ledger.records())
    reply = TaskResult.decode(agent.handle_bytes(reworded(message, config, kind)))
    assert reply.status == STATUS_ERROR and why in (reply.error or "")
    assert message.task_id == f"{DEPLOYMENT}/r1/train/a"
    assert reply.task_id == message.task_id and not reply.tensors and reply.receipt is not None
    (record,) = agent.ledger.records()[booked:]
    assert (record.task_id, record.mechanism) == (message.task_id, Mechanism.public())
