"""Under masking the coordinator chooses no model: every silo derives each model it is sent from
the policy's seed and the aggregates it verifies itself (silo/lineage.py). Each attack runs the
real engine and protocol against unmodified silos (tests/adversarial/rewriting.py) twice: with
model lineage (the default), where every silo refuses it, and with `lineage: false` (the
protocol before lineage), where the silos train on the coordinator's choice: so each test
shows the attack is real and what closes it.

The attacks: a crafted model of the right shape in the first round (an imprint layer, Fowl et
al. 2022), the same model re-sent after its sum was taken (two sums over one model, one without
the target, give the target's update), a model that is not the server step of the verified
aggregate, forged evidence, and an evaluation of a chosen model (a gradient oracle).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
import torch

from fedsilo.coordinator.strategies.base import ServerState
from fedsilo.privacy.lineage import LineageRecord, state_digest, state_tensors
from fedsilo.wire.messages import TaskMessage
from fedsilo.wire.tasks.tensor_names import (
    CONTROL,
    LINEAGE_INPUT,
    LINEAGE_RECORD,
    LINEAGE_STATE,
    MODEL,
)
from fedsilo.wire.tensors import bytes_tensor, tensor_bytes
from tests.adversarial.rewriting import Consortium, policy

MODEL_CARRYING = ("secagg_mask", "evaluate")


def consortium(lineage: bool, algorithm: str = "fedavg", silos: int = 3) -> Consortium:
    return Consortium(
        policy(
            secure_aggregation={"method": "masking", "lineage": lineage},
            algorithm={"name": algorithm},
            data={"source": "sklearn:breast_cancer", "partition": {"kind": "iid", "silos": silos}},
        )
    )


def rounds(c: Consortium, count: int, resend: dict[int, int] | None = None) -> list[ServerState]:
    """`count` rounds of the honest engine (each evaluated once it completed), each from the
    state the last one left, except
    that round r starts from the state that round `resend[r]` started from (a re-sent model);
    the states each round started from, and the last one's."""
    engine = c.engine()
    state, _ = engine._start()
    started = [state]
    for round_no in range(1, count + 1):
        source = (resend or {}).get(round_no)
        start = started[source - 1] if source is not None else state
        record, state = engine._run_round(start, round_no)
        if record.status == "completed":
            engine._evaluate(state, round_no, record)
        started.append(state)
    return started


def with_model(message: TaskMessage, model: torch.Tensor) -> TaskMessage:
    """`message` carrying `model` instead of its own, the state digest made to match: a
    coordinator that keeps its own books consistent."""
    tensors = dict(message.tensors)
    tensors[MODEL] = model
    if LINEAGE_STATE in tensors:
        tensors[LINEAGE_STATE] = bytes_tensor(state_digest({MODEL: model}))
    return replace(message, tensors=tensors)


def rewriting(kinds: tuple[str, ...], round_no: int, change: Callable[[TaskMessage], TaskMessage]):
    def rewrite(message: TaskMessage) -> TaskMessage:
        if message.kind in kinds and message.round == round_no:
            return change(message)
        return message

    return rewrite


def imprinted(model: torch.Tensor) -> torch.Tensor:
    """A crafted model of the honest one's shape: the linear model reading one feature only
    (the identity on feature 0, every other weight 0), so its update exposes that feature."""
    crafted = torch.zeros_like(model)
    crafted[0] = 1.0
    return crafted


def lineage_refusals(c: Consortium, kind: str = "secagg_mask") -> dict[str, str]:
    return {s: e for s, e in c.refusals(kind).items() if "model lineage" in e}


@pytest.mark.parametrize("lineage", [True, False])
def test_a_crafted_first_model_is_refused_by_every_silo(lineage: bool) -> None:
    c = consortium(lineage)
    c.rewrite = rewriting(MODEL_CARRYING, 1, lambda m: with_model(m, imprinted(m.tensors[MODEL])))
    rounds(c, 1)
    if lineage:
        assert set(lineage_refusals(c)) == set(c.silos)
        assert all("policy's seed" in e for e in lineage_refusals(c).values())
        assert not c.answered("secagg_mask")
    else:  # before lineage: every silo trained the coordinator's model and sent its update
        assert set(c.answered("secagg_mask")) == set(c.silos)


@pytest.mark.parametrize("lineage", [True, False])
def test_a_model_re_sent_after_its_sum_was_taken_is_refused(lineage: bool) -> None:
    """Round 3 starts again from round 2's model: a second sum over one model, which without
    one silo would give that silo's update as the difference of the two."""
    c = consortium(lineage)
    rounds(c, 3, resend={3: 2})
    round_3 = {a.message.silo: a.result for a in c.answers if a.message.kind == "secagg_mask"
               and a.message.round == 3}  # fmt: skip
    if lineage:
        assert not any(r.ok for r in round_3.values())
        assert all("re-sent" in (r.error or "") for r in round_3.values())
    else:
        assert all(r.ok for r in round_3.values())


