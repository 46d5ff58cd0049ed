"""Secure aggregation. Pairwise masking: the masked mean equals the plaintext one within the
fixed-point precision; silos that drop after sharing (up to n - t) still leave the survivors'
exact sum; more drops abandon the round cleanly; a silo declared dropped cannot be unmasked;
a substituted key is refused by the silos; and nothing the coordinator receives or computes
is one silo's update. CKKS: the same mean within CKKS's precision; the coordinator holds the
public context and ciphertexts only; the secret context opens only at its recipients and a
substituted one is refused; one decryption per aggregation. The policy's rules for a deviating
coordinator: a finite bound, a threshold of at least floor(2n/3) + 1, a weight rule honest
FedAvg passes, and a release gate that lets no model leave a silo in the clear (the attacks
themselves are in tests/adversarial/)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from itertools import combinations
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch
from Crypto.Protocol.SecretSharing import Shamir
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.hashes import SHA256
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from nacl.exceptions import CryptoError
from nacl.public import PrivateKey
from nacl.signing import SigningKey

from fedsilo.coordinator.engine import RoundEngine
from fedsilo.coordinator.phases import Phase, Task, WeightedMean
from fedsilo.coordinator.secure_mean import SecureMean
from fedsilo.coordinator.state import StateStore
from fedsilo.coordinator.strategies import make_strategy
from fedsilo.coordinator.strategies.base import RoundContext, RoundScript, ServerState, Strategy
from fedsilo.coordinator.strategies.fedavg import FedAvg
from fedsilo.coordinator.transport import InProcessTransport
from fedsilo.ops.sim_silos import ConsortiumKeys, build_agent
from fedsilo.ops.simulate import simulate
from fedsilo.policies.algorithms.contract import (
    SiloContract,
    averaging_contract,
    evaluation_rule,
    every_round,
    train_rule,
)
from fedsilo.policies.algorithms.fedavg import FedAvgConfig
from fedsilo.policies.loading import PolicyError, parse_policy
from fedsilo.policies.schema import Policy
from fedsilo.policies.secure_aggregation import SecureAggregationConfig
from fedsilo.privacy import masking, unmasking
from fedsilo.privacy.ckks import (
    CkksError,
    context_digest,
    decrypt,
    load_public_context,
    new_secret_context,
    open_sealed_context,
    public_context,
    seal_context,
)
from fedsilo.privacy.masking import (
    FixedPoint,
    MaskingError,
    MaskingKeys,
    add_streams,
    combine_shares,
    mask_streams,
    new_seed,
    prg,
    split_secret,
    unmask_terms,
    weight_problem,
)
from fedsilo.silo.agent import SiloAgent
from fedsilo.silo.data import load_consortium
from fedsilo.silo.release_gate import refusal
from fedsilo.silo.tasks import TASK_KINDS
from fedsilo.silo.tasks.base import SiloContext
from fedsilo.silo.tasks.ckks_sum import GRID_BELOW_SCALE_BITS
from fedsilo.wire.messages import STATUS_ERROR, TaskMessage, TaskResult
from fedsilo.wire.tasks import (
    DaisyTrain,
    EncryptedInput,
    EvaluateTask,
    Handoff,
    MaskedInput,
    TaskConfig,
)
from fedsilo.wire.tasks.tensor_names import (
    ADVERTISEMENT,
    MODEL,
    PUBLIC_CONTEXT,
    SEALED_CONTEXT,
)
from fedsilo.wire.tensors import tensor_bytes
from tests.test_state import Interrupted, StopAfter
from tests.wire_tasks import ONE_PER_KIND, TRAIN

SILOS = 5
Endpoint = Callable[[bytes], bytes]


def policy(
    secure: object = "masking", rounds: int = 1, silos: int = SILOS, **extra: object
) -> Policy:
    return parse_policy(
        {
            "version": 1,
            "seed": 5,
            "rounds": rounds,
            "algorithm": {"name": "fedavg"},
            "model": {"name": "mlp", "hidden": [32]},
            "training": {"epochs": 1, "batch_size": 32, "lr": 0.1},
            "participants": {"min_silos": 1, "phase_timeout_s": 60},
            "data": {
                "source": "sklearn:breast_cancer",
                "partition": {"kind": "iid", "silos": silos},
            },
            "secure_aggregation": secure,
            **extra,
        }
    )


def silo_agents(
    p: Policy,
    identities: dict[str, SigningKey] | None = None,
    sealing: dict[str, PrivateKey] | None = None,
) -> dict[str, SiloAgent]:
    """`p`'s silos, each built from the policy as a simulation builds it (`build_agent`), with
    the consortium's keys: `identities` and `sealing` where given, else fresh ones."""
    datasets = load_consortium(p.data, seed=p.seed)
    keys = ConsortiumKeys.generate(d.name for d in datasets)
    if identities is not None or sealing is not None:
        keys = ConsortiumKeys(
            {n: bytes(k) for n, k in identities.items()} if identities else keys.identities,
            {n: bytes(k) for n, k in sealing.items()} if sealing else keys.sealing,
        )
    return {d.name: build_agent(p, d.name, d, torch.device("cpu"), keys) for d in datasets}


