"""The round engine: exact aggregation, quorum and deadlines, and refusing bad replies."""

import math
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from fedsilo.coordinator import running_mean, strategies
from fedsilo.coordinator.engine import RoundEngine, RunAborted
from fedsilo.coordinator.phases import Identical, Phase, Task, WeightedMean
from fedsilo.coordinator.strategies import make_strategy
from fedsilo.coordinator.strategies.base import SetupError
from fedsilo.coordinator.transport import InProcessTransport
from fedsilo.policies.loading import parse_policy
from fedsilo.silo.agent import SiloAgent
from fedsilo.silo.data import SiloDataset
from fedsilo.wire.messages import TaskMessage, TaskResult
from fedsilo.wire.payload import SpooledPayload, digest_of
from tests.fakes import INIT, SPEC, TRAIN, constant_silo, scripted_silo, silent_silo
from tests.silos import agent, policy_with


def make_policy(**overrides: object):
    document = {
        "version": 1,
        "rounds": 1,
        "algorithm": {"name": "fedavg"},
        "participants": {"min_silos": 1, "phase_timeout_s": 5.0},
    }
    for key, value in overrides.items():
        document[key] = {**document.get(key, {}), **value} if isinstance(value, dict) else value
    return parse_policy(document)


def engine_for(endpoints: dict, **overrides: object) -> RoundEngine:
    policy = make_policy(**overrides)
    return RoundEngine(
        make_strategy(policy), InProcessTransport(endpoints), policy, sorted(endpoints)
    )


def test_fedavg_is_the_exact_sample_weighted_average() -> None:
    engine = engine_for(
        {
            "a": constant_silo("a", [1.0, 2.0, 3.0], num_samples=1),
            "b": constant_silo("b", [4.0, 5.0, 6.0], num_samples=2),
            "c": constant_silo("c", [0.5, -1.0, 0.0], num_samples=5),
        }
    )
    history = engine.run()
    expected = (
        1 * torch.tensor([1.0, 2, 3])
        + 2 * torch.tensor([4.0, 5, 6])
        + 5 * torch.tensor([0.5, -1, 0])
    ) / 8
    assert torch.allclose(history.state.model, expected, atol=0, rtol=1e-7)


def test_explicit_weights_replace_sample_counts_and_absent_silos_weigh_nothing() -> None:
    engine = engine_for(
        {
            "a": constant_silo("a", [2.0, 2, 2]),
            "b": constant_silo("b", [8.0, 8, 8]),
            "c": constant_silo("c", [100.0, 100, 100]),
        }
    )
    phase = Phase(
        "train",
        tuple(Task(s, TRAIN, spec=SPEC) for s in "abc"),
        aggregate=WeightedMean(("model",), weights={"a": 0.75, "b": 0.25}),
    )
    outcome = engine.execute(phase, round_no=1)
    assert outcome.mean["model"].tolist() == [3.5, 3.5, 3.5]
    assert outcome.tensors == {}  # the strategy sees the aggregate, never one silo's model


def test_the_engine_names_each_means_size_before_it_allocates_it() -> None:
    """A service gives its allocator's kept memory back there for a large model
    (ops/memory.py `make_room_for`); the hook sees the mean's bytes, once per mean."""
    asked: list[int] = []
    policy = make_policy(rounds=2)
    endpoints = {s: constant_silo(s, [1.0, 2.0, 3.0]) for s in "ab"}
    engine = RoundEngine(
        make_strategy(policy),
        InProcessTransport(endpoints),
        policy,
        sorted(endpoints),
        make_room=asked.append,
    )
    engine.run()
    assert asked == [3 * 4, 3 * 4]  # two rounds' means of three float32 parameters


def test_a_silo_that_never_answers_is_dropped_at_the_deadline_and_the_round_goes_on() -> None:
    release = threading.Event()
    try:
        engine = engine_for(
            {
                "a": constant_silo("a", [1.0, 1, 1]),
                "b": constant_silo("b", [3.0, 3, 3]),
                "silent": silent_silo(release),
            },
            participants={"min_silos": 2, "phase_timeout_s": 0.5},
        )
        history = engine.run()
    finally:
        release.set()
    record = history.records[0]
    assert record.status == "completed"
    assert record.phases["train"]["dropped"] == {"silent": "no reply before the deadline"}
    assert history.state.model.tolist() == [2.0, 2.0, 2.0]


