"""FedDC's sealed hand-offs against a deviating coordinator: the policy's `no_return_window` and
the one recipient a hosted model has a round, held by each silo itself.

The coordinator chooses each hand-off's recipient (a sealing key of another member). An honest
one draws its permutations so that no model goes back to one of its last `no_return_window`
holders (a model handed straight back gives the silo that sent it its recipient's exact
update), and has each hosted model sealed to one member a round: two sealed copies of one model
give two members the same model, and each then learns the other's update as soon as the other's
next hand-off reaches it. A deviating coordinator asks for both anyway. Each test writes the
attack as that coordinator would send it, to unmodified silos built by the simulation's own
builder (tests/adversarial/rewriting.py), with one or two colluding silos whose keys it holds,
and asserts that it fails: the target refuses, and what the colluders hold does not decode the
target's update (the update is computed beside, by a fresh silo on the target's data trained on
the same model at the same position).
"""

from __future__ import annotations

import torch
from nacl.public import PrivateKey

from fedsilo.policies.schema import Policy
from fedsilo.privacy.handoff import Binding, open_sealed, unpack
from fedsilo.wire.messages import SIMULATION, TaskResult
from fedsilo.wire.tasks import DaisyReceive, DaisyTrain, Handoff
from fedsilo.wire.tasks.tensor_names import HANDOFF, MODEL
from fedsilo.wire.tensors import ParameterSpec
from tests.adversarial.rewriting import Consortium, close, policy
from tests.wire_tasks import reworded

TARGET, COLLUDER, OTHER = "silo-0", "silo-1", "silo-2"
RECIPIENT = OTHER  # an honest member
PHASE = "daisy"


def feddc(window: int) -> Policy:
    """FedDC daisy chaining alone (a hand-off every round) over three silos, sealed hand-offs,
    no secure sum, the policy's `no_return_window` `window`."""
    return policy(
        "none",
        rounds=4,
        algorithm={"name": "feddc", "daisy_period": 1, "aggregation_period": None,
                   "no_return_window": window},
        participants={"min_silos": 1, "phase_timeout_s": 60},
        channel={"sealed_handoffs": True},
    )  # fmt: skip


def hand_on(
    c: Consortium,
    spec: ParameterSpec,
    sender: str,
    recipient: str,
    round_no: int,
    adopt: torch.Tensor | None = None,
) -> TaskResult:
    """`sender`'s task of the round's daisy phase, as the strategy builds it (adopting `adopt`
    when given, else training what it hosts), its model sealed to `recipient`."""
    train = c.train_task(sender, torch.zeros(spec.numel), spec, round_no).config
    key = bytes(c.keys.sealing_roster[recipient]).hex()
    config = DaisyTrain(train=train, adopt=adopt is not None, handoff=Handoff(seal_to=key))
    tensors = {MODEL: adopt} if adopt is not None else {}
    return c.ask(
        c.message(sender, config, round_no=round_no, phase=PHASE, tensors=tensors, spec=spec)
    )


def deliver(c: Consortium, recipient: str, answer: TaskResult, round_no: int) -> TaskResult:
    """The hand-off in `answer` delivered to `recipient`, as the router delivers it."""
    return c.ask(
        c.message(recipient, DaisyReceive(sealed=True), round_no=round_no, phase=PHASE,
                  step="deliver", tensors={HANDOFF: answer.tensors[HANDOFF]})
    )  # fmt: skip


def opened(c: Consortium, silo: str, answer: TaskResult, round_no: int) -> torch.Tensor:
    """The model in the hand-off `answer` carries, opened with `silo`'s key (a colluder's)."""
    blob = bytes(answer.tensors[HANDOFF].numpy())
    sealed = open_sealed(blob, PrivateKey(c.keys.sealing[silo]))
    return unpack(sealed, Binding(SIMULATION, round_no, PHASE, silo), c.keys.roster).model


def trained_by(
    c: Consortium, spec: ParameterSpec, silo: str, model: torch.Tensor, round_no: int
) -> torch.Tensor:
    """What `silo` makes of `model` at `round_no`'s daisy phase: a fresh silo on the same
    data adopts it, trains as the position says, and seals it to a member whose key the test
    holds."""
    alone = Consortium(c.policy)
    recipient = next(s for s in alone.silos if s != silo)
    answer = hand_on(alone, spec, silo, recipient, round_no, adopt=model)
    assert answer.ok, answer.error
    return opened(alone, recipient, answer, round_no)


def leaked(estimate: torch.Tensor | None, truth: torch.Tensor) -> bool:
    return estimate is not None and close(estimate.double().numpy(), truth.double().numpy())