def run(
    p: Policy,
    wrap: Callable[[str, Endpoint], Endpoint] = lambda _, e: e,
    identities: dict[str, SigningKey] | None = None,
    sealing: dict[str, PrivateKey] | None = None,
    *,
    agents: dict[str, SiloAgent] | None = None,
    strategy: Strategy | None = None,
    store: StateStore | None = None,
    observers: Sequence[object] = (),
):
    """The engine's run of `p` over its silos (`agents`, else new ones), each reached through
    `wrap`; with `store`, saved there (and resumed from it)."""
    agents = agents or silo_agents(p, identities, sealing)
    transport = InProcessTransport({n: wrap(n, a.handle_bytes) for n, a in agents.items()})
    engine = RoundEngine(
        strategy or make_strategy(p), transport, p, sorted(agents), observers, store=store
    )
    return engine.run()


def failing(
    silo: str, kind: str, round_no: int | None = None
) -> Callable[[str, Endpoint], Endpoint]:
    """`silo` fails every task of `kind` (of round `round_no` only, when given)."""

    def wrap(name: str, endpoint: Endpoint) -> Endpoint:
        def answer(payload: bytes) -> bytes:
            task = TaskMessage.decode(payload)
            if name == silo and task.kind == kind and round_no in (None, task.round):
                return TaskResult(
                    task.task_id, name, task.kind, status=STATUS_ERROR, error="power cut"
                ).encode()
            return endpoint(payload)

        return answer

    return wrap


PRECISION = FixedPoint.for_silos(64.0, SILOS).precision


def test_the_masked_mean_equals_the_plaintext_mean_within_the_fixed_point_precision() -> None:
    plain, masked = run(policy("none", rounds=2)), run(policy("masking", rounds=2))
    difference = (plain.state.model - masked.state.model).abs().max().item()
    # per round: SILOS roundings of at most half the precision each, then float32 rounding
    assert difference <= 2 * (SILOS * PRECISION / 2 + 1e-7)
    assert plain.final.summary["accuracy"]["mean"] == masked.final.summary["accuracy"]["mean"]


def test_a_secure_sum_takes_each_tensor_relative_to_the_tasks_own_else_the_declared_one() -> None:
    sent, zeros = torch.ones(3), torch.zeros(2)
    task = Task("a", TRAIN, tensors={"model": sent})
    declared = WeightedMean(("model", "g"), references={"model": torch.full((3,), 9.0), "g": zeros})
    _, tasks = SecureMean.referenced(Phase("train", (task,), declared), "masking")
    assert tasks["a"].tensors["model"] is sent and tasks["a"].tensors["g"] is zeros
    undeclared = Phase("train", (task,), WeightedMean(("model", "g")))
    with pytest.raises(ValueError, match=r"a's task sends no \['g'\]"):
        SecureMean.referenced(undeclared, "masking")


def test_the_masked_mean_has_the_same_bits_read_in_slices_and_chunks_of_any_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The coordinator sums, unmasks and decodes the masked inputs a slice and, within it, a
    chunk at a time (as the mask streams are read): sizes that split every tensor at odd
    places leave the mean's bits as they are."""
    whole = run(policy("masking", rounds=2))
    monkeypatch.setattr(masking, "STREAM_CHUNK_ELEMENTS", 97)
    monkeypatch.setattr(unmasking, "STREAM_CHUNK_ELEMENTS", 97)
    monkeypatch.setattr(unmasking, "SLICE_ELEMENTS", 300)
    pieces = run(policy("masking", rounds=2))
    assert torch.equal(whole.state.model, pieces.state.model)


@pytest.mark.parametrize("step", ["secagg_mask", "secagg_confirm", "secagg_unmask"])
def test_a_silo_that_drops_after_sharing_leaves_the_survivors_exact_sum(step: str) -> None:
    masked = run(policy("masking"), failing("silo-2", step))
    # dropping at the mask step: its input is not in the sum; at confirm neither (it signed no
    # statement: its input stays masked, its key is rebuilt); at unmask: its input is
    left_out = step in ("secagg_mask", "secagg_confirm")
    plain = run(policy("none"), failing("silo-2", "train" if left_out else "none"))
    difference = (plain.state.model - masked.state.model).abs().max().item()
    assert difference <= SILOS * PRECISION / 2 + 1e-7
    assert "silo-2" in masked.records[0].phases["train"]["dropped"]


def steps_taken(
    p: Policy, wrap: Callable[[str, Endpoint], Endpoint] = lambda _, e: e, **options: object
) -> tuple[list[tuple[int, str, str, str, bool]], object]:
    """Every task the silos answer, as (round, phase, kind, silo, whether the answer carries
    an advertisement), and the run's history."""
    seen = []

    def record(name: str, endpoint: Endpoint) -> Endpoint:
        def answer(payload: bytes) -> bytes:
            task = TaskMessage.decode(payload)
            reply = endpoint(payload)
            carries = ADVERTISEMENT in TaskResult.decode(reply).tensors
            seen.append((task.round, task.phase, task.kind, name, carries))
            return reply

        return wrap(name, answer)

    return seen, run(p, record, **options)