def test_a_round_below_quorum_fails_and_keeps_the_previous_state() -> None:
    release = threading.Event()
    try:
        engine = engine_for(
            {"a": constant_silo("a", [1.0, 1, 1]), "silent": silent_silo(release)},
            rounds=2,
            participants={
                "min_silos": 2,
                "phase_timeout_s": 0.3,
                "max_consecutive_failed_rounds": 5,
            },
        )
        history = engine.run()
    finally:
        release.set()
    assert [r.status for r in history.records] == ["failed", "failed"]
    assert "quorum is 2" in history.records[0].error
    train = history.records[0].phases["train"]  # the failed phase is still on record
    assert train["dropped"] == {"silent": "no reply before the deadline"}
    assert set(train["answered"]) == {"a"}
    assert history.state.model.tolist() == [0.0, 0.0, 0.0]  # still the initial model


def test_the_run_stops_after_too_many_failed_rounds_in_a_row() -> None:
    release = threading.Event()
    try:
        engine = engine_for(
            {"a": constant_silo("a", [1.0, 1, 1]), "silent": silent_silo(release)},
            rounds=10,
            participants={
                "min_silos": 2,
                "phase_timeout_s": 0.2,
                "max_consecutive_failed_rounds": 2,
            },
        )
        with pytest.raises(RunAborted, match="2 rounds in a row missed their quorum"):
            engine.run()
    finally:
        release.set()


def crashing(payload: bytes) -> bytes:
    if TaskMessage.decode(payload).kind == "train":
        raise RuntimeError("disk full")
    return constant_silo("crash", [0.0, 0, 0])(payload)


def non_finite(payload: bytes) -> bytes:
    return constant_silo("nan", [float("nan"), 0, 0])(payload)


def garbage(payload: bytes) -> bytes:
    return (
        b"garbage"
        if TaskMessage.decode(payload).kind == "train"
        else constant_silo("junk", [0.0] * 3)(payload)
    )


def impostor(payload: bytes) -> bytes:
    task = TaskMessage.decode(payload)
    if task.kind == "train":
        return TaskResult(
            "someone-else", "impostor", "train", tensors={"model": torch.ones(3)}, spec=SPEC
        ).encode()
    return constant_silo("impostor", [0.0] * 3)(payload)


def wrong_shape(payload: bytes) -> bytes:
    return scripted_silo("shape", lambda t: torch.zeros(3) if t.kind == "init" else torch.zeros(4))(
        payload
    )


@pytest.mark.parametrize(
    ("name", "endpoint", "reason"),
    [
        ("crash", crashing, "silo crashed: RuntimeError('disk full')"),
        ("nan", non_finite, "non-finite values in 'model'"),
        ("junk", garbage, "malformed reply"),
        ("impostor", impostor, "reply is for task 'someone-else'"),
        ("shape", wrong_shape, "do not match the model's shape"),
    ],
)
def test_bad_replies_count_as_that_silos_dropout_with_the_reason(name, endpoint, reason) -> None:
    engine = engine_for({"good": constant_silo("good", [2.0, 4.0, 6.0]), name: endpoint})
    history = engine.run()
    assert reason in history.records[0].phases["train"]["dropped"][name]
    assert history.state.model.tolist() == [2.0, 4.0, 6.0]


def test_client_fraction_samples_the_same_silos_for_the_same_seed() -> None:
    endpoints = {f"s{i}": constant_silo(f"s{i}", [float(i)] * 3) for i in range(10)}

    def chosen(seed: int) -> list[list[str]]:
        engine = engine_for(
            endpoints, rounds=3, seed=seed, algorithm={"name": "fedavg", "client_fraction": 0.3}
        )
        return [sorted(r.phases["train"]["answered"]) for r in engine.run().records]

    first = chosen(0)
    assert all(len(silos) == 3 for silos in first)
    assert first == chosen(0) and first != chosen(1)