def test_a_silo_seals_no_model_back_to_the_member_it_came_from() -> None:
    """The colluder hands its model to the target; the next round the coordinator has the
    target seal what it trained back to the colluder, which knows what it sent."""
    c = Consortium(feddc(window=1))
    start, spec = c.initial_model()
    first = hand_on(c, spec, COLLUDER, TARGET, 1, adopt=start)
    assert first.ok and deliver(c, TARGET, first, 1).ok
    sent = opened(c, TARGET, first, 1)  # what the colluder sealed: it knows it
    back = hand_on(c, spec, TARGET, COLLUDER, 2)
    estimate = opened(c, COLLUDER, back, 2) - sent if back.ok else None
    assert not leaked(estimate, trained_by(c, spec, TARGET, sent, 2) - sent), "the update decoded"
    assert not back.ok, "the target sealed its model back to the member it came from"
    assert "no_return_window" in (back.error or "")


def test_a_silo_seals_no_model_to_a_holder_within_the_window_named_in_its_hand_off() -> None:
    """Window 2: the model goes colluder -> other -> target; the coordinator has the target
    seal it to the colluder, two holders back, while `other` (colluding too) knows what it
    sent the target. The target learns the colluder's part from the signed hand-off."""
    c = Consortium(feddc(window=2))
    start, spec = c.initial_model()
    first = hand_on(c, spec, COLLUDER, OTHER, 1, adopt=start)
    assert first.ok and deliver(c, OTHER, first, 1).ok
    second = hand_on(c, spec, OTHER, TARGET, 2)
    assert second.ok and deliver(c, TARGET, second, 2).ok
    sent = opened(c, TARGET, second, 2)
    back = hand_on(c, spec, TARGET, COLLUDER, 3)
    estimate = opened(c, COLLUDER, back, 3) - sent if back.ok else None
    assert not leaked(estimate, trained_by(c, spec, TARGET, sent, 3) - sent), "the update decoded"
    assert not back.ok, "the target sealed its model to a holder within the window"
    assert "no_return_window" in (back.error or "")


def test_a_silo_seals_no_model_to_a_member_holding_a_copy_of_it() -> None:
    """The target hands its model to the colluder and the coordinator delivers it no model in
    exchange (as if its sender had dropped), so it keeps training the one it sent; the next
    round it is asked to seal that one to the colluder, which holds last round's copy."""
    c = Consortium(feddc(window=1))
    start, spec = c.initial_model()
    first = hand_on(c, spec, TARGET, COLLUDER, 1, adopt=start)
    assert first.ok and deliver(c, COLLUDER, first, 1).ok
    copy = opened(c, COLLUDER, first, 1)
    again = hand_on(c, spec, TARGET, COLLUDER, 2)
    estimate = opened(c, COLLUDER, again, 2) - copy if again.ok else None
    assert not leaked(estimate, trained_by(c, spec, TARGET, copy, 2) - copy), "the update decoded"
    assert not again.ok, "the target sealed its model to the member holding a copy of it"
    assert "no_return_window" in (again.error or "")


def test_a_hosted_model_is_sealed_to_one_member_a_round() -> None:
    """The target hands its model to an honest recipient (`RECIPIENT`, the victim here); the
    coordinator then asks the target to seal the same model again, to the colluder, as if the
    recipient had dropped (the `daisy_reseal` step fedsilo's coordinator no longer sends),
    delivers both, and next round has the recipient hand what it trained to the colluder,
    which the recipient's window allows (the colluder never held the model as far as the
    recipient knows): the colluder holds the model the recipient started from, so it learns
    the recipient's exact update."""
    c = Consortium(feddc(window=1))
    start, spec = c.initial_model()
    first = hand_on(c, spec, TARGET, RECIPIENT, 1, adopt=start)
    assert first.ok and deliver(c, RECIPIENT, first, 1).ok
    key = bytes(c.keys.sealing_roster[COLLUDER]).hex()
    receive = c.message(TARGET, DaisyReceive(sealed=True), round_no=1, phase=PHASE, step="reseal")
    reseal = reworded(receive, {"handoff": {"seal_to": key}}, kind="daisy_reseal")
    resealed = TaskResult.decode(c.agents[TARGET].handle_bytes(reseal))
    estimate = None
    if resealed.ok and HANDOFF in resealed.tensors:
        assert deliver(c, COLLUDER, resealed, 1).ok
        copy = opened(c, COLLUDER, resealed, 1)
        onward = hand_on(c, spec, RECIPIENT, COLLUDER, 2)
        if onward.ok:
            estimate = opened(c, COLLUDER, onward, 2) - copy
    received = opened(c, RECIPIENT, first, 1)
    truth = trained_by(c, spec, RECIPIENT, received, 2) - received
    assert not leaked(estimate, truth), "the recipient's update decoded"
    assert not resealed.ok, "the target sealed one hosted model to two members in one round"
    assert "daisy_reseal" in (resealed.error or "")