def advertised_by(seen: list[tuple[int, str, str, str, bool]], kind: str) -> set[tuple]:
    """(round, phase, silo) of every answer of `kind` that carries keys."""
    return {(r, phase, silo) for r, phase, k, silo, carries in seen if k == kind and carries}


NAMES = [f"silo-{i}" for i in range(SILOS)]


def test_a_masked_round_after_the_first_starts_with_the_keys_folded_into_the_last_unmask() -> None:
    seen, history = steps_taken(policy("masking", rounds=3))
    assert [r.status for r in history.records] == ["completed"] * 3
    assert advertised_by(seen, "secagg_advertise") == {(1, "train", s) for s in NAMES}
    # each unmask answer carries the keys for the next round; the last round's none
    folded = {(r, "train", s) for r in (1, 2) for s in NAMES}
    assert advertised_by(seen, "secagg_unmask") == folded


def test_a_silo_that_dropped_before_folding_its_keys_alone_advertises_in_the_next_round() -> None:
    seen, history = steps_taken(policy("masking", rounds=2), failing("silo-2", "secagg_unmask", 1))
    assert [r.status for r in history.records] == ["completed"] * 2
    assert "silo-2" in history.records[0].phases["train"]["dropped"]
    assert "silo-2" in history.records[1].phases["train"]["answered"]
    advertise_tasks = {(r, s) for r, _, kind, s, _ in seen if kind == "secagg_advertise"}
    assert advertise_tasks == {(1, s) for s in NAMES} | {(2, "silo-2")}


class TwoMeansARound(FedAvg):
    """FedAvg whose round takes two masked means: the models trained from the global model,
    then those trained from that mean."""

    def round(self, state: ServerState, ctx: RoundContext) -> RoundScript:
        for phase in ("train", "again"):
            tasks = tuple(
                self.train_task(s, state.model, state.spec, ctx) for s in self.sample_silos(ctx)
            )
            out = yield Phase(phase, tasks, aggregate=WeightedMean((MODEL,)))
            state = replace(state, tensors=self.server_update(state, out.mean[MODEL]))
        return state


class TwoMeansConfig(FedAvgConfig):
    """The silos' side of `TwoMeansARound`: FedAvg's contract with a second weighted mean of
    `train` tasks, `again`, in every round (no algorithm of the policy reader has two masked
    phases a round; a silo answers only the phases its contract names). Its second mean is
    no server step a silo repeats: no model lineage."""

    lineage_gap: ClassVar[str | None] = "two means a round"

    def silo_contract(self, policy: Policy) -> SiloContract:
        every = averaging_contract(policy)
        return replace(every, rules=(*every.rules, replace(train_rule(policy), name="again")))


def test_each_masked_phase_of_a_round_folds_its_keys_for_the_same_phase_of_the_next() -> None:
    p = policy("masking", rounds=3)
    p = p.model_copy(update={"algorithm": TwoMeansConfig(name="fedavg")})
    seen, history = steps_taken(p, strategy=TwoMeansARound(p))
    assert [r.status for r in history.records] == ["completed"] * 3
    first = {(1, phase, s) for phase in ("train", "again") for s in NAMES}
    assert advertised_by(seen, "secagg_advertise") == first
    folded = {(r, phase, s) for r in (1, 2) for phase in ("train", "again") for s in NAMES}
    assert advertised_by(seen, "secagg_unmask") == folded


class EveryOtherRound(FedAvg):
    """FedAvg that aggregates in odd rounds only (as FedDC aggregates every b rounds)."""

    def round(self, state: ServerState, ctx: RoundContext) -> RoundScript:
        if ctx.round % 2 == 0:
            return state
        return (yield from super().round(state, ctx))


class OddRoundsConfig(FedAvgConfig):
    """The silos' side of `EveryOtherRound`: FedAvg's contract whose `train` mean runs in odd
    rounds only (as FedDC's contract holds its aggregation rounds)."""

    def silo_contract(self, policy: Policy) -> SiloContract:
        every = every_round(policy)
        odd = replace(train_rule(policy), rounds=lambda r: every(r) and r % 2 == 1)
        return averaging_contract(policy, odd, evaluation_rule(policy))


def test_a_phase_aggregated_every_other_round_folds_its_keys_two_rounds_ahead() -> None:
    """Keys are folded for the phase's next weighted mean in the algorithm's contract: with
    the mean in odd rounds only, two rounds ahead from the first aggregation on. Under FedAvg's
    contract (a mean every round) they are folded for the next round, which this strategy
    skips: never used, each odd round advertises afresh, and the run completes all the same."""
    p = policy("masking", rounds=7)
    odd = p.model_copy(update={"algorithm": OddRoundsConfig(name="fedavg")})
    for contracted, fresh in ((odd, (1,)), (p, (1, 3, 5, 7))):
        seen, history = steps_taken(contracted, strategy=EveryOtherRound(contracted))
        assert [r.status for r in history.records] == ["completed"] * 7
        advertised = {(r, s) for r, _, kind, s, _ in seen if kind == "secagg_advertise"}
        assert advertised == {(r, s) for r in fresh for s in NAMES}
        asked = {(r, s) for r, _, kind, s, carries in seen if kind == "secagg_unmask" and carries}
        assert asked == {(r, s) for r in (1, 3, 5) for s in NAMES}  # round 7's: none, the last