def test_evaluation_reports_per_silo_metrics_and_cross_silo_summaries() -> None:
    engine = engine_for({"a": constant_silo("a", [1.0] * 3), "b": constant_silo("b", [1.0] * 3)})
    final = engine.run().final
    assert set(final.evaluation) == {"a", "b"}
    assert final.summary["accuracy"]["mean"] == 0.5 and final.summary["accuracy"]["gini"] == 0.0


def test_a_late_reply_is_discarded_and_never_applied_to_a_later_round() -> None:
    slow_rounds = {1}

    def slow_in_round_one(payload: bytes) -> bytes:
        task = TaskMessage.decode(payload)
        if task.kind == "train" and task.round in slow_rounds:
            threading.Event().wait(0.6)  # answers after the 0.3 s deadline
        return constant_silo("slow", [float(100 * task.round)] * 3)(payload)

    engine = engine_for(
        {"fast": constant_silo("fast", [1.0] * 3), "slow": slow_in_round_one},
        rounds=2,
        participants={"min_silos": 1, "phase_timeout_s": 0.3},
    )
    history = engine.run()
    first, second = history.records
    assert first.phases["train"]["dropped"] == {"slow": "no reply before the deadline"}
    assert set(second.phases["train"]["answered"]) == {"fast", "slow"}
    assert history.state.model.tolist() == [100.5, 100.5, 100.5]  # round 2's answers only


def test_a_resumed_deployment_keeps_the_consortium_it_started_with(tmp_path) -> None:
    from fedsilo.coordinator.state import StateStore

    endpoints = {f"s{i}": constant_silo(f"s{i}", [float(i)] * 3) for i in range(4)}
    policy = make_policy(rounds=2, algorithm={"name": "fedavg", "client_fraction": 0.5})
    with StateStore(tmp_path / "state.db") as store:
        first = RoundEngine(
            make_strategy(policy),
            InProcessTransport(endpoints),
            policy,
            sorted(endpoints),
            store=store,
        )
        first.run()
    longer = make_policy(rounds=3, algorithm={"name": "fedavg", "client_fraction": 0.5})
    with StateStore(tmp_path / "state.db") as store:
        resumed = RoundEngine(
            make_strategy(longer),
            InProcessTransport(endpoints),
            longer,
            ["s0", "s1"],
            store=store,
            policy_digest=first.policy_digest,
        )
        history = resumed.run()
    assert resumed.silos == ("s0", "s1", "s2", "s3")
    assert len(history.records) == 3


@pytest.mark.parametrize("spooled", [False, True], ids=["in-memory", "spooled"])
@pytest.mark.parametrize("running_sum_bytes", [1 << 30, 0], ids=["running", "at-the-end"])
@pytest.mark.parametrize("arrival", ["abc", "cba", "bca"])
def test_the_mean_is_bit_identical_to_a_whole_tensor_sum_in_sorted_order(
    monkeypatch, running_sum_bytes: int, arrival: str, spooled: bool
) -> None:
    """Summed while replies arrive or once all are in, in slices that end mid-tensor, in any
    arrival order, read in place or through buffers reused from slice to slice (a reply in a
    spool file): the same bits as one float64 sum over whole tensors in sorted silo order."""
    generator = torch.Generator().manual_seed(3)
    models = {s: torch.randn(SPEC.numel, generator=generator) for s in "abc"}
    weights = {"a": 0.3, "b": 1.7, "c": 2.9}  # inexact products: the order shows in the bits
    turn = {s: threading.Event() for s in arrival}

    def in_turn(silo: str) -> Callable[[bytes], bytes]:
        answer = constant_silo(silo, models[silo].tolist())

        def endpoint(payload: bytes) -> bytes | SpooledPayload:
            turn[silo].wait(timeout=10)
            reply = answer(payload)
            later = arrival[arrival.index(silo) + 1 :]
            if later:
                threading.Timer(0.05, turn[later[0]].set).start()
            return spool(reply) if spooled else reply

        return endpoint

    phase = Phase(
        "train", tuple(Task(s, TRAIN, spec=SPEC) for s in "abc"), WeightedMean(weights=weights)
    )
    whole = torch.zeros(SPEC.numel, dtype=torch.float64)
    for s in "abc":
        whole.add_(models[s], alpha=weights[s])
    expected = (whole / math.fsum(weights.values())).to(torch.float32)
    monkeypatch.setattr(running_mean, "SLICE_ELEMENTS", 2)
    monkeypatch.setattr(running_mean, "RUNNING_SUM_BYTES", running_sum_bytes)
    turn[arrival[0]].set()
    engine = engine_for({s: in_turn(s) for s in "abc"})
    mean = engine.execute(phase, round_no=1).mean["model"]
    assert torch.equal(mean, expected)


