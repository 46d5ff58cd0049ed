"""Task contracts (fedsilo/wire/tasks): one typed config per task kind, exactly one JSON object
on the wire.

Every kind a silo handles has a config class; a config survives JSON both ways; the dict each
strategy builds today (copied from its builder) decodes and re-encodes to itself; every config
the real strategies send while simulating the example policies does too; an unknown key, a
missing one or a value of the wrong type is refused, naming the kind and the key.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import fedsilo.ops.simulate as simulate_module
from fedsilo.coordinator.transport import InProcessTransport
from fedsilo.ops.simulate import load_silos, simulate
from fedsilo.policies.loading import load_policy
from fedsilo.policies.schema import Policy
from fedsilo.silo.tasks import TASK_KINDS
from fedsilo.wire.tasks import (
    TASK_CONFIGS,
    BoostProbe,
    CkksConfirm,
    CkksDecrypt,
    CkksJoin,
    CkksKeygen,
    DaisyEvaluate,
    DaisyReceive,
    DaisyTrain,
    EncryptedInput,
    EnergySignals,
    EvaluateTask,
    FeatureMoments,
    FedDroSupport,
    FedDroTrain,
    Handoff,
    InitTask,
    LocalTraining,
    LossProbe,
    MaskedInput,
    NextAggregation,
    ScaffoldTrain,
    SchemaTask,
    SecAggAdvertise,
    SecAggConfirm,
    SecAggShare,
    SecAggUnmask,
    Standardise,
    SuperFedEvaluate,
    SuperFedTrain,
    TaskConfig,
    TrainTask,
    decode_task_config,
)
from fedsilo.wire.tensors import WireError, decode_tensors

LOCAL = LocalTraining(epochs=1, steps=None, batch_size=32, optimizer="sgd", lr=0.1, seed=11)
SILOS = ("silo-1", "silo-2", "silo-3")
WEIGHTS = {"silo-1": 0.5, "silo-2": 0.25, "silo-3": 0.25}

# One config of every kind, its optional keys set where it has any.
EXAMPLES: list[TaskConfig] = [
    InitTask(seed=7),
    SchemaTask(),
    TrainTask(local=LOCAL),
    TrainTask(
        local=LOCAL,
        mixup_alpha=0.5,
        mixup_on="embedding",
        checkpoint_step=0,
        update_scale=1.0,
        cohort=1,
    ),
    TrainTask(local=LOCAL, domain_weights={"f": 1.5, "m": 0.5}),
    TrainTask(local=LOCAL, domain_temperature=10.0, domain_reduction="mean"),
    EvaluateTask(split="val"),
    LossProbe(),
    LossProbe(mixup_alpha=1.0, seed=3, mixup_on="inputs"),
    LossProbe(by_domain=True),
    FeatureMoments(),
    Standardise(),
    SecAggAdvertise(),
    SecAggShare(advertisements={"silo-1": "ab", "silo-2": "cd"}),
    MaskedInput(
        inner=TrainTask(local=LOCAL), weights=WEIGHTS, shares={"silo-2": "ef"}, tensors=("model",)
    ),
    SecAggConfirm(survivors=SILOS),
    SecAggUnmask(survivors=SILOS, signatures={"silo-1": "01"}),
    SecAggUnmask(
        survivors=SILOS,
        signatures={"silo-1": "01"},
        advertise_next=NextAggregation(round=2, phase="train"),
    ),
    CkksKeygen(recipients=SILOS),
    CkksJoin(key_holder="silo-1", context_digest="d1"),
    EncryptedInput(inner=FeatureMoments(), weights=WEIGHTS, tensors=("count", "sum", "sumsq")),
    CkksConfirm(contributors=SILOS),
    CkksDecrypt(length=42, weights=WEIGHTS, contributors=SILOS),
    DaisyTrain(train=TrainTask(local=LOCAL), adopt=True),
    DaisyTrain(train=TrainTask(local=LOCAL), send=True, handoff=Handoff(seal_to="aa")),
    DaisyTrain(train=TrainTask(local=LOCAL), handoff=Handoff()),
    DaisyReceive(sealed=True),
    DaisyEvaluate(split="train"),
    SuperFedTrain(local=LOCAL, mixing="layer", mixing_on=True, local_seed=9, ortho_nu=0.5),
    SuperFedEvaluate(local_seed=9, lambda_grid=5, min_validation=3),
    ScaffoldTrain(local=LOCAL),
    BoostProbe(),
    BoostProbe(split="test", evaluate=True, edges=(0, 3)),
    EnergySignals(
        local=LOCAL,
        sgld_steps=1,
        sgld_step=1.0,
        sgld_noise=0.01,
        gradient_clip=3.0,
        synthetic_ce_weight=0.1,
        model_seed=4,
        spectral_norm=True,
    ),
    FedDroSupport(),
    FedDroTrain(local=LOCAL),
]


def test_every_kind_a_silo_handles_has_one_config_class() -> None:
    assert set(TASK_CONFIGS) == set(TASK_KINDS)
    assert all(kind == cls.KIND for kind, cls in TASK_CONFIGS.items())
    assert {type(config) for config in EXAMPLES} == set(TASK_CONFIGS.values())


@pytest.mark.parametrize("config", EXAMPLES, ids=lambda c: c.KIND)
def test_a_config_survives_json_both_ways(config: TaskConfig) -> None:
    text = json.dumps(config.to_json(), sort_keys=True)
    decoded = decode_task_config(config.KIND, json.loads(text))
    assert decoded == config
    assert json.dumps(decoded.to_json(), sort_keys=True) == text


# -- the dicts the strategies build today ------------------------------------------------------

# Strategy.train_task: the policy's training section, prox_mu and the seed, always all of them.
TRAIN = {
    "epochs": 1,
    "steps": None,
    "batch_size": 32,
    "optimizer": "sgd",
    "lr": 0.1,
    "momentum": 0.0,
    "weight_decay": 0.0,
    "prox_mu": 0.0,
    "seed": 1234567,
}
BY_STEPS = TRAIN | {"epochs": None, "steps": 5, "optimizer": "adam", "lr": 1}  # an int stays one

BUILT_TODAY: list[tuple[str, str, dict[str, Any]]] = [
    ("init", "Strategy.setup", {"seed": 99}),
    ("schema", "FedEvg.setup", {}),
    ("feature_moments", "Strategy.federated_scaling", {}),
    ("standardise", "Strategy.federated_scaling", {}),
    ("train", "FedAvg", TRAIN),
    ("train", "FedAvg by steps", BY_STEPS),
    ("train", "FedProx", TRAIN | {"prox_mu": 0.01}),
    ("train", "ApproxFedAvg", TRAIN | {"domain_temperature": 10.0, "domain_reduction": "sum"}),
    ("train", "DRFA", BY_STEPS | {"checkpoint_step": 3}),
    (
        "train",
        "DRFLM",
        BY_STEPS | {"checkpoint_step": 5, "mixup_alpha": 1.0, "mixup_on": "inputs"},
    ),
    ("train", "DRFA fedtorch", BY_STEPS | {"checkpoint_step": 0, "update_scale": 1.0}),
    ("train", "AgnosticFedAvg by data", TRAIN | {"domain_weights": {"female": 1.3, "male": 0.7}}),
    ("train", "client DP, distributed noise", TRAIN | {"cohort": 3}),
    ("evaluate", "Strategy.evaluate_task", {"split": "test"}),
    ("evaluate", "FedDC.evaluate", {"split": "train"}),
    ("loss", "loss-weighted probe", {"split": "train"}),
    ("loss", "AgnosticFedAvg by data probe", {"split": "train", "by_domain": True}),
    ("loss", "DRFLM mixup probe", {"split": "train", "mixup_alpha": 1.0, "seed": 42}),
    ("secagg_advertise", "MaskedMean.run", {}),
    ("secagg_share", "MaskedMean.run", {"advertisements": {"silo-1": "0a0b", "silo-2": "0c"}}),
    (
        "secagg_mask",
        "MaskedMean.run",
        {
            "inner_kind": "train",
            "inner_config": TRAIN,
            "weights": WEIGHTS,
            "shares": {"silo-2": "beef", "silo-3": "cafe"},
            "tensors": ["model"],
        },
    ),
    (
        "secagg_mask",
        "MaskedMean.run, FedDC aggregation",
        {
            "inner_kind": "daisy_train",
            "inner_config": BY_STEPS | {"adopt": False, "send": True},
            "weights": {"silo-1": 1.0},
            "shares": {},
            "tensors": ["model"],
        },
    ),
    ("secagg_confirm", "MaskedMean.run", {"survivors": list(SILOS)}),
    (
        "secagg_unmask",
        "MaskedMean.run",
        {"survivors": list(SILOS), "signatures": {"silo-1": "aa", "silo-2": "bb"}},
    ),
    (
        "secagg_unmask",
        "MaskedMean.run, keys folded for the next round",
        {
            "survivors": list(SILOS),
            "signatures": {"silo-1": "aa"},
            "advertise_next": {"round": 3, "phase": "train"},
        },
    ),
    ("ckks_keygen", "CkksMean._keys", {"recipients": list(SILOS)}),
    ("ckks_join", "CkksMean.run", {"key_holder": "silo-1", "context_digest": "f00d"}),
    (
        "ckks_encrypt",
        "CkksMean.run",
        {
            "inner_kind": "feature_moments",
            "inner_config": {},
            "weights": {"silo-1": 1 / 3, "silo-2": 1 / 3, "silo-3": 1 / 3},
            "tensors": ["count", "sum", "sumsq"],
        },
    ),
    ("ckks_confirm", "CkksMean.run", {"contributors": ["silo-1", "silo-2"]}),
    (
        "ckks_decrypt",
        "CkksMean.run",
        {"length": 1234, "weights": WEIGHTS, "contributors": ["silo-1", "silo-2"]},
    ),
    ("daisy_train", "FedDC._task", BY_STEPS | {"prox_mu": 0.1, "adopt": True, "send": False}),
    (
        "daisy_train",
        "FedDC._task, routed sealed",
        BY_STEPS | {"adopt": False, "send": False, "handoff": {"seal_to": "12ab"}},
    ),
    (
        "daisy_train",
        "FedDC._task, routed plain",
        BY_STEPS | {"adopt": False, "send": False, "handoff": {"plain": True}},
    ),
    ("daisy_receive", "Routing.run", {"sealed": True}),
    ("daisy_receive", "Routing.run, plain", {"sealed": False}),
    ("daisy_evaluate", "FedDC.evaluate", {"split": "test"}),
    ("daisy_train", "Cyclic.round, last visit", BY_STEPS | {"adopt": False, "send": True}),
    ("scaffold_train", "Scaffold.train_config", BY_STEPS),
    (
        "superfed_train",
        "SuperFed.train_settings",
        TRAIN
        | {
            "mixing": "model",
            "mixing_on": False,
            "ortho_nu": 1.0,
            "prox_mu": 0.0,
            "prox_form": "layer_l2",
            "local_seed": 77,
        },
    ),
    (
        "superfed_evaluate",
        "SuperFed.evaluate",
        {"lambda_grid": 11, "min_validation": 20, "local_seed": 77},
    ),
    (
        "energy_signals",
        "FedEvg.train_settings",
        TRAIN
        | {
            "energy": "joint",
            "sgld_steps": 1,
            "sgld_step": 1.0,
            "sgld_noise": 0.01,
            "gradient_clip": 3.0,
            "synthetic_ce_weight": 0.1,
            "spectral_norm": True,
            "persist_local_model": False,
            "model_seed": 5,
        },
    ),
    ("feddro_support", "FedDro.round, stage A", {}),
    ("feddro_train", "FedDro.train_config", TRAIN),
    ("boost_probe", "MultiBoost.round", {"split": "train", "evaluate": False, "edges": [0, 4]}),
    ("boost_probe", "MultiBoost.evaluate", {"split": "test", "evaluate": True, "edges": []}),
]


def test_every_kind_has_a_dict_built_as_today() -> None:
    assert {kind for kind, _, _ in BUILT_TODAY} == set(TASK_CONFIGS)


@pytest.mark.parametrize(
    ("kind", "built", "config"), BUILT_TODAY, ids=[f"{k}: {b}" for k, b, _ in BUILT_TODAY]
)
def test_the_dict_a_strategy_builds_today_re_encodes_identically(
    kind: str, built: str, config: dict[str, Any]
) -> None:
    decoded = decode_task_config(kind, json.loads(json.dumps(config)))
    assert isinstance(decoded, TASK_CONFIGS[kind])
    assert decoded.to_json() == config
    assert json.dumps(decoded.to_json(), sort_keys=True) == json.dumps(config, sort_keys=True)


def test_absent_keys_take_the_handlers_defaults() -> None:
    read = ("epochs", "batch_size", "optimizer", "lr", "seed")
    train = TrainTask.from_json({k: v for k, v in TRAIN.items() if k in read})
    assert train.local == LocalTraining(
        epochs=1, steps=None, batch_size=32, optimizer="sgd", lr=0.1, seed=1234567
    )
    assert (train.local.momentum, train.local.weight_decay, train.local.prox_mu) == (0, 0, 0)
    assert (train.mixup_site, train.reduction, train.scale, train.cohort_size) == (
        "inputs",
        "sum",
        1.0,
        1,
    )
    assert EvaluateTask.from_json({}).split == "test"
    probe = LossProbe.from_json({})
    assert (probe.split, probe.by_domain, probe.mixup_alpha, probe.mixup_site) == (
        "train",
        False,
        None,
        "inputs",
    )
    evaluate = SuperFedEvaluate.from_json({"local_seed": 1})
    assert (evaluate.lambda_grid, evaluate.min_validation) == (11, 20)
    assert DaisyReceive.from_json({}).sealed is False
    daisy = DaisyTrain.from_json(TRAIN)
    assert (daisy.adopt, daisy.send, daisy.handoff) == (False, False, None)


# -- refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize("config", EXAMPLES, ids=lambda c: c.KIND)
def test_an_unknown_key_is_refused_naming_the_kind_and_the_key(config: TaskConfig) -> None:
    with pytest.raises(WireError, match=rf"{config.KIND} task: unknown config key.*'colour'"):
        decode_task_config(config.KIND, config.to_json() | {"colour": "red"})


WRONG: list[tuple[str, dict[str, Any], str]] = [
    ("init", {"seed": "7"}, "seed"),
    ("init", {"seed": True}, "seed"),
    ("train", TRAIN | {"lr": "0.1"}, "lr"),
    ("train", TRAIN | {"steps": 2.5}, "steps"),
    ("train", TRAIN | {"domain_weights": {"f": "heavy"}}, "domain_weights.f"),
    ("evaluate", {"split": 1}, "split"),
    ("loss", {"split": "train", "by_domain": 1}, "by_domain"),
    ("secagg_share", {"advertisements": ["silo-1"]}, "advertisements"),
    ("secagg_confirm", {"survivors": "silo-1"}, "survivors"),
    ("secagg_confirm", {"survivors": ["silo-1", 2]}, "survivors[1]"),
    ("ckks_decrypt", {"length": 1.0, "weights": {}, "contributors": []}, "length"),
    ("daisy_train", TRAIN | {"adopt": "yes"}, "adopt"),
    ("daisy_train", TRAIN | {"handoff": {"plain": False}}, "handoff"),
    ("superfed_train", TRAIN | {"mixing": "model", "mixing_on": 1, "local_seed": 1}, "mixing_on"),
]


@pytest.mark.parametrize(("kind", "config", "key"), WRONG, ids=[f"{k}.{x}" for k, _, x in WRONG])
def test_a_value_of_the_wrong_type_is_refused_naming_the_kind_and_the_key(
    kind: str, config: dict[str, Any], key: str
) -> None:
    with pytest.raises(WireError, match=re.escape(f"{kind} task: config key '{key}'")):
        decode_task_config(kind, config)


@pytest.mark.parametrize(
    ("kind", "config", "key"),
    [
        ("train", TRAIN | {"mixup_alpha": None}, "mixup_alpha"),
        ("train", TRAIN | {"update_scale": None}, "update_scale"),
        ("loss", {"split": "train", "by_domain": False}, "by_domain"),
        ("daisy_train", TRAIN | {"handoff": None}, "handoff"),
    ],
)
def test_an_absent_key_sent_as_its_absent_value_reads_as_absent(
    kind: str, config: dict[str, Any], key: str
) -> None:
    """As the handlers read it today; re-encoded, the key is left out as the builders do."""
    decoded = decode_task_config(kind, config)
    assert decoded == decode_task_config(kind, {k: v for k, v in config.items() if k != key})
    assert key not in decoded.to_json()


@pytest.mark.parametrize(
    ("kind", "config", "key"),
    [
        ("init", {}, "seed"),
        ("train", {k: v for k, v in TRAIN.items() if k != "lr"}, "lr"),
        ("train", TRAIN | {"epochs": None, "steps": None}, "epochs"),
        ("superfed_evaluate", {"lambda_grid": 11}, "local_seed"),
        ("secagg_mask", {"weights": {}, "shares": {}, "tensors": []}, "inner_config"),
    ],
)
def test_a_missing_key_is_refused(kind: str, config: dict[str, Any], key: str) -> None:
    with pytest.raises(WireError, match=f"{kind} task: config key '{key}' is missing"):
        decode_task_config(kind, config)


def test_a_wrapped_task_is_checked_as_its_own_kind() -> None:
    wrapper = {"weights": {}, "shares": {}, "tensors": ["model"]}
    bad_inner = wrapper | {"inner_kind": "train", "inner_config": TRAIN | {"colour": "red"}}
    with pytest.raises(WireError, match=r"secagg_mask task wraps.*train task: unknown.*colour"):
        decode_task_config("secagg_mask", bad_inner)
    with pytest.raises(WireError, match="unknown task kind 'sleep'"):
        decode_task_config("secagg_mask", wrapper | {"inner_kind": "sleep", "inner_config": {}})


def test_a_config_that_is_no_object_and_an_unknown_kind_are_refused() -> None:
    with pytest.raises(WireError, match="evaluate task: config must be a JSON object"):
        decode_task_config("evaluate", ["test"])
    with pytest.raises(WireError, match="unknown task kind 'sleep'"):
        decode_task_config("sleep", {})


# -- what the real strategies send -------------------------------------------------------------


def recorded_configs(
    monkeypatch: pytest.MonkeyPatch, policy: Policy
) -> list[tuple[str, dict[str, Any]]]:
    """Every (kind, config) the coordinator sends while simulating `policy`, read from the
    encoded task headers."""
    sent: list[tuple[str, dict[str, Any]]] = []

    def recording(endpoint: Callable[[bytes], bytes]) -> Callable[[bytes], bytes]:
        def answer(payload: bytes) -> bytes:
            _, header = decode_tensors(payload)
            sent.append((header["kind"], header["config"]))
            return endpoint(payload)

        return answer

    class RecordingTransport(InProcessTransport):
        def __init__(self, endpoints: dict[str, Callable[[bytes], bytes]], **kwargs: Any) -> None:
            super().__init__({n: recording(e) for n, e in endpoints.items()}, **kwargs)

    monkeypatch.setattr(simulate_module, "InProcessTransport", RecordingTransport)
    simulate(policy, load_silos(policy, EXAMPLES_FOLDER))
    return sent


EXAMPLES_FOLDER = Path(__file__).resolve().parents[1] / "policies" / "examples"
SIMULATED = {
    # example policy -> overrides (kept small: one or two rounds)
    "heart-feddc.yaml": {"rounds": 2, "algorithm": {"aggregation_period": 2}},
    "breast-cancer-fedavg.yaml": {"rounds": 1},
    "heart-drflm.yaml": {"rounds": 1},
    "heart-drfa-fedtorch.yaml": {"rounds": 1},
    "heart-agnostic-fedavg-by-sex.yaml": {"rounds": 2},
    "heart-approx-fedavg.yaml": {"rounds": 1},
    "heart-superfed.yaml": {"rounds": 1},
    "digits-fedevg.yaml": {
        "rounds": 1,
        "algorithm": {"samples_per_class": 1, "classifier_epochs": 1},
        "model": {"channels": [4]},
        "training": {"epochs": None, "steps": 1},
    },
    "fedavg_client_dp.yaml": {"rounds": 1},
    "heart-fedavg.yaml": {"rounds": 1, "secure_aggregation": "ckks"},
    "heart-scaffold.yaml": {"rounds": 1, "training": {"steps": 2}},
    "heart-cyclic.yaml": {"rounds": 1, "training": {"steps": 2}},
    "digits-feddro.yaml": {
        "rounds": 2,
        "algorithm": {"barycenter_rounds": 1, "support_points": 3},
        "training": {"epochs": None, "steps": 1},
    },
    "heart-multiboost.yaml": {"rounds": 1, "training": {"epochs": 1}},
}


def short_policy(example: str, overrides: dict[str, Any]) -> Policy:
    """The example with `overrides` (a section's keys merged into it), evaluated every round."""
    document = load_policy(EXAMPLES_FOLDER / example).model_dump()
    for key, value in overrides.items():
        if isinstance(value, dict):
            document[key] = {**document[key], **value}
        else:
            document[key] = value
    return Policy.model_validate(document | {"eval_every": 1})


def test_every_config_the_strategies_send_re_encodes_identically(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kinds = set()
    for example, overrides in SIMULATED.items():
        for kind, config in recorded_configs(monkeypatch, short_policy(example, overrides)):
            assert decode_task_config(kind, config).to_json() == config, (example, kind)
            kinds |= {kind, config.get("inner_kind", kind)}
    assert kinds == set(TASK_CONFIGS)