def test_a_coordinator_restarted_between_masked_rounds_gets_the_folded_keys_again(
    tmp_path: Path,
) -> None:
    # The restarted coordinator holds no keys; the silos, still running, answer its advertise
    # tasks with the keys they folded (not yet shared), and the run ends as one never stopped.
    p = policy("masking", rounds=3)
    uninterrupted = run(p)
    agents = silo_agents(p)
    with StateStore(tmp_path / "state.db") as store, pytest.raises(Interrupted):
        run(p, agents=agents, store=store, observers=[StopAfter(1)])
    folded = {}

    def keep(name: str, endpoint: Endpoint) -> Endpoint:
        def answer(payload: bytes) -> bytes:
            reply = endpoint(payload)
            result = TaskResult.decode(reply)
            if result.kind == "secagg_advertise":
                folded[name] = tensor_bytes(result.tensors[ADVERTISEMENT])
            return reply

        return answer

    with StateStore(tmp_path / "state.db") as store:
        resumed = run(p, keep, agents=agents, store=store)
    assert [r.status for r in resumed.records] == ["completed"] * 3
    assert sorted(folded) == NAMES  # round 2's advertise step, answered by every silo
    assert torch.equal(resumed.state.model, uninterrupted.state.model)


def test_more_drops_than_the_threshold_allows_abandon_the_round_cleanly() -> None:
    p = policy("masking", participants={"min_silos": 1, "max_consecutive_failed_rounds": 5})

    def three_drop(name: str, endpoint: Endpoint) -> Endpoint:
        inner = endpoint
        for silo in ("silo-0", "silo-1", "silo-2"):  # 2 of 5 left; t = floor(2 * 5 / 3) + 1 = 4
            inner = failing(silo, "secagg_mask")(name, inner)
        return inner

    history = run(p, three_drop)
    (record,) = history.records
    assert record.status == "failed"
    assert "2 silos remain after the mask step" in record.error
    assert "needs 4" in record.error


def test_a_substituted_key_is_refused_by_every_silo() -> None:
    impostor = SigningKey.generate()

    def substitute(name: str, endpoint: Endpoint) -> Endpoint:
        def answer(payload: bytes) -> bytes:
            reply = TaskResult.decode(endpoint(payload))
            if name == "silo-1" and reply.kind == "secagg_advertise":
                forged = MaskingKeys.generate().advertise("silo-1", impostor, b"anything")
                tensors = {
                    ADVERTISEMENT: torch.frombuffer(bytearray(forged.to_bytes()), dtype=torch.uint8)
                }
                return TaskResult(
                    reply.task_id, name, reply.kind, num_samples=reply.num_samples, tensors=tensors
                ).encode()
            return reply.encode()

        return answer

    (record,) = run(policy("masking"), substitute).records
    assert record.status == "failed"
    assert "not signed by silo-1's identity" in record.error


def transcript(p: Policy, wrap=lambda _, e: e) -> tuple[dict[str, list[TaskResult]], object]:
    """Every reply the coordinator receives, by silo."""
    received: dict[str, list[TaskResult]] = {}

    def record(name: str, endpoint: Endpoint) -> Endpoint:
        def answer(payload: bytes) -> bytes:
            reply = endpoint(payload)
            received.setdefault(name, []).append(TaskResult.decode(reply))
            return reply

        return wrap(name, answer)

    return received, run(p, record)


def true_updates(p: Policy) -> dict[str, np.ndarray]:
    """What each silo's round-1 training produces: the same seeds give the same models."""
    received, history = transcript(policy("none"))
    start = _initial_model(p)
    return {
        silo: (
            next(r for r in replies if r.kind == "train").tensors["model"].double() - start
        ).numpy()
        for silo, replies in received.items()
    }


def _initial_model(p: Policy) -> torch.Tensor:
    received, _ = transcript(policy("none"))
    return next(r for r in received["silo-0"] if r.kind == "init").tensors["model"].double()


def test_nothing_the_coordinator_receives_is_one_silos_update() -> None:
    p = policy("masking")
    updates = true_updates(p)
    received, history = transcript(p)
    encoding = FixedPoint.for_silos(64.0, SILOS)
    for silo, replies in received.items():
        encoded = encoding.encode(updates[silo], 0.2).view(np.int32).astype(np.float64)
        for reply in replies:
            for name, tensor in reply.tensors.items():
                if reply.kind == "init":
                    continue  # the seed's initial model, public
                values = tensor.double().numpy().ravel()
                if values.size != encoded.size:
                    continue  # keys, shares: far shorter than a model
                assert reply.kind == "secagg_mask", (silo, reply.kind, name)
                # a masked input is uniform in Z_2^32, unrelated to the update it hides: its
                # correlation with it is noise of spread 1/sqrt(n), kept within 5 spreads
                # (0.1 was 3.2 spreads at this model's n = 1058: a chance failure in ~200 runs)
                assert abs(np.corrcoef(values, encoded)[0, 1]) < 5 / np.sqrt(values.size)
                assert np.abs(values).mean() > 2**29
    assert history.records[0].status == "completed"


