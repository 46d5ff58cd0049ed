"""The advertise step folded into the previous aggregation's unmask answer, against a deviating
coordinator (issue 22).

An unmask task may ask a silo to advertise its keys for the aggregation the coordinator
expects next (`advertise_next`: a round and a phase); the silo's answer then carries them, and
that aggregation starts at its share step. The coordinator names the aggregation, so it could
name any: what must hold is what holds for an advertise task, one key set per (job, round,
phase), however often and by whichever task it is asked for. The five unmodified silo agents
and the coordinator are those of tests/adversarial/test_masking.py; each test asserts that the
attack fails (the target's update does not decode), against the honest control first. The last
test holds the unmask task that carries keys to the booking an advertise task makes.
"""

from __future__ import annotations

from pathlib import Path

from fedsilo.silo.tasks import TASK_KINDS
from fedsilo.wire.messages import TaskMessage, TaskResult
from fedsilo.wire.tasks import SecAggUnmask
from fedsilo.wire.tasks.tensor_names import ADVERTISEMENT, REVEALED_SEED
from fedsilo.wire.tensors import tensor_bytes
from tests.adversarial.test_masking import (
    PHASE,
    SILOS,
    TARGET,
    Consortium,
    DeviatingCoordinator,
    consortium,
    decodes,
    message_to,
    restarted,
    secure_policy,
    true_update,
)

WEIGHTS = dict.fromkeys(SILOS, 1 / len(SILOS))
ROUND_TWO = {"round": 2, "phase": PHASE}


def folded(replies: dict[str, TaskResult]) -> dict[str, str]:
    """The advertisements folded into unmask answers, as hex (as an advertise step's)."""
    return {
        s: tensor_bytes(r.tensors[ADVERTISEMENT]).hex()
        for s, r in replies.items()
        if ADVERTISEMENT in r.tensors
    }


def round_one_folding_round_two(c: Consortium) -> tuple[DeviatingCoordinator, dict, dict]:
    """An honest round 1 whose unmask tasks ask every silo for its round-2 keys: the round's
    coordinator, its unmask answers and the round-2 advertisements they carry."""
    first = DeviatingCoordinator(c)
    adverts = first.advertise(SILOS)
    first.share(dict.fromkeys(SILOS, adverts))
    first.mask(WEIGHTS)
    revealed = first.unmask(dict.fromkeys(SILOS, SILOS), ROUND_TWO)
    assert len(revealed) == len(SILOS), first.refusals
    return first, revealed, folded(revealed)


def round_from(c: Consortium, adverts: dict[str, str], round_no: int = 2) -> tuple:
    """Round `round_no` run honestly from `adverts`, no advertise step: its coordinator and
    its unmask answers."""
    coordinator = DeviatingCoordinator(c, round_no=round_no)
    coordinator.adverts = adverts
    coordinator.share(dict.fromkeys(SILOS, adverts))
    coordinator.mask(WEIGHTS)
    return coordinator, coordinator.unmask(dict.fromkeys(SILOS, SILOS))


def test_keys_folded_into_the_unmask_answers_run_the_next_round_without_an_advertise_step() -> None:
    # The control: both rounds yield the weighted sum of every silo's update, so the attacks
    # below fail on the silos' refusals, not on this module's arithmetic.
    c = consortium(secure_policy())
    first, revealed, adverts = round_one_folding_round_two(c)
    assert sorted(adverts) == SILOS
    total = sum(true_update(c, silo) for silo in SILOS)
    assert decodes(first.sum_of(revealed, SILOS), total, 1 / len(SILOS))
    second, everyone = round_from(c, adverts)
    assert len(everyone) == len(SILOS), second.refusals
    total = sum(true_update(c, silo, round_no=2) for silo in SILOS)
    assert decodes(second.sum_of(everyone, SILOS), total, 1 / len(SILOS))


def test_a_silo_makes_one_key_set_for_a_round_whether_folded_or_advertised() -> None:
    c = consortium(secure_policy())
    _, _, adverts = round_one_folding_round_two(c)
    # an advertise task for the round it folded keys for: the same keys, not a second set
    asked = DeviatingCoordinator(c, round_no=2)
    assert asked.advertise(SILOS) == adverts
    honest, everyone = round_from(c, adverts)
    assert len(everyone) == len(SILOS), honest.refusals
    others = [s for s in SILOS if s != TARGET]
    # a second aggregation of round 2: under the round's task ids (answered already), or
    # under ids no position has (outside the contract)
    same_ids = DeviatingCoordinator(c, round_no=2)
    new_ids = DeviatingCoordinator(c, round_no=2, tag="again-")
    for again in (same_ids, new_ids):
        fresh = again.advertise(others)
        again.share(dict.fromkeys(fresh, fresh))
        again.mask(dict.fromkeys(others, 1 / len(SILOS)))
        rest = (
            again.unmask(dict.fromkeys(again.masked, sorted(again.masked))) if again.masked else {}
        )
        estimate = None
        if len(rest) == len(others):
            estimate = honest.sum_of(everyone, SILOS) - again.sum_of(rest, others)
        assert not decodes(estimate, true_update(c, TARGET, round_no=2), 1 / len(SILOS))
        assert set(again.refusals["advertise"]) == set(others)
    assert "answered already" in same_ids.refusals["advertise"]["silo-1"]
    assert "this position's task is" in new_ids.refusals["advertise"]["silo-1"]