def spool(reply: bytes) -> SpooledPayload:
    """`reply` in a spool file, as the coordinator holds a large one."""
    spooled = SpooledPayload()
    spooled.append(reply)
    return spooled.seal(digest_of([reply]))


def test_an_agreement_phase_returns_one_copy_and_every_silos_digest() -> None:
    silos = {name: constant_silo(name, [1.0, 2.0, 3.0]) for name in ("a", "b", "c")}
    engine = engine_for(silos)
    tasks = tuple(Task(s, INIT) for s in sorted(silos))
    outcome = engine.execute(Phase("init", tasks, aggregate=Identical(("model",))), 0)
    assert list(outcome.tensors) == ["a"]  # one copy, whatever the number of silos
    assert outcome.tensors["a"]["model"].tolist() == [0.0, 0.0, 0.0]
    assert sorted(outcome.digests) == ["a", "b", "c"]
    assert len(set(outcome.digests.values())) == 1


@pytest.mark.parametrize("other", [torch.full((3,), 1e-30), torch.zeros(4), -torch.zeros(3)])
def test_setup_names_a_silo_whose_initial_model_differs_by_any_bit(other) -> None:
    odd = scripted_silo("odd", lambda t: other if t.kind == "init" else torch.zeros(3))
    engine = engine_for(
        {"a": constant_silo("a", [1.0] * 3), "b": constant_silo("b", [1.0] * 3), "odd": odd}
    )
    with pytest.raises(
        SetupError,
        match=r"silo 'odd' \(.*\) built a different initial model than the majority \('a', 'b'",
    ):
        engine.run()


LINEAR_POLICY = policy_with(model={"name": "linear"})


def site(name: str, width: int, classes: int = 2) -> SiloAgent:
    """A silo agent over `width` features and `classes` classes, as a simulation builds it."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(60, width, generator=g)
    y = torch.randint(0, classes, (60,), generator=g)
    features = tuple(f"f{i}" for i in range(width))
    data = SiloDataset(name, x, y, x, y, x, y, "classification", classes, features, (width,))
    return agent(data, LINEAR_POLICY, name)


def setup_refusal(*silos: SiloAgent) -> str:
    """Why the engine refuses to start `silos` (SetupError's message)."""
    engine = RoundEngine(
        make_strategy(LINEAR_POLICY),
        InProcessTransport({s.name: s.handle_bytes for s in silos}),
        LINEAR_POLICY,
        [s.name for s in silos],
    )
    with pytest.raises(SetupError) as refused:
        engine.run()
    return str(refused.value)


def test_setup_names_the_silo_that_differs_from_the_majority_with_each_width_and_classes() -> None:
    """The odd silo sorts first ('childrens' had an extra column), so the copy of the initial
    model the engine kept is its own: the message still names it, not the majority."""
    refusal = setup_refusal(site("childrens", 5), site("general", 4), site("pediatric", 4))
    assert refusal == (
        "silo 'childrens' (input width 5, 2 classes) built a different initial model than the "
        "majority ('general', 'pediatric' (input width 4, 2 classes)): their feature schemas or "
        "model settings disagree"
    )


def test_setup_without_a_majority_names_every_silo_with_what_it_built_for() -> None:
    refusal = setup_refusal(site("a", 4), site("b", 4, classes=3))
    assert refusal.startswith(
        "the silos built different initial models and no majority agrees "
        "('a' (input width 4, 2 classes), 'b' (input width 4, 3 classes))"
    )


def test_no_strategy_knows_of_secure_aggregation_or_client_dp() -> None:
    """A strategy declares its weighted means; the engine derives both from them and the
    policy, so an algorithm runs under either unchanged."""
    folder = Path(strategies.__file__).parent
    for path in sorted(folder.glob("*.py")):
        source = path.read_text()
        assert "secure_aggregation" not in source and "client_dp" not in source, path.name
