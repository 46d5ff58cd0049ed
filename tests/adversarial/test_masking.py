"""Pairwise-masked secure aggregation against a deviating coordinator (issue 17, finding 1).

Each test is a coordinator written here that speaks the real protocol (encoded TaskMessages to
`SiloAgent.handle_bytes`) to five unmodified silo agents with provisioned identities, each
built from its own copy of a policy that says `secure_aggregation: masking`. Its tasks are the
ones the silos' contract asks for (task ids per position, the masked input wrapping the
training task the policy derives) except where an attack bends them, and it tries one attack:
collecting models in the clear, weights that single out one silo, a group of one, different
survivor sets for different silos, a second aggregation of the same round, a silo's own keys
relayed back changed, and confirmations short of the threshold. Each asserts the attack
fails: the silos refuse, or what the coordinator obtains does not decode the target's update.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pytest
import torch
from nacl.public import PrivateKey
from nacl.signing import SigningKey

from fedsilo.coordinator.strategies import make_strategy
from fedsilo.ops.sim_silos import ConsortiumKeys
from fedsilo.policies.algorithms.contract import Position
from fedsilo.policies.loading import parse_policy
from fedsilo.policies.schema import Policy
from fedsilo.policies.secure_aggregation import SecureAggregationConfig
from fedsilo.privacy.masking import (
    Advertisement,
    FixedPoint,
    MaskingKeys,
    aggregation_label,
    combine_shares,
    pairwise_seed,
    prg,
    sign,
    silo_indices,
    tensor_context,
)
from fedsilo.silo.agent import SiloAgent
from fedsilo.silo.aggregation_log import AggregationLog, StepAlreadyTaken
from fedsilo.silo.data import SiloDataset, load_consortium
from fedsilo.silo.tasks import TASK_KINDS
from fedsilo.silo.tasks.base import flat_parameters, parameter_spec
from fedsilo.wire.messages import TASK_STEPS, TaskMessage, TaskResult, task_id
from fedsilo.wire.tasks import TaskConfig
from fedsilo.wire.tasks.tensor_names import (
    ADVERTISEMENT,
    CONFIRMATION,
    REVEALED_KEY,
    REVEALED_SEED,
    SHARE_TO,
)
from fedsilo.wire.tensors import tensor_bytes
from tests.silos import honest
from tests.wire_tasks import ONE_PER_KIND, reworded

SILOS = [f"silo-{i}" for i in range(5)]
TARGET = "silo-0"
DEPLOYMENT = "adversarial"
PHASE = "train"


def secure_policy(
    method: str = "masking",
    silos: int = len(SILOS),
    algorithm: str = "fedavg",
    rounds: int = 3,
    **section: object,
) -> Policy:
    return parse_policy(
        {
            "version": 1,
            "seed": 5,
            "rounds": rounds,
            "algorithm": {"name": algorithm},
            "model": {"name": "mlp", "hidden": [8]},
            "training": {"epochs": 1, "batch_size": 32, "lr": 0.1},
            "participants": {"min_silos": 3, "phase_timeout_s": 60},
            "data": {
                "source": "sklearn:breast_cancer",
                "partition": {"kind": "iid", "silos": silos},
            },
            # the masking protocol's own checks, each attack against them alone: they hold
            # with model lineage too, which refuses these tests' chosen models before any
            # step runs (tests/adversarial/test_model_lineage.py)
            "secure_aggregation": {"method": method}
            | ({"lineage": False} if method == "masking" else {})
            | section,
        }
    )


@dataclass
class Consortium:
    """The silo agents as provisioning makes them, each from its own copy of `policy`, and
    what the coordinator may know (`model`: the model it sends, in the silos' layout)."""

    policy: Policy
    datasets: dict[str, SiloDataset]
    agents: dict[str, SiloAgent]
    keys: ConsortiumKeys
    model: torch.Tensor = field(init=False)
    spec: object = field(init=False)

    def __post_init__(self) -> None:
        model = self.agents[TARGET].context.new_model(seed=3)
        self.spec = parameter_spec(model)
        self.model = flat_parameters(model, self.spec).detach()


def consortium(
    policy: Policy, secure: SecureAggregationConfig | None = None, state: Path | None = None
) -> Consortium:
    """The silos of `policy`, holding `secure` as their policy's section when given (a
    section the policy reader would refuse, to show the silo's own checks hold anyway), each
    with its state folder under `state` when given."""
    if secure is not None:
        policy = policy.model_copy(update={"secure_aggregation": secure})
    datasets = {d.name: d for d in load_consortium(policy.data, seed=policy.seed)}
    keys = ConsortiumKeys.generate(datasets)
    agents = {name: silo_agent(policy, name, data, keys, state) for name, data in datasets.items()}
    return Consortium(policy, datasets, agents, keys)


def silo_agent(
    policy: Policy, name: str, data: SiloDataset, keys: ConsortiumKeys, state: Path | None
) -> SiloAgent:
    """Silo `name`'s agent, built the one way a silo is (from the policy, with its keys)."""
    return SiloAgent(
        name,
        data,
        policy,
        deployment=DEPLOYMENT,
        keys=keys.of(name),
        state=None if state is None else state / name,
    )


def restarted(c: Consortium, silo: str, state: Path) -> Consortium:
    """The consortium with `silo`'s agent started again from its state folder under `state`
    (what it kept on disk, nothing it held in memory)."""
    again = silo_agent(c.policy, silo, c.datasets[silo], c.keys, state)
    return replace(c, agents={**c.agents, silo: again})


def honest_train(c: Consortium, silo: str, round_no: int = 1) -> TaskConfig:
    """The training task the honest strategy sends `silo` in round `round_no`: the config the
    algorithm's contract derives from the policy (its seed from the policy's seed, the round
    and the silo), the one a masked input must wrap."""
    return make_strategy(c.policy).train_config(Position(round_no, PHASE, silo))


def trained_alone(
    c: Consortium,
    silo: str,
    round_no: int = 1,
    tensors: Mapping[str, torch.Tensor] | None = None,
) -> TaskResult:
    """What `silo` answers to the honest training task of round `round_no` from the model
    (and `tensors`) under the same policy without secure aggregation: a fresh agent on the
    same data (training is seeded by the policy, so it is the result the silo would mask)."""
    plain = c.policy.model_copy(update={"secure_aggregation": SecureAggregationConfig()})
    alone = SiloAgent(silo, c.datasets[silo], plain, deployment="reference", keys=c.keys.of(silo))
    sent = {"model": c.model} | dict(tensors or {})
    result = alone.handle(honest(alone, PHASE, round_no, sent, c.spec))
    assert result.ok, result.error
    return result


def true_update(c: Consortium, silo: str, round_no: int = 1) -> np.ndarray:
    """What `silo`'s training of round `round_no` changes in the model sent."""
    result = trained_alone(c, silo, round_no)
    return (result.tensors["model"].double() - c.model.double()).numpy()


def named(kind: str, round_no: int, silo: str, tag: str | None = None) -> str:
    """The id of `silo`'s `kind` task in round `round_no`: the one the contract names for that
    position (`task_id`), or with `tag` one no position has (`<tag><step>` in place of the
    step: the wording of a coordinator that invents a second aggregation of the round)."""
    step = TASK_STEPS.get(kind)
    if tag is None:
        return task_id(DEPLOYMENT, round_no, PHASE, step, silo)
    return f"{DEPLOYMENT}/r{round_no}/{PHASE}/{tag}{step or kind}/{silo}"


def message_to(
    silo: str,
    kind: str,
    config: Mapping,
    round_no: int,
    c: Consortium,
    tensors: Mapping[str, torch.Tensor] | None = None,
    tag: str | None = None,
) -> bytes:
    """A `kind` task encoded as the real coordinator encodes it, its config any JSON object,
    its id the one its position has (`named`; another with `tag`)."""
    carries_model = kind in ("train", "scaffold_train", "secagg_mask", "ckks_encrypt")
    message = TaskMessage(
        task_id=named(kind, round_no, silo, tag),
        round=round_no,
        phase=PHASE,
        silo=silo,
        config=ONE_PER_KIND[kind],
        tensors=({"model": c.model} if carries_model else {}) | dict(tensors or {}),
        spec=c.spec if carries_model else None,
    )
    return reworded(message, config)


def wrapping(c: Consortium, silo: str, round_no: int) -> dict[str, object]:
    """The inner task of `silo`'s masked (or encrypted) input, as config keys: the honest
    training task of the round, the only one its contract lets an input wrap."""
    inner = honest_train(c, silo, round_no)
    return {"inner_kind": inner.KIND, "inner_config": inner.to_json()}


class DeviatingCoordinator:
    """Sends whatever tasks it likes, encoded as the real coordinator encodes them, and keeps
    every answer; `refusals` gathers what the silos refused, by step. Its task ids are those
    of the positions it asks at, or with `tag` ids no position has."""

    def __init__(self, c: Consortium, round_no: int = 1, tag: str | None = None) -> None:
        self.c = c
        self.round = round_no
        self.tag = tag
        self.refusals: dict[str, dict[str, str]] = {}

    def send(self, step: str, configs: Mapping[str, Mapping]) -> dict[str, TaskResult]:
        kind = step if step == "train" else f"secagg_{step}"
        answers = {}
        for silo, config in sorted(configs.items()):
            message = message_to(silo, kind, config, self.round, self.c, tag=self.tag)
            reply = TaskResult.decode(self.c.agents[silo].handle_bytes(message))
            if reply.ok:
                answers[silo] = reply
            else:
                self.refusals.setdefault(step, {})[silo] = reply.error or ""
        return answers

    # -- the protocol's steps, each of which the attacks bend ---------------------------------

    def advertise(self, silos: Sequence[str]) -> dict[str, str]:
        replies = self.send("advertise", dict.fromkeys(silos, {}))
        self.adverts = {s: tensor_bytes(r.tensors[ADVERTISEMENT]).hex() for s, r in replies.items()}
        return self.adverts

    def share(self, views: Mapping[str, Mapping[str, str]]) -> dict[str, TaskResult]:
        self.views = views
        self.shared = self.send("share", {s: {"advertisements": v} for s, v in views.items()})
        return self.shared

    def mask(self, weights: Mapping[str, float]) -> dict[str, TaskResult]:
        configs = {}
        for v in self.shared:
            configs[v] = wrapping(self.c, v, self.round) | {
                "weights": dict(weights),
                "shares": {
                    u: tensor_bytes(self.shared[u].tensors[SHARE_TO + v]).hex()
                    for u in self.shared
                    if u != v and SHARE_TO + v in self.shared[u].tensors
                },
                "tensors": ["model"],
            }
        self.weights = dict(weights)
        self.masked = self.send("mask", configs)
        return self.masked

    def unmask(
        self,
        survivors_seen_by: Mapping[str, Sequence[str]],
        advertise_next: Mapping[str, object] | None = None,
    ) -> dict[str, TaskResult]:
        """Each silo is told its own survivor set; signatures over those sets, for the silos
        that sign them, are relayed to everyone, as a coordinator relays them. With
        `advertise_next` ({"round": r, "phase": p}), every unmask task asks for keys for that
        aggregation too (the advertise step folded into the answer)."""
        confirmed = self.send(
            "confirm",
            {s: {"survivors": sorted(v)} for s, v in survivors_seen_by.items()},
        )
        signatures = {s: tensor_bytes(r.tensors[CONFIRMATION]).hex() for s, r in confirmed.items()}
        self.signatures = signatures  # as relayed with every unmask task
        return self.send(
            "unmask",
            {
                s: {"survivors": sorted(v), "signatures": signatures}
                | ({"advertise_next": dict(advertise_next)} if advertise_next else {})
                for s, v in survivors_seen_by.items()
            },
        )

    # -- what the coordinator can compute from what it collected ------------------------------

    def rebuild(
        self, revealed: Mapping[str, TaskResult], name: str, threshold: int
    ) -> bytes | None:
        members = sorted(self.views[next(iter(revealed))]) if revealed else []
        indices = silo_indices(members)
        shares = {
            indices[holder]: tensor_bytes(reply.tensors[name])
            for holder, reply in revealed.items()
            if name in reply.tensors
        }
        if len(shares) < threshold or not shares:
            return None
        return combine_shares(shares, threshold)

    def decode_alone(
        self, target: str, seed: bytes, key: PrivateKey, peers: Sequence[str]
    ) -> np.ndarray:
        """The target's weighted update from its masked input, its self-mask seed and its
        masking key: remove PRG(b) and every pairwise mask it added."""
        label = tensor_context(aggregation_label(DEPLOYMENT, self.round, PHASE), "model")
        total = self.masked[target].tensors["model"].numpy().view(np.uint32).copy()
        total -= prg(seed, len(total), label)
        for peer in peers:
            public = Advertisement.from_bytes(peer, bytes.fromhex(self.adverts[peer])).masking_key
            stream = prg(pairwise_seed(key, public), len(total), label)
            total = total - stream if sign(target, peer) > 0 else total + stream
        encoding = FixedPoint.for_silos(
            self.c.policy.secure_aggregation.bound, len(self.views[target])
        )
        return encoding.decode(total.astype(np.uint32))

    def sum_of(self, revealed: Mapping[str, TaskResult], survivors: Sequence[str]) -> np.ndarray:
        """The unmasked weighted sum of `survivors`' inputs (every one of them sent its input)."""
        label = tensor_context(aggregation_label(DEPLOYMENT, self.round, PHASE), "model")
        total = np.zeros_like(self.masked[survivors[0]].tensors["model"].numpy().view(np.uint32))
        for silo in survivors:
            total += self.masked[silo].tensors["model"].numpy().view(np.uint32)
        for silo in survivors:
            seed = self.rebuild(revealed, REVEALED_SEED + silo, len(revealed))
            assert seed is not None
            total -= prg(seed, len(total), label)
        encoding = FixedPoint.for_silos(self.c.policy.secure_aggregation.bound, len(survivors))
        return encoding.decode(total)


def decodes(estimate: np.ndarray | None, update: np.ndarray, weight: float) -> bool:
    """Whether `estimate` is the target's weighted update (to the fixed-point precision)."""
    if estimate is None:
        return False
    return bool(np.abs(estimate - weight * update).max() < 1e-3 * max(1.0, np.abs(update).max()))


# -- a. plain tasks under a masking policy ------------------------------------------------------


# Each plain task that would send a model or a sum's input, with the algorithm whose contract
# sends it and the position it sends it at: (algorithm, round, phase).
PLAIN = {
    "train": ("fedavg", 1, "train"),
    "superfed_train": ("superfed", 1, "train"),
    "scaffold_train": ("scaffold", 1, "train"),
    "feature_moments": ("fedavg", 0, "moments"),
}


def plain_policy(kind: str) -> Policy:
    """A masking policy whose algorithm sends `kind` tasks; for `feature_moments`, FedAvg with
    `data.scaling: federated`, which the policy reader refuses under secure aggregation (raw
    moments have no bound), held by the silos anyway (a copy that skips the reader)."""
    algorithm, _, _ = PLAIN[kind]
    policy = secure_policy(algorithm=algorithm)
    if kind == "feature_moments":
        federated = policy.data.model_copy(update={"scaling": "federated"})
        policy = policy.model_copy(update={"data": federated})
    return policy


@pytest.mark.parametrize("kind", sorted(PLAIN))
def test_a_silo_under_a_masking_policy_refuses_to_send_its_model_in_the_clear(kind: str) -> None:
    """The very task its algorithm asks for at that position, sent plain and not wrapped in the
    masking protocol: every silo refuses it (its contract takes that phase's weighted mean
    masked only) and sends nothing."""
    c = consortium(plain_policy(kind))
    _, round_no, phase = PLAIN[kind]
    for silo in SILOS:
        agent = c.agents[silo]
        carried = {"model": c.model} if round_no else {}
        if kind == "scaffold_train":
            carried["control"] = torch.zeros_like(c.model)
        task = honest(agent, phase, round_no, carried, c.spec if carried else None)
        assert task.kind == kind
        reply = TaskResult.decode(agent.handle_bytes(task.encode()))
        assert not reply.ok, f"{silo} answered a plain {kind} task under a masking policy"
        assert "secure_aggregation masking" in (reply.error or "")
        assert not reply.tensors


# -- b. weights that single out one silo --------------------------------------------------------


def test_the_honest_protocol_gives_this_coordinator_the_weighted_sum_and_nothing_less() -> None:
    # The control for every attack below: followed honestly, the steps as this module's
    # coordinator drives them yield the weighted sum of every silo's update, so an attack that
    # yields nothing decodable failed on the silos' refusals, not on this module's arithmetic.
    c = consortium(secure_policy())
    coordinator = DeviatingCoordinator(c)
    adverts = coordinator.advertise(SILOS)
    coordinator.share(dict.fromkeys(SILOS, adverts))
    coordinator.mask(dict.fromkeys(SILOS, 1 / len(SILOS)))
    revealed = coordinator.unmask(dict.fromkeys(SILOS, SILOS))
    total = sum(true_update(c, silo) for silo in SILOS)
    assert decodes(coordinator.sum_of(revealed, SILOS), total, 1 / len(SILOS))


def test_weights_that_single_out_one_silo_are_refused() -> None:
    c = consortium(secure_policy())
    coordinator = DeviatingCoordinator(c)
    adverts = coordinator.advertise(SILOS)
    coordinator.share(dict.fromkeys(SILOS, adverts))
    weights = {s: 1.0 if s == TARGET else 0.0 for s in SILOS}
    coordinator.mask(weights)
    revealed = coordinator.unmask(dict.fromkeys(coordinator.masked, sorted(coordinator.masked)))
    estimate = None
    if sorted(coordinator.masked) == SILOS and len(revealed) == len(SILOS):
        estimate = coordinator.sum_of(revealed, SILOS)  # the others' weight-0 inputs add nothing
    assert not decodes(estimate, true_update(c, TARGET), 1.0), "the target's update decoded"
    assert set(coordinator.refusals.get("mask", {})) == set(SILOS)
    assert "min_weight" in coordinator.refusals["mask"][TARGET]


# -- c. a group of one --------------------------------------------------------------------------


def test_relaying_only_the_targets_own_keys_is_refused() -> None:
    c = consortium(secure_policy())
    coordinator = DeviatingCoordinator(c)
    adverts = coordinator.advertise(SILOS)
    coordinator.share({TARGET: {TARGET: adverts[TARGET]}})  # a group of one: threshold 1
    coordinator.mask({TARGET: 1.0})
    revealed = coordinator.unmask({TARGET: [TARGET]}) if coordinator.masked else {}
    estimate = None
    if revealed:
        secret = coordinator.rebuild(revealed, REVEALED_SEED + TARGET, 1)
        if secret is not None:
            estimate = coordinator.decode_alone(TARGET, secret, PrivateKey.generate(), [])
    assert not decodes(estimate, true_update(c, TARGET), 1.0), "the target's update decoded"
    assert "min_group" in coordinator.refusals["share"][TARGET]


# -- d. different survivor sets for different silos ---------------------------------------------


def test_different_survivor_sets_for_different_silos_reveal_no_silos_two_secrets() -> None:
    p = secure_policy()
    c = consortium(p, p.secure_aggregation.model_copy(update={"threshold": 2}))  # 2 of 5
    coordinator = DeviatingCoordinator(c)
    adverts = coordinator.advertise(SILOS)
    coordinator.share(dict.fromkeys(SILOS, adverts))
    weights = dict.fromkeys(SILOS, 1 / len(SILOS))
    coordinator.mask(weights)
    assert sorted(coordinator.masked) == SILOS
    told_alive = ["silo-1", "silo-2"]  # see the target survive: reveal its seed share
    told_dropped = ["silo-3", "silo-4"]  # see it drop: reveal its masking-key share
    views = {s: [TARGET, *told_alive] for s in told_alive} | {
        s: told_dropped + told_alive for s in told_dropped
    }
    revealed = coordinator.unmask(views)
    seed_holders = {s: r for s, r in revealed.items() if REVEALED_SEED + TARGET in r.tensors}
    key_holders = {s: r for s, r in revealed.items() if REVEALED_KEY + TARGET in r.tensors}
    estimate = None
    secret = coordinator.rebuild(seed_holders, REVEALED_SEED + TARGET, 2) if seed_holders else None
    key = coordinator.rebuild(key_holders, REVEALED_KEY + TARGET, 2) if key_holders else None
    if secret is not None and key is not None:
        peers = [s for s in SILOS if s != TARGET]
        estimate = coordinator.decode_alone(TARGET, secret, PrivateKey(key), peers)
    assert not decodes(estimate, true_update(c, TARGET), 1 / len(SILOS)), "decoded"
    assert not (seed_holders and key_holders), "both kinds of share of one silo were revealed"
    assert "consistency" in " ".join(coordinator.refusals["unmask"].values())


# -- e. a second aggregation of the same round --------------------------------------------------


def test_a_second_aggregation_of_the_same_round_is_refused() -> None:
    """After an honest aggregation of round 1, a second one over the other four silos would
    give the target's update as the difference of the two sums. The silos' contract names one
    task per step of the round's aggregation: asked again under those ids, each silo refuses
    them as answered already; under ids no position has (new task ids, same round and phase),
    as outside its contract. No second sum of the round is made either way."""
    c = consortium(secure_policy())
    weights = dict.fromkeys(SILOS, 1 / len(SILOS))
    first = DeviatingCoordinator(c)
    adverts = first.advertise(SILOS)
    first.share(dict.fromkeys(SILOS, adverts))
    first.mask(weights)
    everyone = first.unmask(dict.fromkeys(SILOS, SILOS))
    assert len(everyone) == len(SILOS), first.refusals  # the honest aggregation completes
    others = [s for s in SILOS if s != TARGET]
    same_ids, new_ids = DeviatingCoordinator(c), DeviatingCoordinator(c, tag="again-")
    for second in (same_ids, new_ids):
        adverts = second.advertise(others)
        second.share(dict.fromkeys(adverts, adverts))
        second.mask(dict.fromkeys(others, 1 / len(SILOS)))
        rest = (
            second.unmask(dict.fromkeys(second.masked, sorted(second.masked)))
            if second.masked
            else {}
        )
        estimate = None
        if len(rest) == len(others):
            estimate = first.sum_of(everyone, SILOS) - second.sum_of(rest, others)
        assert not decodes(estimate, true_update(c, TARGET), 1 / len(SILOS)), "difference decoded"
        assert set(second.refusals["advertise"]) == set(others)
    assert "answered already" in same_ids.refusals["advertise"]["silo-1"]
    assert "this position's task is" in new_ids.refusals["advertise"]["silo-1"]


def test_a_restarted_silo_still_refuses_a_second_aggregation_of_the_round(tmp_path: Path) -> None:
    """A restarted silo holds none of its round's secrets (memory only) and makes no others.
    Asked again for its keys under the round's task id, it repeats the answer it kept on disk
    (the same public keys), which it can no longer share; under an id no position has, it
    refuses the task; and its advertise step, run all the same, refuses a fresh key set: the
    aggregation steps it took are kept on disk too."""
    c = consortium(secure_policy(), state=tmp_path)
    adverts = DeviatingCoordinator(c).advertise(SILOS)
    assert len(adverts) == len(SILOS)
    again = restarted(c, TARGET, tmp_path)
    after_restart = DeviatingCoordinator(again)
    assert after_restart.advertise([TARGET]) == {TARGET: adverts[TARGET]}
    assert after_restart.share({TARGET: adverts}) == {}
    assert "out of order" in after_restart.refusals["share"][TARGET]
    invented = DeviatingCoordinator(again, tag="after-restart-")
    assert invented.advertise([TARGET]) == {}
    assert "this position's task is" in invented.refusals["advertise"][TARGET]
    message = TaskMessage.decode(message_to(TARGET, "secagg_advertise", {}, 1, again))
    with pytest.raises(StepAlreadyTaken, match="already took the advertise step"):
        TASK_KINDS["secagg_advertise"].handler(message, again.agents[TARGET].context)


def test_shares_made_under_another_view_of_the_keys_are_refused() -> None:
    c = consortium(secure_policy())
    coordinator = DeviatingCoordinator(c)
    adverts = coordinator.advertise(SILOS)
    without_last = {s: a for s, a in adverts.items() if s != "silo-4"}
    coordinator.share({s: (without_last if s == TARGET else adverts) for s in SILOS})
    coordinator.mask(dict.fromkeys(SILOS, 1 / len(SILOS)))
    assert TARGET not in coordinator.masked  # it saw no silo-4: silo-4's share is refused
    for peer in ("silo-1", "silo-2", "silo-3"):  # the target's shares were made for its view
        assert "under the advertisement set" in coordinator.refusals["mask"][peer]


def test_a_share_made_for_another_silo_is_refused() -> None:
    """The coordinator relays to the target, as silo-1's share for it, the share silo-1 made
    for silo-2: the target opens silo-1's shares with its own key and silo-1's only, so the
    share does not open and the target sends nothing."""
    c = consortium(secure_policy())
    coordinator = DeviatingCoordinator(c)
    adverts = coordinator.advertise(SILOS)
    coordinator.share(dict.fromkeys(SILOS, adverts))
    shares = coordinator.shared["silo-1"].tensors
    shares[SHARE_TO + TARGET] = shares[SHARE_TO + "silo-2"]
    coordinator.mask(dict.fromkeys(SILOS, 1 / len(SILOS)))
    assert TARGET not in coordinator.masked
    assert "does not open with silo-1's key" in coordinator.refusals["mask"][TARGET]


def test_a_silo_whose_own_keys_come_back_changed_shares_nothing() -> None:
    """A silo does not check its own advertisement's signature: it compares it with the bytes
    it sent. Relayed back changed (keys the coordinator made, or the silo's own genuine keys of
    an earlier round), it refuses to share, so nothing is encrypted to keys it does not hold
    for this aggregation. (A share task is answered once: each substitute is tried in a round
    of its own.)"""
    c = consortium(secure_policy())
    replayed = DeviatingCoordinator(c, round_no=1).advertise(SILOS)[TARGET]
    forged = MaskingKeys.generate().advertise(
        TARGET, SigningKey.generate(), aggregation_label(DEPLOYMENT, 2, PHASE)
    )
    for round_no, substitute in ((2, forged.to_bytes().hex()), (3, replayed)):
        coordinator = DeviatingCoordinator(c, round_no=round_no)
        adverts = coordinator.advertise(SILOS)
        shared = coordinator.share({TARGET: {**adverts, TARGET: substitute}})
        assert TARGET not in shared
        assert "this silo's own keys" in coordinator.refusals["share"][TARGET]


def test_confirmations_short_of_the_threshold_reveal_nothing() -> None:
    """The consistency check counts valid signatures over the silo's own statement, and stops
    only once it has t (4 of 5) of them: t - 1 genuine confirmations (the silo's own among
    them: it counts its own whether or not it is relayed back), padded with one moved to
    another silo's name and one forged, reveal no share."""
    c = consortium(secure_policy())
    coordinator = DeviatingCoordinator(c)
    adverts = coordinator.advertise(SILOS)
    coordinator.share(dict.fromkeys(SILOS, adverts))
    coordinator.mask(dict.fromkeys(SILOS, 1 / len(SILOS)))
    confirmed = coordinator.send("confirm", dict.fromkeys(SILOS, {"survivors": SILOS}))
    genuine = {s: tensor_bytes(r.tensors[CONFIRMATION]).hex() for s, r in confirmed.items()}
    assert sorted(genuine) == SILOS

    def short_of_the_threshold(silo: str) -> dict[str, str]:
        three = [silo, *[s for s in SILOS if s != silo][:2]]  # t - 1 genuine ones
        moved, forged = [s for s in SILOS if s not in three]
        signatures = {s: genuine[s] for s in three}
        signatures[moved] = genuine[three[1]]  # another's confirmation under moved's name
        signatures[forged] = SigningKey.generate().sign(b"anything").signature.hex()
        return signatures

    unmask = {s: {"survivors": SILOS, "signatures": short_of_the_threshold(s)} for s in SILOS}
    revealed = coordinator.send("unmask", unmask)
    assert revealed == {}
    refusals = coordinator.refusals["unmask"]
    assert sorted(refusals) == SILOS
    assert all("3 survivors signed" in why for why in refusals.values())


def test_a_new_job_aggregates_its_own_rounds_while_the_old_jobs_stay_claimed(
    tmp_path: Path,
) -> None:
    """A job is a policy the operator signed: the coordinator cannot make one, so a second
    job of the consortium starts its rounds afresh, and the first job's stay taken."""
    label = aggregation_label(DEPLOYMENT, 1, PHASE)
    AggregationLog(tmp_path, job="job-a").claim(label, "advertise")
    AggregationLog(tmp_path, job="job-b").claim(label, "advertise")
    with pytest.raises(StepAlreadyTaken, match="already took the advertise step"):
        AggregationLog(tmp_path, job="job-a").claim(label, "advertise")


# -- two tensors of one masked input ------------------------------------------------------------


def test_two_tensors_of_one_masked_input_do_not_share_a_mask() -> None:
    # SCAFFOLD masks the model's update and the control variate's change in one input. Masked
    # with the same streams, their difference, enc(w u) - enc(w dc), would reach the coordinator
    # without any share, and dc is -u / (K lr) from a zero control: the update itself.
    c = consortium(secure_policy(algorithm="scaffold"))
    coordinator = DeviatingCoordinator(c)
    adverts = coordinator.advertise(SILOS)
    shared = coordinator.share(dict.fromkeys(SILOS, adverts))
    zeros = torch.zeros_like(c.model)
    weights = dict.fromkeys(SILOS, 1 / len(SILOS))
    config = wrapping(c, TARGET, 1) | {
        "weights": weights,
        "shares": {
            u: tensor_bytes(shared[u].tensors[SHARE_TO + TARGET]).hex()
            for u in SILOS
            if u != TARGET
        },
        "tensors": ["model", "control_delta"],
    }
    assert config["inner_kind"] == "scaffold_train"
    tensors = {"control": zeros, "control_delta": zeros}
    message = message_to(TARGET, "secagg_mask", config, 1, c, tensors=tensors)
    reply = TaskResult.decode(c.agents[TARGET].handle_bytes(message))
    assert reply.ok, reply.error

    truth = trained_alone(c, TARGET, 1, {"control": zeros})
    encoding = FixedPoint.for_silos(c.policy.secure_aggregation.bound, len(SILOS))
    weight = weights[TARGET]
    update = (truth.tensors["model"].double() - c.model.double()).numpy()
    control = truth.tensors["control_delta"].double().numpy()
    leaked = encoding.encode(update, weight) - encoding.encode(control, weight)
    masked = {n: reply.tensors[n].numpy().view(np.uint32) for n in config["tensors"]}
    assert not np.array_equal(masked["model"] - masked["control_delta"], leaked)
