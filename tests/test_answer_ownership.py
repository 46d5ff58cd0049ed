"""A silo's answer leaves as its parts, the answer's tensors in their own memory, unjoined
(`SiloAgent.handle_bytes`): an in-process engine reads those tensors where the silo left them.
So an answer's tensors belong to the answer alone: never memory the silo keeps and writes again
(a local model, a control variate, a checkpoint, a hosted model, a kept answer).

Each run below keeps every answer the engine received and compares its bytes at the end of the
run with the bytes it had when it arrived; an answer whose memory a later task wrote differs.
The policies cover every kind of task the algorithms send, DP answers (kept for replays) and
masked, sealed and hand-off answers.
"""

from __future__ import annotations

import pytest
import torch
import yaml

from fedsilo.coordinator.engine import RoundEngine
from fedsilo.coordinator.strategies import make_strategy
from fedsilo.coordinator.transport import InProcessTransport
from fedsilo.ops.sim_silos import ConsortiumKeys, build_agent
from fedsilo.ops.simulate import load_silos
from fedsilo.policies.loading import example_file, parse_policy
from fedsilo.wire.messages import SiloEndpoint
from fedsilo.wire.payload import AnyPayload, as_payload

EXAMPLES = [
    "heart-fedavg",
    "heart-scaffold",
    "heart-superfed",
    "heart-feddc",
    "heart-drfa",
    "heart-aaggff",
    "heart-multiboost",
    "heart-cyclic",
    "fedavg_dp",
]


@pytest.mark.parametrize("example", EXAMPLES)
def test_no_answer_changes_after_the_silo_sent_it(example: str) -> None:
    policy = parse_policy({**yaml.safe_load(example_file(example).read_text()), "rounds": 3})
    datasets = load_silos(policy, None)
    keys = ConsortiumKeys.generate(d.name for d in datasets)
    sent: list[tuple[AnyPayload, bytes]] = []

    def keeping(endpoint: SiloEndpoint) -> SiloEndpoint:
        def answer(task: bytes | AnyPayload) -> AnyPayload:
            out = as_payload(endpoint(task))
            sent.append((out, out.to_bytes()))
            return out

        return answer

    endpoints = {
        d.name: keeping(build_agent(policy, d.name, d, torch.device("cpu"), keys).handle_bytes)
        for d in datasets
    }
    names = [d.name for d in datasets]
    handoff_keys = {name: bytes(key) for name, key in keys.sealing_roster.items()}
    transport = InProcessTransport(endpoints)
    RoundEngine(make_strategy(policy), transport, policy, names, handoff_keys=handoff_keys).run()

    assert len(sent) > 3 * len(names)
    changed = [i for i, (answer, arrived) in enumerate(sent) if answer.to_bytes() != arrived]
    assert not changed, f"answers {changed} of {len(sent)} changed after they were sent"
