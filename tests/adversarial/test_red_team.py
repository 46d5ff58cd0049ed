"""Attacks found by trying the silo contract again from outside (issue 36's red team), each
written as a deviating coordinator would run it, through the real engine and protocol
(tests/adversarial/rewriting.py), against unmodified silos built by the simulation's own
builder, with no DP and no colluding silo. Each leaked on the first contract and each test
asserts it now fails: the silos refuse, or what the coordinator obtains does not decode the
target's update.

- FedDC: models adopted per silo in a `local` phase before an honest secure sum (a
  model-inconsistency attack the task digest does not see). Defence: a silo sends into a
  secure sum only a hosted model that descends from the sum's reference (its root, carried in
  signed hand-offs).
- CKKS: a second decryptor asked to decrypt a sub-sum of the same signed inputs (the first
  decryptor asked again holds: its position is answered once). Defence: every contributor
  confirms one set of contributors per aggregation, and a decryptor decrypts only a set every
  contributor confirmed.
- AgnosticFedAvg over the data's domains: domain weights that leave one domain, held by one
  silo. Defence: the policy refuses it under secure aggregation, and a silo's contract gives
  the coordinator no domain weights inside a secure sum.
- cyclic: three cycles in one round, each silo in two of them. Defence: a silo takes one visit
  a round, recorded in its aggregation log.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from sklearn.datasets import load_breast_cancer

from fedsilo.coordinator.phases import Phase, QuorumNotMet, Task, WeightedMean
from fedsilo.coordinator.strategies import make_strategy
from fedsilo.wire.messages import TaskResult
from fedsilo.wire.tasks import CkksDecrypt, DaisyReceive, DaisyTrain, EncryptedInput, Handoff
from fedsilo.wire.tasks import MaskedInput as MaskedInputConfig
from fedsilo.wire.tasks.tensor_names import HANDOFF, MODEL, SUM
from tests.adversarial.rewriting import Consortium, close, policy, trained_alone
from tests.adversarial.test_deny_by_default import cyclic_policy, dead

TARGET = "silo-0"
METHODS = ["masking", "ckks"]
SECURE_STEP = {"masking": "secagg_mask", "ckks": "ckks_encrypt"}
WRAPPERS = (MaskedInputConfig, EncryptedInput)


def run(c: Consortium, phase: Phase, round_no: int):
    """The phase through the real engine; None when too few silos went along."""
    try:
        return c.engine().execute(phase, round_no)
    except QuorumNotMet:
        return None


def sent_weights(c: Consortium, method: str) -> dict[str, float]:
    """The weight vector the engine sent with the masked or encrypted inputs."""
    kind = SECURE_STEP[method]
    config = next(a.message.config for a in c.answers if a.message.kind == kind)
    assert isinstance(config, WRAPPERS)
    return dict(config.weights)


# -- 1. FedDC: hosted models seeded per silo, then an honest secure sum ---------------------------


def feddc_policy(method: str):
    """FedDC with an aggregation every second round and no hand-offs (FedAvg with two local
    rounds per aggregation), an MLP, five silos, `method` secure aggregation."""
    return policy(
        method,
        algorithm={"name": "feddc", "daisy_period": None, "aggregation_period": 2},
        model={"name": "mlp", "hidden": [8]},
        training={"steps": 2, "batch_size": 16, "lr": 0.1},
        channel={"sealed_handoffs": True},
        data={"source": "sklearn:breast_cancer", "partition": {"kind": "iid", "silos": 5}},
    )


def feddc_task(c: Consortium, silo: str, round_no: int, model, spec, *, adopt=None, send=False):
    """FedDC's `daisy_train` for `silo` in `round_no` as the strategy builds it: the derived
    training, adopting `adopt` when given, sending the trained model when `send`."""
    base = make_strategy(c.policy).train_task(silo, model, spec, c.context(round_no))
    config = DaisyTrain(train=base.config, adopt=adopt is not None, send=send)
    return Task(silo, config, {} if adopt is None else {MODEL: adopt}, spec)


@pytest.mark.parametrize("method", METHODS)
def test_feddc_models_adopted_per_silo_before_an_honest_sum_unmask_no_update(method: str) -> None:
    """Pasquini et al.'s model inconsistency, moved out of the sum: in round 1's `local` phase
    (no sum, so no consistency check) the target adopts the initial model A and every other
    silo the same A with its hidden units switched off (`dead`, whose training moves only the
    output bias). Round 2's aggregate is then exactly the honest one (every silo sends its
    hosted model relative to A, the same task bytes for all, so every statement and
    contribution agrees), but the four others' inputs are clip(dead - A), known to the
    coordinator but for the output bias: the sum, less them, is the target's two local rounds
    of training from A."""
    c = Consortium(feddc_policy(method))
    model, spec = c.initial_model()
    silenced = dead(model, spec)
    start = {s: model if s == TARGET else silenced for s in c.silos}
    local = Phase("local", tuple(feddc_task(c, s, 1, model, spec, adopt=start[s]) for s in c.silos))
    if run(c, local, 1) is None:
        return  # the silos refused the adoptions: the attack failed
    mean = WeightedMean((MODEL,), dict.fromkeys(c.silos, 1.0), references={MODEL: model})
    tasks = tuple(feddc_task(c, s, 2, model, spec, send=True) for s in c.silos)
    outcome = run(c, Phase("aggregate", tasks, aggregate=mean), 2)
    if outcome is None:
        return
    weights = sent_weights(c, method)
    bound = c.policy.secure_aggregation.bound
    known = (silenced.double() - model.double()).clamp(-bound, bound)  # each other's input
    summed = (outcome.mean[MODEL].double() - model.double()) * sum(weights.values())
    others = sum(w for s, w in weights.items() if s != TARGET)
    estimate = (summed - others * known) / weights[TARGET]
    # the target alone, without secure aggregation: the same two rounds from A
    plain = Consortium(c.policy.model_copy(update={"secure_aggregation": policy("none")
                                                   .secure_aggregation}))  # fmt: skip
    for round_no, phase, task in (
        (1, "local", feddc_task(plain, TARGET, 1, model, spec, adopt=model)),
        (2, "aggregate", feddc_task(plain, TARGET, 2, model, spec, send=True)),
    ):
        answer = plain.ask(plain.message(TARGET, task.config, round_no=round_no, phase=phase,
                                         tensors=task.tensors, spec=spec))  # fmt: skip
        if not answer.ok:
            pytest.fail(f"the honest control failed: {answer.error}")
    truth = answer.tensors[MODEL].double() - model.double()
    moved = slice(0, spec.numel - 2)  # every parameter but the output bias
    assert not close(estimate[moved].numpy(), truth[moved].numpy()), "the target's update decoded"


# -- 2. CKKS: a second decryptor for a sub-sum of the same signed inputs --------------------------


def honest_ckks_round(c: Consortium, model, spec):
    """Round 1 of FedAvg under CKKS, run honestly: its phase, every encrypted input by silo, the
    decrypt answer and the weight vector."""
    honest = Phase(
        "train",
        tuple(c.train_task(s, model, spec) for s in c.silos),
        aggregate=WeightedMean((MODEL,)),
    )
    if run(c, honest, 1) is None:
        pytest.fail(f"the honest CKKS round failed: {c.refusals()}")
    encrypted = {a.message.silo: a for a in c.answers if a.message.kind == "ckks_encrypt"}
    (first,) = [a for a in c.answers if a.message.kind == "ckks_decrypt" and a.result.ok]
    return honest, encrypted, first, sent_weights(c, "ckks")


def sub_sum(c: Consortium, decryptor: str, encrypted, first, weights) -> TaskResult:
    """Ask `decryptor` (at its own decrypt position) for the sum of the signed inputs of every
    silo but the target."""
    others = sorted(s for s in encrypted if s != TARGET)
    inputs = {f"{s}/{n}": t for s in others for n, t in encrypted[s].result.tensors.items()}
    config = CkksDecrypt(
        length=first.message.config.length, weights=weights, contributors=tuple(others)
    )
    return c.ask(c.message(decryptor, config, step="decrypt", tensors=inputs))


def test_the_decryptor_asked_again_for_a_sub_sum_answers_the_first_sum() -> None:
    """The attack below with the silo that decrypted already: its decrypt position is answered
    once, so the sub-sum's task (the same id, other contributors) is refused as answered (or,
    with an answer store, gets the first answer's bytes back, the full sum again). What holds
    per silo; the leak below is across silos."""
    c = Consortium(policy("ckks"))
    model, spec = c.initial_model()
    _, encrypted, first, weights = honest_ckks_round(c, model, spec)
    again = sub_sum(c, first.message.silo, encrypted, first, weights)
    if again.ok:
        assert torch.equal(again.tensors[SUM], first.result.tensors[SUM]), "a second sum"
    else:
        assert "answered already" in (again.error or ""), again.error


def test_a_second_decryptor_decrypts_no_sub_sum_of_the_same_inputs() -> None:
    """An honest CKKS round over three silos (min_silos 2): the key holder decrypts the sum of
    all three. The coordinator then sends a second silo of the sum its own decrypt task (its
    position's id: each silo decrypts once, and a failed decryptor is replaced by design) with
    the same signed inputs of the two silos other than the target; both sums pass every check
    (signatures, weight vector, min_group), and their difference is the target's weighted
    update."""
    c = Consortium(policy("ckks"))
    model, spec = c.initial_model()
    honest, encrypted, first, weights = honest_ckks_round(c, model, spec)
    second = next(s for s in c.silos if s != first.message.silo)
    answer = sub_sum(c, second, encrypted, first, weights)
    if not answer.ok:
        return
    difference = first.result.tensors[SUM].double() - answer.tensors[SUM].double()
    truth = trained_alone(c, TARGET, honest.tasks[0])[MODEL].double() - model.double()
    estimate = (difference / weights[TARGET]).numpy()
    assert not close(estimate, truth.numpy()), "the target's update decoded"


# -- 3. AgnosticFedAvg: domain weights that keep one silo's domain only ---------------------------


def sites_csv(folder: Path) -> Path:
    """breast_cancer's first six features, a `site` column (rows dealt to three sites) and a
    `scanner` column: site silo-0 scans on C only, the others on A and B (a domain column that
    is site-specific, as a scanner vendor or protocol often is)."""
    bunch = load_breast_cancer()
    frame = pd.DataFrame(bunch.data[:, :6], columns=[f"f{i}" for i in range(6)])
    site = np.arange(len(frame)) % 3
    frame["site"] = [f"silo-{s}" for s in site]
    frame["scanner"] = ["C" if s == 0 else "AB"[i % 2] for i, s in enumerate(site)]
    frame["label"] = bunch.target
    path = folder / "sites.csv"
    frame.to_csv(path, index=False)
    return path


def domains_policy(folder: Path, method: str):
    """AgnosticFedAvg over the `scanner` domains, one silo per site, `method` secure
    aggregation. (The policy reader fails with an AttributeError on an explicit natural
    partition under secure aggregation, `policies/schema.py: _check_secure_aggregation`, so the
    section is set after reading; a deployment has no partition, each silo is its site.)"""
    data = {
        "source": "csv",
        "path": str(sites_csv(folder)),
        "target": "label",
        "categorical": {"scanner": ["A", "B", "C"]},
        "domain": "scanner",
        "partition": {"kind": "natural", "column": "site"},
    }
    read = policy("none", algorithm={"name": "agnostic_fedavg", "domains": "data"}, data=data)
    return read.model_copy(update={"secure_aggregation": policy(method).secure_aggregation})


@pytest.mark.parametrize("method", METHODS)
def test_domain_weights_that_keep_one_silos_domain_give_no_single_update(
    method: str, tmp_path: Path
) -> None:
    """Like `lr: 0` for the other silos (refused: test_deny_by_default.py), through a field the
    contract gives the coordinator: domain weights {A: 0, B: 0, C: 1}, the same for every silo
    of the sum (so the task digests agree), within the contract's bound (finite, non-negative,
    not all zero). The two silos without C rows train on a loss that is 0 everywhere and send
    a zero update; the sum is the target's update alone, all of its rows being C."""
    c = Consortium(domains_policy(tmp_path, method))
    model, spec = c.initial_model()
    strategy = make_strategy(c.policy)

    def task(silo: str, domain_weights: dict[str, float]) -> Task:
        honest = strategy.train_task(silo, model, spec, c.context(1))
        return replace(honest, config=replace(honest.config, domain_weights=domain_weights))

    one_hot = {"A": 0.0, "B": 0.0, "C": 1.0}
    phase = Phase("train", tuple(task(s, one_hot) for s in c.silos), WeightedMean((MODEL,)))
    outcome = run(c, phase, 1)
    if outcome is None:
        return
    weights = sent_weights(c, method)
    summed = (outcome.mean[MODEL].double() - model.double()) * sum(weights.values())
    estimate = (summed / weights[TARGET]).numpy()
    # the target's own update under equal domain weights (its rows are all C: the same training)
    equal = task(TARGET, dict.fromkeys("ABC", 1.0))
    truth = trained_alone(c, TARGET, equal)[MODEL].double() - model.double()
    assert not close(estimate, truth.numpy()), "the target's update decoded"