def test_keys_are_not_folded_for_an_aggregation_the_silo_already_advertised_for() -> None:
    """An unmask task asking for keys for the aggregation it unmasks (round 1, advertised
    already) names no later weighted mean of the policy: the contract refuses the whole task,
    nothing is revealed and no keys are folded. Its handler, run on that task all the same,
    answers the unmask with round 1's own keys again, public already: no second key set."""
    c = consortium(secure_policy())
    first = DeviatingCoordinator(c)
    adverts = first.advertise(SILOS)
    first.share(dict.fromkeys(SILOS, adverts))
    first.mask(WEIGHTS)
    this_round = {"round": 1, "phase": PHASE}
    revealed = first.unmask(dict.fromkeys(SILOS, SILOS), this_round)
    assert revealed == {}
    assert set(first.refusals["unmask"]) == set(SILOS)
    assert "'advertise_next' names round 1" in first.refusals["unmask"][TARGET]
    unmask = {"survivors": SILOS, "signatures": first.signatures, "advertise_next": this_round}
    message = TaskMessage.decode(message_to(TARGET, "secagg_unmask", unmask, 1, c))
    assert isinstance(message.config, SecAggUnmask)
    answered = TASK_KINDS["secagg_unmask"].handler(message, c.agents[TARGET].context)
    assert answered.ok and REVEALED_SEED + TARGET in answered.tensors
    assert folded({TARGET: answered}) == {TARGET: adverts[TARGET]}  # no second key set


def test_keys_asked_for_again_once_shared_are_the_same_and_finish_the_one_aggregation(
    tmp_path: Path,
) -> None:
    # A coordinator that lost the folded keys (restarted in the middle of round 2, after the
    # shares went out) asks for them again: each silo (keeping its answers in its state
    # folder, as a deployed silo does) hands out the same public keys, never a second set,
    # and its shares again, the same bytes under the same task ids, so the only aggregation of
    # round 2 it can finish is the one the silos began; its sum is every silo's.
    c = consortium(secure_policy(), state=tmp_path)
    _, _, adverts = round_one_folding_round_two(c)
    lost = DeviatingCoordinator(c, round_no=2)
    lost.share(dict.fromkeys(SILOS, adverts))
    restarted_coordinator = DeviatingCoordinator(c, round_no=2)
    assert restarted_coordinator.advertise(SILOS) == adverts
    shared = restarted_coordinator.share(dict.fromkeys(SILOS, adverts))
    assert {s: r.tensors.keys() for s, r in shared.items()} == {
        s: r.tensors.keys() for s, r in lost.shared.items()
    }
    assert all(
        tensor_bytes(shared[s].tensors[name]) == tensor_bytes(lost.shared[s].tensors[name])
        for s in SILOS
        for name in shared[s].tensors
    )
    restarted_coordinator.mask(WEIGHTS)
    revealed = restarted_coordinator.unmask(dict.fromkeys(SILOS, SILOS))
    total = sum(true_update(c, silo, round_no=2) for silo in SILOS)
    assert decodes(restarted_coordinator.sum_of(revealed, SILOS), total, 1 / len(SILOS))
    # and under task ids no position has, nothing: neither keys nor shares
    again = DeviatingCoordinator(c, round_no=2, tag="again-")
    assert again.advertise(SILOS) == {}
    assert "this position's task is" in again.refusals["advertise"][TARGET]


def test_a_silo_restarted_after_folding_its_keys_sits_that_round_out(tmp_path: Path) -> None:
    # Keys live in memory only: a silo restarted between the rounds no longer holds the ones
    # it folded, and makes no others for that round.
    c = consortium(secure_policy(), state=tmp_path)
    _, _, adverts = round_one_folding_round_two(c)
    c = restarted(c, TARGET, tmp_path)
    coordinator = DeviatingCoordinator(c, round_no=2)
    assert TARGET not in coordinator.share(dict.fromkeys(SILOS, adverts))
    assert "out of order" in coordinator.refusals["share"][TARGET]
    asked = DeviatingCoordinator(c, round_no=2)
    assert asked.advertise([TARGET]) == {}
    assert "already took the advertise step" in asked.refusals["advertise"][TARGET]


def test_an_unmask_task_that_folds_keys_books_the_sample_count_an_advertise_task_would() -> None:
    c = consortium(secure_policy())
    context = c.agents[TARGET].context
    unmask = {"survivors": SILOS, "signatures": {}}

    def booked(config: dict, kind: str = "secagg_unmask") -> list[str]:
        message = TaskMessage.decode(message_to(TARGET, kind, config, 1, c))
        return [m.kind for m in TASK_KINDS[kind].releases(message, context)]

    assert booked(unmask) == ["public"]
    # the count's first release, whichever task carries it (no DP here: released as it is)
    assert booked(unmask | {"advertise_next": ROUND_TWO}) == ["public", "none"]
    assert booked({}, "secagg_advertise") == ["public", "none"]
    DeviatingCoordinator(c).advertise([TARGET])  # the count leaves with the advertisement
    assert booked(unmask | {"advertise_next": ROUND_TWO}) == ["public"]


def test_keys_are_folded_for_the_next_aggregation_of_the_phase_only() -> None:
    """Round 1's unmask tasks ask for keys for round 3, a later weighted mean of the policy
    but not the next one (round 2): the contract refuses the whole task, nothing is revealed
    and no keys are made."""
    c = consortium(secure_policy(rounds=3))
    first = DeviatingCoordinator(c)
    adverts = first.advertise(SILOS)
    first.share(dict.fromkeys(SILOS, adverts))
    first.mask(WEIGHTS)
    revealed = first.unmask(dict.fromkeys(SILOS, SILOS), {"round": 3, "phase": PHASE})
    assert folded(revealed) == {} and revealed == {}
    assert set(first.refusals["unmask"]) == set(SILOS)
    assert "which this silo's policy makes round 2" in first.refusals["unmask"][TARGET]
