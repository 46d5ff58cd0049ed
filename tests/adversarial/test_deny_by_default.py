"""A silo does what its own signed policy asks, and nothing else (issue 36): the attacks a
deviating coordinator still had against unmodified silos, each written as that coordinator
would run it, through the real engine and protocol (tests/adversarial/rewriting.py), against
agents built by the simulation's own builder, with no DP and no colluding silo.

Each test asserts the attack fails: the silos refuse, or what the coordinator obtains does not
decode the target's update. (The same attack through a real `fedsilo silo start` process:
tests/adversarial/test_real_processes.py.)
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from nacl.public import PrivateKey
from nacl.signing import SigningKey

from fedsilo.coordinator.phases import Phase, PhaseOutcome, QuorumNotMet, Task, WeightedMean
from fedsilo.models.zoo import build_model, load_flat
from fedsilo.privacy.handoff import Binding, HandoffError, open_sealed, pack, seal, unpack
from fedsilo.privacy.masking import FixedPoint
from fedsilo.silo.evaluation import per_sample_loss_function
from fedsilo.wire.messages import SIMULATION, TaskMessage
from fedsilo.wire.tasks import (
    DaisyReceive,
    DaisyTrain,
    EncryptedInput,
    EvaluateTask,
    Handoff,
    LossProbe,
    MaskedInput,
    ScaffoldTrain,
    TrainTask,
)
from fedsilo.wire.tasks.tensor_names import CHECKPOINT, CONTROL, CONTROL_DELTA, HANDOFF, MODEL
from fedsilo.wire.tensors import bytes_tensor, tensor_bytes
from tests.adversarial.rewriting import Consortium, close, policy, trained_alone

TARGET = "silo-0"
METHODS = ["masking", "ckks"]
WRAPPERS = (MaskedInput, EncryptedInput)


def train_phase(c: Consortium, model, spec, silos=None, round_no: int = 1, name: str = "train"):
    """The honest FedAvg round's phase (its tasks as the strategy builds them)."""
    silos = silos or c.silos
    tasks = tuple(c.train_task(s, model, spec, round_no) for s in silos)
    return Phase(name, tasks, aggregate=WeightedMean((MODEL,)))


def attempt(c: Consortium, phase: Phase, round_no: int = 1, engine_policy=None) -> PhaseOutcome:
    """The phase through the engine (the coordinator's copy of the policy may deviate from
    the silos'); None when too few silos went along for any mean to come out."""
    engine = c.engine()
    if engine_policy is not None:
        engine.policy = engine_policy
    try:
        return engine.execute(phase, round_no)
    except QuorumNotMet:
        return None


def inner_rewritten(silos: set[str], **changes: object):
    """A rewrite of the wrapped train task (of a masked or encrypted input) sent to `silos`."""

    def rewrite(message: TaskMessage) -> TaskMessage:
        config = message.config
        if message.silo not in silos or not isinstance(config, WRAPPERS):
            return message
        inner = config.inner
        assert isinstance(inner, TrainTask)
        local = {k: v for k, v in changes.items() if k in ("lr", "epochs", "steps", "seed")}
        options = {k: v for k, v in changes.items() if k not in local}
        inner = replace(inner, local=replace(inner.local, **local), **options)
        return replace(message, config=replace(config, inner=inner))

    return rewrite


def weights_rewritten(weights: dict[str, float]):
    def rewrite(message: TaskMessage) -> TaskMessage:
        if isinstance(message.config, WRAPPERS):
            return replace(message, config=replace(message.config, weights=weights))
        return message

    return rewrite


# -- 1. the policy's min_silos is every silo's minimum group -------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_a_sum_of_fewer_silos_than_the_policys_min_silos_is_refused(method: str) -> None:
    """The silos' policy says min_silos 3; the coordinator runs its engine with min_silos 2 and
    sums two silos (masking: 2 of 2 is a threshold a coordinator can meet alone with one silo
    dropped; either way the weights then single out a silo within one other's update)."""
    signed = policy(method, participants={"min_silos": 3, "phase_timeout_s": 60})
    c = Consortium(signed)
    model, spec = c.initial_model()
    deviating = signed.model_copy(update={"participants": signed.participants.model_copy(
        update={"min_silos": 2})})  # fmt: skip
    outcome = attempt(c, train_phase(c, model, spec, silos=c.silos[:2]), engine_policy=deviating)
    assert outcome is None, "two silos summed under a policy whose min_silos is 3"
    assert any("3" in why for why in c.refusals().values()), c.refusals()


# -- 2. weight keys that are no member of the sum --------------------------------------------------