@pytest.mark.parametrize("step", ["secagg_mask", "secagg_confirm"])
def test_a_silo_declared_dropped_is_never_unmasked(step: str) -> None:
    """Dropped before its masked input, or a survivor that signed no statement: the others
    reveal its masking key's shares, never its self-mask's."""
    received, _ = transcript(policy("masking"), failing("silo-3", step))
    for silo, replies in received.items():
        if silo == "silo-3":
            continue
        (unmasked,) = [r for r in replies if r.kind == "secagg_unmask"]
        assert "key/silo-3" in unmasked.tensors  # its pairwise masks can be removed
        assert "seed/silo-3" not in unmasked.tensors  # its self-mask never


def test_a_second_unmask_request_is_refused() -> None:
    """Asked again, each silo refuses: the contract names one unmask task per aggregation and
    the agent answers a task id once; its unmask step itself refuses a second one too."""
    p = policy("masking")
    agents = silo_agents(p)
    asked: dict[str, int] = {}

    def ask_twice(name: str, endpoint: Endpoint) -> Endpoint:
        def answer(payload: bytes) -> bytes:
            task = TaskMessage.decode(payload)
            reply = endpoint(payload)
            if task.kind == "secagg_unmask":
                again = TaskResult.decode(endpoint(payload))
                asked[name] = 1
                assert not again.ok and "answered already" in (again.error or "")
                with pytest.raises(MaskingError, match="already unmasked"):
                    TASK_KINDS[task.kind].handler(task, agents[name].context)
            return reply

        return answer

    assert run(p, ask_twice, agents=agents).records[0].status == "completed"
    assert len(asked) == SILOS


def test_fixed_point_sums_cannot_overflow_for_the_configured_silos() -> None:
    encoding = FixedPoint.for_silos(64.0, 20)
    extreme = [encoding.encode(np.full(4, 1e9), 1 / 20) for _ in range(20)]
    total = np.sum(extreme, axis=0, dtype=np.uint32)
    assert encoding.decode(total) == pytest.approx(np.full(4, 64.0), abs=20 * encoding.precision)
    lowest = np.sum([encoding.encode(np.full(4, -1e9), 1 / 20) for _ in range(20)], axis=0)
    assert encoding.decode(lowest.astype(np.uint32)) == pytest.approx(np.full(4, -64.0), abs=1e-5)


def test_fixed_point_encodes_as_a_hand_computation_with_negatives_modulo_2_to_the_32() -> None:
    encoding = FixedPoint(bound=64.0, fraction_bits=24)  # for_silos(64, 10): 2^24 * 64 < 2^31
    values = np.array([100.0, -100.0, 1.5, -1.5, 2.0**-25, -(2.0**-24) * 0.75, 0.0])
    expected = [2**30, 2**32 - 2**30, 3 * 2**23, 2**32 - 3 * 2**23, 0, 2**32 - 1, 0]
    assert encoding.encode(values, 1.0).tolist() == expected  # clipped, rounded half to even
    assert encoding.encode(values, 0.5).tolist()[:2] == [2**29, 2**32 - 2**29]
    assert encoding.encode(values, 1.0).dtype == np.uint32


def test_masks_cancel_and_any_t_shares_rebuild_a_secret() -> None:
    names = ["a", "b", "c", "d"]
    keys = {n: MaskingKeys.generate() for n in names}
    seeds = {n: new_seed() for n in names}
    values = {n: np.arange(10, dtype=np.uint32) * (i + 1) for i, n in enumerate(names)}
    publics = {n: keys[n].masking.public_key for n in names}
    masked = {
        n: values[n]
        + mask_streams(
            10, n, seeds[n], keys[n].masking, {p: publics[p] for p in names if p != n}, b"x"
        )
        for n in names
    }
    survivors = ["a", "b", "d"]
    total = np.sum([masked[n] for n in survivors], axis=0, dtype=np.uint32)
    removal = unmask_terms(
        [seeds[n] for n in survivors], {"c": keys["c"].masking}, {n: publics[n] for n in survivors}
    )
    add_streams(total, removal, b"x")
    assert np.array_equal(total, sum(values[n] for n in survivors))
    secret = bytes(keys["c"].masking) + seeds["c"]
    shares = split_secret(secret, 3, 4)
    assert combine_shares({1: shares[0], 3: shares[2], 4: shares[3]}, 3) == secret
    with pytest.raises(MaskingError, match="2 shares cannot recover"):
        combine_shares({1: shares[0], 2: shares[1]}, 3)


@pytest.mark.parametrize("length", [0, 1, 5, 65536, 65537, 200_003])
def test_a_mask_stream_is_aes256_counter_mode_from_the_counter_gcm_encrypts_with(
    length: int,
) -> None:
    """Protocol version 3's PRG, derived here with another mode: AES-256-CTR from the counter
    block 0^96 || 2 (GCM's first for a 12-byte zero nonce) under HKDF-SHA256 of the seed for
    the context, read a chunk at a time without a seam."""
    seed, context = bytes(range(32)), b"consortium/r1/train|tensor=model"
    key = HKDF(SHA256(), 32, salt=None, info=b"fedsilo/secagg-prg|" + context).derive(seed)
    counter = Cipher(algorithms.AES(key), modes.CTR(bytes(12) + (2).to_bytes(4, "big")))
    expected = np.frombuffer(counter.encryptor().update(bytes(4 * length)), dtype="<u4")
    assert np.array_equal(prg(seed, length, context), expected)


