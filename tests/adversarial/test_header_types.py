"""A task header's integers are JSON integers: a deviating coordinator's `"1"`, `1.7`, `true` or
`6.0` is refused when the task is read, naming the field, never read as the integer it looks
like (Python's `int()` would take each). Drawn by Hypothesis over the header's integer fields
(the round, the protocol version, the parameter spec's dimensions), sent to an unmodified silo
agent as a coordinator sends a task (`SiloAgent.handle_bytes`)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedsilo.silo.agent import SiloAgent
from fedsilo.wire.messages import PROTOCOL_VERSION, TaskMessage, TaskResult
from fedsilo.wire.tensors import WireError, decode_tensors, encode_tensors
from tests.adversarial.helpers import SiloSite, initial_model, task

pytestmark = [
    pytest.mark.filterwarnings("ignore:Full backward hook is firing"),
]

NOT_INTEGERS = st.one_of(
    st.text(max_size=4),
    st.integers(0, 99).map(str),  # "1": the round it spells
    st.floats(allow_nan=False, allow_infinity=False),
    st.integers(0, 99).map(float),  # 1.0
    st.booleans(),
    st.none(),
    st.lists(st.integers(0, 9), max_size=2),
    st.dictionaries(st.text(max_size=2), st.integers(0, 9), max_size=1),
)


@pytest.fixture(scope="module")
def silo(tmp_path_factory: pytest.TempPathFactory) -> tuple[SiloAgent, TaskMessage]:
    """A deployed silo (ledger, state folder) and its honest round-1 train task."""
    agent = SiloSite(tmp_path_factory.mktemp("silo")).agent()
    model = initial_model(agent)
    return agent, task(agent, "train", model, round=1)


def rewritten(message: TaskMessage, field: str, value: Any) -> bytes:
    """`message` encoded with its header's `field` set to `value` (`spec`: the first dimension
    of the parameter spec's first tensor)."""
    tensors, header = decode_tensors(message.encode())
    if field == "spec":
        header["spec"]["entries"][0][1][0] = value
    else:
        header[field] = value
    return encode_tensors(tensors, header)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(field=st.sampled_from(["round", "protocol", "spec"]), value=NOT_INTEGERS)
def test_a_task_header_integer_that_is_no_json_integer_is_refused_naming_it(
    silo: tuple[SiloAgent, TaskMessage], field: str, value: Any
) -> None:
    agent, message = silo
    payload = rewritten(message, field, value)
    with pytest.raises(WireError, match=field):
        TaskMessage.decode(payload)
    reply = TaskResult.decode(agent.handle_bytes(payload))
    assert not reply.ok and field in (reply.error or ""), reply.error
    assert not reply.tensors


@settings(max_examples=30, deadline=None)
@given(round_no=st.integers(max_value=-1))
def test_a_negative_round_is_refused_naming_it(
    silo: tuple[SiloAgent, TaskMessage], round_no: int
) -> None:
    with pytest.raises(WireError, match="round"):
        TaskMessage.decode(rewritten(silo[1], "round", round_no))


@settings(max_examples=30, deadline=None)
@given(round_no=st.integers(0, 2**63))
def test_a_json_integer_round_reads_as_itself(
    silo: tuple[SiloAgent, TaskMessage], round_no: int
) -> None:
    message = silo[1]
    assert TaskMessage.decode(rewritten(message, "round", round_no)).round == round_no
    assert TaskMessage.decode(message.encode()).header == message.header
    assert rewritten(message, "protocol", PROTOCOL_VERSION) == message.encode()