GHOSTS = {
    "a negative weight for a non-member": {TARGET: 1.0, "silo-1": 1 / 6, "silo-2": 1 / 6,
                                           "ghost": -1 / 3},
    "a NaN weight for a non-member": {TARGET: 1.0, "silo-1": 1.0, "silo-2": 1.0,
                                      "ghost": math.nan},
}  # fmt: skip


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("weights", list(GHOSTS.values()), ids=list(GHOSTS))
def test_weights_with_a_key_outside_the_sum_are_refused(method: str, weights) -> None:
    c = Consortium(policy(method))
    model, spec = c.initial_model()
    c.rewrite = weights_rewritten(weights)
    outcome = attempt(c, train_phase(c, model, spec))
    assert outcome is None, "weights with a key outside the sum were applied"
    kind = "secagg_mask" if method == "masking" else "ckks_encrypt"
    assert set(c.refusals(kind)) == set(c.silos), c.refusals()


# -- 3. training settings that differ between the silos of one sum ------------------------------


SETTINGS = {"lr 0": {"lr": 0.0}, "update_scale 0": {"update_scale": 0.0}}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("changes", list(SETTINGS.values()), ids=list(SETTINGS))
def test_training_settings_that_silence_the_other_silos_give_no_single_update(
    method: str, changes: dict
) -> None:
    c = Consortium(policy(method))
    model, spec = c.initial_model()
    others = set(c.silos) - {TARGET}
    c.rewrite = inner_rewritten(others, **changes)
    phase = train_phase(c, model, spec)
    outcome = attempt(c, phase)
    truth = trained_alone(c, TARGET, phase.tasks[0])[MODEL].double() - model.double()
    if outcome is not None:
        kind = "secagg_mask" if method == "masking" else "ckks_encrypt"
        sent = {a.message.silo: a.message.config for a in c.answers if a.message.kind == kind}
        weight = sent[TARGET].weights[TARGET]
        estimate = (outcome.mean[MODEL].double() - model.double()).numpy()
        assert not close(estimate, weight * truth.numpy()), "the target's update decoded"
    refused = " ".join(c.refusals().values())
    assert set(c.refusals()) >= others and next(iter(changes)) in refused, c.refusals()


# -- 4. a received tensor of another shape than the result --------------------------------------


def one_element_references(c: Consortium, model, spec, kind: str) -> Phase:
    """Every silo's phase sums a second tensor whose reference is one element long."""
    if kind == "checkpoint_step":
        tasks = []
        for silo in c.silos:
            honest = c.train_task(silo, model, spec)
            config = replace(honest.config, checkpoint_step=honest.config.local.epochs)
            tasks.append(replace(honest, config=config))
        return Phase(
            "train",
            tuple(tasks),
            aggregate=WeightedMean((MODEL, CHECKPOINT), references={CHECKPOINT: torch.zeros(1)}),
        )
    tasks = tuple(
        replace(
            c.train_task(s, model, spec),
            config=ScaffoldTrain(local=c.train_task(s, model, spec).config.local),
            tensors={MODEL: model, CONTROL: torch.zeros_like(model)},
        )
        for s in c.silos
    )
    return Phase(
        "train",
        tasks,
        aggregate=WeightedMean((MODEL, CONTROL_DELTA), references={CONTROL_DELTA: torch.zeros(1)}),
    )


@pytest.mark.parametrize("kind", ["checkpoint_step", "scaffold_train"])
def test_a_one_element_reference_does_not_spread_one_mask_over_every_coordinate(kind: str) -> None:
    c = Consortium(policy("masking", training={"epochs": 1, "batch_size": 512, "lr": 0.1}))
    model, spec = c.initial_model()
    attempt(c, one_element_references(c, model, spec, kind))
    second = CHECKPOINT if kind == "checkpoint_step" else CONTROL_DELTA
    masked = c.answered("secagg_mask").get(TARGET)
    if masked is not None:  # what the coordinator holds: the target's masked input
        sent = next(a.message for a in c.answers if a.message.kind == "secagg_mask"
                    and a.message.silo == TARGET)  # fmt: skip
        task = Task(TARGET, sent.config.inner, {MODEL: model, CONTROL: torch.zeros_like(model)},
                    spec)  # fmt: skip
        alone = trained_alone(c, TARGET, task)
        reference = model if second == CHECKPOINT else torch.zeros_like(model)
        update = (alone[second].double() - reference.double()).numpy()
        encoding = FixedPoint.for_silos(c.policy.secure_aggregation.bound, len(c.silos))
        encoded = encoding.encode(update, sent.config.weights[TARGET])
        leaked = masked.tensors[second].numpy().view(np.uint32)
        assert not (
            leaked.shape == encoded.shape
            and np.array_equal(leaked - leaked[0], encoded - encoded[0])
        ), "the masked input, less its first coordinate, is the target's encoded update"
    assert TARGET in c.refusals("secagg_mask"), c.refusals()