@pytest.mark.parametrize(("threshold", "parties"), [(1, 3), (2, 2), (3, 5), (6, 10)])
def test_shamir_shares_are_pycryptodomes_and_any_threshold_of_them_recover_the_secret(
    threshold: int, parties: int
) -> None:
    """The field and encoding of PyCryptodome's Shamir (the reference it is checked against),
    reconstruction from any `threshold` shares, cached Lagrange coefficients included."""
    secret = bytes(range(32))
    shares = split_secret(secret, threshold, parties)
    for chosen in combinations(range(1, parties + 1), threshold):
        for _ in range(2):  # the second time from the cache
            assert combine_shares({i: shares[i - 1] for i in chosen}, threshold) == secret
    if threshold > 1:
        theirs = Shamir.split(threshold, parties, secret[:16])
        assert combine_shares(dict(theirs[-threshold:]), threshold) == secret[:16]
        mine = [(i, shares[i - 1][:16]) for i in range(1, threshold + 1)]
        assert Shamir.combine(mine) == secret[:16]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"algorithm": {"name": "local"}}, "local needs each silo's own model"),
        ({"data": {"source": "sklearn:breast_cancer", "scaling": "federated"}}, "no bound"),
        (
            {"secure_aggregation": {"method": "masking", "threshold": 6}},
            "exceeds the 5 silos",
        ),
        (
            {"secure_aggregation": {"method": "masking", "threshold": 2}},
            "threshold 2 of 5 silos lets a deviating coordinator",
        ),
        (
            {"algorithm": {"name": "feddc"}, "secure_aggregation": "masking"},
            "channel.sealed_handoffs",
        ),
        ({"secure_aggregation": "mask"}, "masking"),
    ],
)
def test_policies_that_cannot_aggregate_securely_are_refused(change: dict, message: str) -> None:
    with pytest.raises(PolicyError, match=message):
        parse_policy({**policy().model_dump(), **change})


# -- CKKS (TenSEAL): the same mean, the coordinator holding only the public context ------------

CKKS_GRID = 2.0 ** (GRID_BELOW_SCALE_BITS - 40)  # the decryptor's rounding at scale 2^40


def test_the_ckks_mean_equals_the_plaintext_mean_within_its_precision() -> None:
    plain, encrypted = run(policy("none", rounds=2)), run(policy("ckks", rounds=2))
    difference = (plain.state.model - encrypted.state.model).abs().max().item()
    # per round: the decryptor's rounding (half a grid step) plus CKKS noise, then float32
    assert 0 < difference <= 2 * (CKKS_GRID / 2 + 1e-8 + 1e-7)
    assert plain.final.summary["accuracy"]["mean"] == encrypted.final.summary["accuracy"]["mean"]


def test_a_silo_that_drops_after_joining_leaves_the_survivors_sum() -> None:
    encrypted = run(policy("ckks"), failing("silo-2", "ckks_encrypt"))
    plain = run(policy("none"), failing("silo-2", "train"))
    difference = (plain.state.model - encrypted.state.model).abs().max().item()
    assert difference <= CKKS_GRID / 2 + 1e-8 + 1e-7
    assert "silo-2" in encrypted.records[0].phases["train"]["dropped"]


def test_the_key_holder_makes_the_keys_and_a_failed_decryptor_is_replaced() -> None:
    p = policy("ckks", rounds=2, secure_aggregation={"method": "ckks", "key_holder": "silo-3"})
    received, history = transcript(p, failing("silo-3", "ckks_decrypt"))
    kinds = {silo: [r.kind for r in replies] for silo, replies in received.items()}
    assert [s for s, k in kinds.items() if "ckks_keygen" in k] == ["silo-3"]
    assert kinds["silo-3"].count("ckks_keygen") == 1  # once per deployment, not per round
    # silo-3 (the decryptor by default) fails before the transcript sees it; silo-0 stands in
    assert [s for s, k in kinds.items() if "ckks_decrypt" in k] == ["silo-0"]
    assert [r.status for r in history.records] == ["completed", "completed"]
    dropped = history.records[0].phases["train"]["dropped"]
    assert dropped == {
        "silo-3": "secure aggregation, decrypt: task failed at the silo (error): power cut"
    }


def test_a_key_holder_that_fails_is_replaced_by_the_next_member_unless_the_policy_names_it() -> (
    None
):
    received, history = transcript(policy("ckks"), failing("silo-0", "ckks_keygen"))
    assert [s for s, rs in received.items() if any(r.kind == "ckks_keygen" for r in rs)] == [
        "silo-1"
    ]
    assert history.records[0].status == "completed"
    named = policy("ckks", secure_aggregation={"method": "ckks", "key_holder": "silo-0"})
    (record,) = run(named, failing("silo-0", "ckks_keygen")).records
    assert record.status == "failed" and "no key holder made usable keys" in record.error