@pytest.mark.parametrize("lineage", [True, False])
def test_a_model_other_than_the_server_step_of_the_verified_sum_is_refused(lineage: bool) -> None:
    """Round 2's model nudged off the mean of round 1 (a coordinator steering the model)."""
    c = consortium(lineage)
    c.rewrite = rewriting(MODEL_CARRYING, 2, lambda m: with_model(m, m.tensors[MODEL] + 1e-3))
    rounds(c, 2)
    if lineage:
        refused = lineage_refusals(c)
        assert set(refused) == set(c.silos)
        assert all("round 1's aggregation" in e for e in refused.values())
    else:
        assert {a.message.silo for a in c.answers if a.message.kind == "secagg_mask"
                and a.message.round == 2 and a.result.ok} == set(c.silos)  # fmt: skip


def forged_input(message: TaskMessage) -> TaskMessage:
    """The evidence with one survivor's masked input changed: a sum the coordinator chose."""
    tensors = dict(message.tensors)
    name = next(n for n in tensors if n.startswith(LINEAGE_INPUT))
    tensors[name] = tensors[name] + 1
    return replace(message, tensors=tensors)


def forged_weights(message: TaskMessage) -> TaskMessage:
    """The evidence's weights changed (they set the mean): no survivor signed them."""
    tensors = dict(message.tensors)
    record = LineageRecord.from_bytes(tensor_bytes(tensors[LINEAGE_RECORD]))
    first = sorted(record.weights)[0]
    weights = {s: (0.9 if s == first else 0.1 / (len(record.weights) - 1)) for s in record.weights}
    tensors[LINEAGE_RECORD] = bytes_tensor(replace(record, weights=weights).to_bytes())
    return replace(message, tensors=tensors)


@pytest.mark.parametrize("forge", [forged_input, forged_weights])
def test_evidence_a_member_did_not_sign_is_refused(forge) -> None:
    c = consortium(True)
    c.rewrite = rewriting(MODEL_CARRYING, 2, forge)
    rounds(c, 2)
    assert set(lineage_refusals(c)) == set(c.silos)


def test_an_evaluation_of_a_chosen_model_is_refused() -> None:
    """Evaluations of chosen models would make a gradient oracle (loss differences)."""
    c = consortium(True)
    c.rewrite = rewriting(("evaluate",), 1, lambda m: with_model(m, m.tensors[MODEL] * 0.5))
    rounds(c, 1)
    assert set(lineage_refusals(c, "evaluate")) == set(c.silos)


@pytest.mark.parametrize(
    "algorithm",
    ["fedavg", "fedprox", "approx_fedavg", "fedadam", "fedyogi", "fedadagrad", "scaffold"],
)
def test_honest_rounds_under_lineage_give_the_same_bits_as_without(algorithm: str) -> None:
    """Every silo derives the model the coordinator sends (with the server optimiser's
    moments), so lineage changes nothing in an honest run."""
    states = {lineage: rounds(consortium(lineage, algorithm), 3)[-1] for lineage in (True, False)}
    with_lineage, without = (state_tensors(states[x].tensors) for x in (True, False))
    assert with_lineage.keys() == without.keys()
    for name, tensor in without.items():
        assert torch.equal(with_lineage[name], tensor), name


def test_a_silo_that_sat_out_the_last_sum_takes_its_state_on_the_signatures_of_the_others() -> None:
    """silo-2 misses round 1's aggregation (its advertise step fails); in round 2 it derives
    the model from the state round 1's silos signed they were sent and the verified sum."""
    c = consortium(True, silos=4)

    def drop_round_one(message: TaskMessage) -> TaskMessage:
        if message.silo == "silo-2" and message.round == 1 and message.kind.startswith("secagg"):
            return replace(message, silo="nobody")  # misaddressed: refused, a dropout
        return message

    c.rewrite = drop_round_one
    rounds(c, 2)
    round_2 = {a.message.silo for a in c.answers if a.message.kind == "secagg_mask"
               and a.message.round == 2 and a.result.ok}  # fmt: skip
    assert "silo-2" in round_2
    assert not lineage_refusals(c)


def test_a_scaffold_control_variate_other_than_the_derived_one_is_refused() -> None:
    """SCAFFOLD's server control variate c steers every local step (g - c_i + c): a chosen c is
    a chosen training, refused like a chosen model."""
    c = consortium(True, algorithm="scaffold")

    def steered(message: TaskMessage) -> TaskMessage:
        return replace(message, tensors={**message.tensors, CONTROL: message.tensors[CONTROL] + 1})

    c.rewrite = rewriting(("secagg_mask",), 2, steered)
    rounds(c, 2)
    refused = lineage_refusals(c)
    assert set(refused) == set(c.silos)
    assert all("control" in e for e in refused.values())