# -- 5. loss and evaluation answers as an oracle ------------------------------------------------


def probes(c: Consortium, model, spec, kind: str, eps: float = 1e-3):
    """Central differences of the target's training loss along every parameter: 2P answers,
    each to a task of its own (a task id per probe, as a coordinator may name them)."""
    config = LossProbe() if kind == "loss" else EvaluateTask(split="train")
    gradient = np.zeros(model.numel())
    for i in range(model.numel()):
        losses = []
        for sign in (1.0, -1.0):
            probe = model.clone()
            probe[i] += sign * eps
            message = c.message(TARGET, config, phase=kind if kind == "loss" else "evaluate",
                                tensors={MODEL: probe}, spec=spec)  # fmt: skip
            message = replace(message, task_id=f"{message.task_id}/probe-{i}-{sign:+}")
            answer = c.ask(message)
            if not answer.ok:
                return None
            losses.append(answer.metrics["loss"])
        gradient[i] = (losses[0] - losses[1]) / (2 * eps)
    return gradient


def true_gradient(c: Consortium, model, spec) -> np.ndarray:
    data = c.datasets[TARGET]
    net = build_model(c.policy.model, data.input_shape, data.output_dim, 0)
    load_flat(net, model.clone())
    loss = per_sample_loss_function(data.task)(net(data.x_train), data.y_train).mean()
    loss.backward()
    return spec.flatten({n: p.grad for n, p in net.named_parameters()}).double().numpy()


@pytest.mark.parametrize("kind", ["loss", "evaluate"])
def test_loss_and_evaluation_answers_are_no_gradient_oracle(kind: str) -> None:
    c = Consortium(policy("masking"))
    model, spec = c.initial_model()
    estimate = probes(c, model, spec, kind)
    if estimate is not None:
        truth = true_gradient(c, model, spec)
        assert not close(estimate, truth, tolerance=0.05), "the training gradient decoded"
    assert c.refusals(kind), "every probe was answered"


# -- 6. a sealed hand-off under a policy that hands no model on ---------------------------------


def test_a_silo_whose_algorithm_hands_no_model_on_seals_none_to_another_silo() -> None:
    c = Consortium(policy("masking"))
    model, spec = c.initial_model()
    colluder = "silo-1"
    honest = c.train_task(TARGET, model, spec)
    key = bytes(c.keys.sealing_roster[colluder]).hex()
    config = DaisyTrain(train=honest.config, adopt=True, handoff=Handoff(seal_to=key))
    answer = c.ask(c.message(TARGET, config, tensors={MODEL: model}, spec=spec))
    if answer.ok and HANDOFF in answer.tensors:
        sealed = tensor_bytes(answer.tensors[HANDOFF])
        try:
            opened = unpack(open_sealed(sealed, PrivateKey(c.keys.sealing[colluder])),
                            Binding(SIMULATION, 1, "train", colluder), c.keys.roster)  # fmt: skip
        except HandoffError:
            opened = None
        assert opened is None, "the colluding silo opened the target's trained model"
    assert not answer.ok, "the silo handed its model on under FedAvg"


# -- the phase and the round: each aggregation of the policy once --------------------------------


def difference_of_two_sums(c: Consortium, model, spec, round_no: int, phase: str):
    """The honest round-1 sum over every silo, then the same round-1 tasks summed again over
    the others, named `phase` in round `round_no`: the target's update is the difference."""
    first = attempt(c, train_phase(c, model, spec))
    others = [s for s in c.silos if s != TARGET]
    again = Phase(phase, train_phase(c, model, spec, silos=others).tasks,
                  aggregate=WeightedMean((MODEL,)))  # fmt: skip
    second = attempt(c, again, round_no=round_no)
    if first is None or second is None:
        return None
    counts = {s: r.num_samples for s, r in c.answered("secagg_advertise").items()}
    everyone, rest = sum(counts.values()), sum(counts[s] for s in others)
    delta = lambda out: (out.mean[MODEL].double() - model.double()).numpy()  # noqa: E731
    return (everyone * delta(first) - rest * delta(second)) / counts[TARGET]


@pytest.mark.parametrize(
    ("round_no", "phase"), [(1, "train-again"), (505, "train")], ids=["invented phase", "round 505"]
)
def test_a_phase_or_round_outside_the_policy_aggregates_nothing(round_no: int, phase: str) -> None:
    c = Consortium(policy("masking"))
    model, spec = c.initial_model()
    estimate = difference_of_two_sums(c, model, spec, round_no, phase)
    if estimate is not None:
        truth = trained_alone(c, TARGET, train_phase(c, model, spec).tasks[0])[MODEL]
        assert not close(estimate, (truth.double() - model.double()).numpy()), "decoded"
    assert c.refusals("secagg_advertise"), "the second aggregation was advertised"