# -- 4. cyclic: three cycles in one round --------------------------------------------------------


def relative_error(estimate: torch.Tensor, truth: torch.Tensor) -> float:
    return float((estimate - truth).norm() / truth.norm())


def test_three_cycles_in_one_round_do_not_give_one_silos_update() -> None:
    """Cyclic promises the coordinator a model at least two silos trained this round, never one
    silo's update. Each silo's `visit_0` and `visit_1` are positions of their own, so three
    cycles fit in one round: T -> X, X -> Y and Y -> T, each first visit adopting the round's
    model M and sealing its training to the next silo (signed, delivered), each second visit
    training what it was handed and sending it. With d_s silo s's update of M (each silo's two
    visits share the round's minibatch seed), the three answers are M + d_T + d_X, M + d_X +
    d_Y and M + d_Y + d_T up to second-order terms (a silo trains a model one update away
    from M), so (R1 - R2 + R3 - M) / 2 is d_T to first order."""
    c = Consortium(cyclic_policy())
    model, spec = c.initial_model()
    t, x, y = c.silos
    following = {t: x, x: y, y: t}
    handed = {}
    for silo in c.silos:  # every first visit: adopt M, train, seal to the next silo
        key = bytes(c.keys.sealing_roster[following[silo]]).hex()
        config = DaisyTrain(train=c.train_task(silo, model, spec).config, adopt=True,
                            handoff=Handoff(seal_to=key))  # fmt: skip
        answer = c.ask(c.message(silo, config, phase="visit_0", tensors={MODEL: model}, spec=spec))
        if not answer.ok:
            return  # a first visit refused: the attack failed
        handed[following[silo]] = answer.tensors[HANDOFF]
    sent = {}
    for silo in c.silos:  # deliveries, then every second visit: train what was handed, send
        delivery = DaisyReceive(sealed=True)
        c.ask(c.message(silo, delivery, phase="visit_0", step="deliver",
                        tensors={HANDOFF: handed[silo]}))  # fmt: skip
        config = DaisyTrain(train=c.train_task(silo, model, spec).config, send=True)
        answer = c.ask(c.message(silo, config, phase="visit_1", spec=spec))
        if answer.ok:
            sent[silo] = answer.tensors[MODEL].double()
    if len(sent) < 3:
        return
    m = model.double()
    estimate = (sent[x] - sent[y] + sent[t] - m) / 2  # R1 = X's, R2 = Y's, R3 = T's answer
    fedavg = Consortium(policy("none"))  # the same training of the target, alone
    truth = trained_alone(fedavg, t, fedavg.train_task(t, model, spec))[MODEL].double() - m
    assert relative_error(estimate, truth) > 0.5, "one silo's update decoded (to first order)"