def test_the_sealed_context_travels_until_a_silo_has_joined_and_again_after_a_failed_join() -> None:
    sealed_to: list[tuple[int, str]] = []

    def watch(name: str, endpoint: Endpoint) -> Endpoint:
        def answer(payload: bytes) -> bytes:
            task = TaskMessage.decode(payload)
            if task.kind == "ckks_join" and SEALED_CONTEXT in task.tensors:
                sealed_to.append((task.round, name))
            return endpoint(payload)

        return failing("silo-1", "ckks_join", round_no=2)(name, answer)

    history = run(policy("ckks", rounds=3), watch)
    assert [r.status for r in history.records] == ["completed"] * 3
    assert sorted(sealed_to) == [(1, f"silo-{i}") for i in range(SILOS)] + [(3, "silo-1")]


def test_the_coordinator_holds_only_the_public_context_and_ciphertexts() -> None:
    p = policy("ckks")
    updates = true_updates(p)
    received, history = transcript(p)
    (keygen,) = [r for r in received["silo-0"] if r.kind == "ckks_keygen"]
    public = load_public_context(bytes(keygen.tensors[PUBLIC_CONTEXT].numpy()))
    assert not public.has_secret_key()
    for silo, replies in received.items():
        (encrypted,) = [r for r in replies if r.kind == "ckks_encrypt"]
        raw = b"".join(bytes(t.numpy()) for t in encrypted.tensors.values())
        weighted = (updates[silo] * 0.2).astype(np.float64)
        assert (
            weighted.tobytes()[:64] not in raw
            and weighted.astype(np.float32).tobytes()[:64] not in raw
        )
        with pytest.raises(ValueError, match="secret key"):
            decrypt(
                [bytes(t.numpy()) for t in encrypted.tensors.values()], public, updates[silo].size
            )
    assert history.records[0].status == "completed"


def test_a_sealed_context_opens_only_at_its_recipient() -> None:
    holder, other, stranger = SigningKey.generate(), PrivateKey.generate(), PrivateKey.generate()
    secret = new_secret_context()
    sealed = seal_context(secret, other.public_key, holder)
    assert open_sealed_context(sealed, other, holder.verify_key) == secret
    with pytest.raises(CryptoError):
        open_sealed_context(sealed, stranger, holder.verify_key)


def test_a_context_the_coordinator_substitutes_is_refused_by_every_silo() -> None:
    impostor = SigningKey.generate()
    forged = new_secret_context()
    sealing = {f"silo-{i}": PrivateKey.generate() for i in range(SILOS)}

    def substitute(name: str, endpoint: Endpoint) -> Endpoint:
        def answer(payload: bytes) -> bytes:
            task = TaskMessage.decode(payload)
            if task.kind != "ckks_join":
                return endpoint(payload)
            recipient = task.tensors[SEALED_CONTEXT]  # the coordinator reseals its own key
            assert recipient.numel() > 0
            fake = seal_context(forged, sealing[name].public_key, impostor)  # public keys
            tensors = {SEALED_CONTEXT: torch.frombuffer(bytearray(fake), dtype=torch.uint8)}
            forged_digest = context_digest(public_context(forged))
            altered = replace(
                task,
                config=replace(task.config, context_digest=forged_digest),
                tensors=tensors,
            )
            return endpoint(altered.encode())

        return answer

    (record,) = run(policy("ckks"), substitute, sealing=sealing).records
    assert record.status == "failed"
    assert "not signed by silo-0's identity" in record.error


def test_a_second_decryption_is_refused() -> None:
    """Asked again, the decryptor refuses: the contract names one decrypt task per aggregation
    and the agent answers a task id once; its decrypt step itself refuses a second one too."""
    p = policy("ckks")
    agents = silo_agents(p)
    refused: list[str] = []

    def ask_twice(name: str, endpoint: Endpoint) -> Endpoint:
        def answer(payload: bytes) -> bytes:
            task = TaskMessage.decode(payload)
            reply = endpoint(payload)
            if task.kind == "ckks_decrypt":
                again = TaskResult.decode(endpoint(payload))
                refused.append(again.error or "")
                with pytest.raises(CkksError, match="already decrypted"):
                    TASK_KINDS[task.kind].handler(task, agents[name].context)
            return reply

        return answer

    assert run(p, ask_twice, agents=agents).records[0].status == "completed"
    assert len(refused) == 1 and "answered already" in refused[0]


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"method": "ckks", "threshold": 3}, "only masking recovers"),
        ({"method": "masking", "key_holder": "silo-1"}, "only ckks has keys"),
        ({"method": "ckks", "ckks": {"poly_modulus_degree": 1000}}, "poly_modulus_degree"),
        ({"method": "ckks", "ckks": {"coeff_mod_bit_sizes": [60, 60, 60, 60]}}, "128-bit"),
        (
            {"method": "ckks", "ckks": {"coeff_mod_bit_sizes": [30, 30], "global_scale_bits": 24}},
            "bound 64",
        ),
    ],
)
def test_ckks_settings_that_cannot_work_are_refused(section: dict, message: str) -> None:
    with pytest.raises(PolicyError, match=message):
        parse_policy({**policy().model_dump(), "secure_aggregation": section})