# -- a model the coordinator hands a silo itself ------------------------------------------------


def cyclic_policy():
    """Cyclic weight transfer over the three silos, sealed hand-offs, no secure sum."""
    return policy(
        "none",
        algorithm={"name": "cyclic"},
        participants={"min_silos": 1, "phase_timeout_s": 60},
        channel={"sealed_handoffs": True},
    )


def test_a_model_the_coordinator_hands_on_itself_is_not_trained_and_sent_back() -> None:
    """Cyclic: visit_0 starts the cycle at silo-1; the coordinator keeps silo-1's sealed model
    and delivers to the target, as silo-1's hand-off, a model of its own sealed to the target's
    key (anyone can seal to a public key); the target's visit_1 is the cycle's last, so it
    would train that model and send it back: the target's exact update."""
    c = Consortium(cyclic_policy())
    model, spec = c.initial_model()
    first, target = "silo-1", TARGET
    honest = c.train_task(first, model, spec)
    key = bytes(c.keys.sealing_roster[target]).hex()
    start = DaisyTrain(train=honest.config, adopt=True, handoff=Handoff(seal_to=key))
    assert c.ask(c.message(first, start, phase="visit_0", tensors={MODEL: model}, spec=spec)).ok
    bound = Binding(SIMULATION, 1, "visit_0", target)  # as silo-1 would bind it, but unsigned
    forged = pack(model, bound, first, SigningKey.generate(), b"")
    forged = seal(forged, c.keys.sealing_roster[target])
    delivery = DaisyReceive(sealed=True)
    c.ask(c.message(target, delivery, phase="visit_0", step="deliver",
                    tensors={HANDOFF: bytes_tensor(forged)}))  # fmt: skip
    last = DaisyTrain(train=c.train_task(target, model, spec).config, send=True)
    answer = c.ask(c.message(target, last, phase="visit_1", spec=spec))
    if answer.ok:  # FedAvg's train task at the same round is the same training of the target
        fedavg = Consortium(policy("none"))
        task = fedavg.train_task(target, model, spec)
        truth = trained_alone(fedavg, target, task)
        update = (answer.tensors[MODEL].double() - model.double()).numpy()
        own = (truth[MODEL].double() - model.double()).numpy()
        assert not close(update, own), "the target trained the coordinator's model and sent it"
    assert not answer.ok, "the target trained a model no member handed it"


# -- different models for the silos of one sum --------------------------------------------------


def dead(model: torch.Tensor, spec) -> torch.Tensor:
    """`model` with every hidden unit switched off (first-layer biases -1e4): trained, it moves
    only its output bias, so the silos sent it add nothing to a sum but there."""
    tensors = {n: t.clone() for n, t in spec.unflatten(model.clone()).items()}
    tensors["1.bias"].fill_(-1e4)
    return spec.flatten(tensors)


@pytest.mark.parametrize("method", METHODS)
def test_different_models_for_the_silos_of_one_sum_unmask_no_update(method: str) -> None:
    """Pasquini et al. (CCS 2022): every silo but the target is sent a model whose update is
    zero (but for its output bias), so the sum would be the target's update alone; five silos,
    so the four others outnumber the threshold among themselves."""
    c = Consortium(
        policy(
            method,
            model={"name": "mlp", "hidden": [8]},
            data={"source": "sklearn:breast_cancer", "partition": {"kind": "iid", "silos": 5}},
        )
    )
    model, spec = c.initial_model()
    honest = train_phase(c, model, spec)
    silenced = dead(model, spec)
    tasks = tuple(
        t if t.silo == TARGET else replace(t, tensors={MODEL: silenced}) for t in honest.tasks
    )
    outcome = attempt(c, replace(honest, tasks=tasks))
    if outcome is not None:
        kind = "secagg_mask" if method == "masking" else "ckks_encrypt"
        weight = next(a.message.config.weights[TARGET] for a in c.answers if a.message.kind == kind)
        truth = trained_alone(c, TARGET, honest.tasks[0])[MODEL].double() - model.double()
        estimate = outcome.mean[MODEL].double() - model.double()
        moved = slice(0, spec.numel - 2)  # every parameter but the output bias
        assert not close(estimate[moved].numpy(), weight * truth[moved].numpy()), "decoded"
    assert outcome is None, "a sum of silos sent different models was unmasked"
