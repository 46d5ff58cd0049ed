"""A deviating coordinator can send any JSON as a task's config: keys no handler reads (a
`weight` beside the `weights`, say), values of another type, kinds that do not exist. The
silo refuses every such task unrun, naming the kind and the key, and books the refusal as a
public release like every refusal, so its ledger still accounts for every task id it
answered."""

from __future__ import annotations

import pytest

from fedsilo.privacy.accounting import Mechanism
from fedsilo.wire.messages import STATUS_ERROR, TaskResult
from tests.adversarial.helpers import SiloSite, initial_model, task, train_config
from tests.wire_tasks import reworded

pytestmark = [
    pytest.mark.filterwarnings("ignore:Full backward hook is firing"),
]

TRAIN = train_config(epochs=2).to_json()


@pytest.mark.parametrize(
    ("config", "kind", "why"),
    [
        (TRAIN | {"weight": 0.5}, None, "train task: unknown config key(s) ['weight']"),
        (TRAIN | {"lr": "0.1"}, None, "train task: config key 'lr' must be float, not str"),
        (TRAIN | {"checkpoint_step": 2.5}, None, "config key 'checkpoint_step' must be int"),
        ({"seed": 0}, "transmogrify", "unknown task kind 'transmogrify'"),
    ],
    ids=["unknown key", "mistyped value", "fractional step", "unknown kind"],
)
def test_a_task_whose_config_is_not_its_kinds_is_refused_and_booked_as_public(
    tmp_path, config: dict, kind: str | None, why: str
) -> None:
    agent = SiloSite(tmp_path).agent()
    model = initial_model(agent)
    message = task(agent, train_config(epochs=2), model, task_id="r1/train/a")
    booked = len(agent.ledger.records())
    reply = TaskResult.decode(agent.handle_bytes(reworded(message, config, kind)))
    assert reply.status == STATUS_ERROR and why in (reply.error or "")
    assert reply.task_id == "r1/train/a" and not reply.tensors and reply.receipt is not None
    (record,) = agent.ledger.records()[booked:]
    assert (record.task_id, record.mechanism) == ("r1/train/a", Mechanism.public())