# -- the policy's rules for a deviating coordinator ------------------------------------------


@pytest.mark.parametrize("bound", [1e300, float("inf"), float("nan")])
def test_a_bound_that_leaves_no_precision_is_refused_naming_the_field(bound: float) -> None:
    with pytest.raises(PolicyError, match=r"secure_aggregation\.bound"):
        parse_policy(
            {**policy().model_dump(), "secure_aggregation": {"method": "masking", "bound": bound}}
        )


@pytest.mark.parametrize(
    ("silos", "threshold", "problem"),
    [
        (5, 2, "use at least 4"),  # floor(2 * 5 / 3) + 1
        (5, 6, "exceeds the 5 silos"),
        (1, None, "min_group: 2 silos at least"),
        (5, 4, None),
        (9, None, None),
    ],
)
def test_a_threshold_below_the_active_coordinator_bound_is_a_policy_problem(
    silos: int, threshold: int | None, problem: str | None
) -> None:
    section = SecureAggregationConfig(method="masking", threshold=threshold)
    found = section.group_problem(silos)
    assert found is None if problem is None else problem in (found or "")


def test_a_weight_floor_no_weights_could_pass_is_a_policy_problem() -> None:
    section = SecureAggregationConfig(method="masking", min_weight=0.3)
    assert "above the uniform weight 1/4" in (section.group_problem(4) or "")
    assert section.group_problem(3) is None


def test_silos_use_at_least_two_thirds_of_the_group_as_threshold_whatever_the_policy_says() -> None:
    lenient = SecureAggregationConfig(method="masking").model_copy(update={"threshold": 2})
    assert [lenient.threshold_for(n) for n in (2, 3, 4, 5, 9)] == [2, 3, 3, 4, 7]


def test_honest_sample_count_weights_on_the_four_hospitals_pass_the_default_weight_rule() -> None:
    section = SecureAggregationConfig(method="masking")
    counts = {"cleveland": 303, "hungarian": 294, "switzerland": 123, "va": 200}
    weights = {s: n / sum(counts.values()) for s, n in counts.items()}
    floor = section.weight_floor(len(counts))
    assert floor == 1 / 8
    for silo in counts:
        assert weight_problem(weights, silo, counts, section.min_group, floor, counts) is None
    skewed = {s: (0.95 if s == "va" else 0.05 / 3) for s in counts}
    assert "min_weight" in (
        weight_problem(skewed, "va", counts, section.min_group, floor, counts) or ""
    )


@pytest.mark.parametrize("method", ["masking", "ckks"])
def test_the_release_gate_lets_no_model_leave_in_the_clear_under_secure_aggregation(
    method: str,
) -> None:
    p = policy(method)
    ctx = SiloContext("silo-0", load_consortium(p.data, seed=5)[0], p, torch.device("cpu"))

    def refused(config: TaskConfig | str) -> str | None:
        """Why the gate refuses a task of `config` (a kind: its example config)."""
        typed = ONE_PER_KIND[config] if isinstance(config, str) else config
        return refusal(TaskMessage("t", 1, "train", "silo-0", typed), ctx)

    def wrapping(inner: TaskConfig) -> TaskConfig:
        if method == "masking":
            return MaskedInput(inner=inner, weights={}, shares={}, tensors=("model",))
        return EncryptedInput(inner=inner, weights={}, tensors=("model",))

    @dataclass(frozen=True, kw_only=True)
    class Unclassified(TaskConfig):
        KIND: ClassVar[str] = "no_such_kind"

    for kind in ("train", "superfed_train", "energy_signals", "feature_moments"):
        assert f"secure_aggregation {method}" in (refused(kind) or "")
    assert refused(DaisyTrain(train=TRAIN, send=True))
    assert refused(DaisyTrain(train=TRAIN, handoff=Handoff()))  # unsealed hand-off
    assert refused(DaisyTrain(train=TRAIN, handoff=Handoff(seal_to="ab"))) is None
    for kind in ("init", "evaluate", "loss", "daisy_evaluate", "superfed_evaluate"):
        assert refused(kind) is None
    own, other = ("secagg", "ckks") if method == "masking" else ("ckks", "secagg")
    wrapper = "secagg_mask" if method == "masking" else "ckks_encrypt"
    assert refused(wrapping(TRAIN)) is None
    assert refused(wrapping(EvaluateTask()))  # nothing to mask: a wrapper of no update
    assert all(refused(k) for k in TASK_KINDS if k.startswith(other + "_"))
    assert not any(refused(k) for k in TASK_KINDS if k.startswith(own + "_") and k != wrapper)
    assert refused(Unclassified())


def test_fedsilo_simulate_names_the_deployment_alike_at_the_engine_and_the_silos() -> None:
    # The aggregation label binds the masks to the deployment: named differently by the engine
    # and the silos, the self-masks would not come off and the mean would be noise.
    plain, masked = (simulate(policy(s, rounds=2)) for s in ("none", "masking"))
    difference = (plain.history.state.model - masked.history.state.model).abs().max().item()
    assert difference <= 2 * (SILOS * PRECISION / 2 + 1e-7)
