"""Update compression (`compression:`, docs/compression.md) as a specification: the quantizer's
properties (wire/quantized.py), the policy's refusals (one message, naming the key), what a
silo sends under its own policy and refuses under another (its contract), the coordinator's
decoding (the same bits whatever order the answers arrive in, however they are sliced), DP
(quantization is post-processing: the ledger books the same epsilon), and consortia run
through the real engine and silo agents: fewer bytes, the accuracy of the uncompressed run."""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bench import compression as compression_bench
from bench.compression import bench_policy, run_consortium
from fedsilo.coordinator import running_mean
from fedsilo.coordinator.cross_site import GLOBAL_ROW
from fedsilo.coordinator.phases import WeightedMean
from fedsilo.coordinator.replies import Accepted, Dropout, SliceReader, accept
from fedsilo.coordinator.running_mean import RunningMean
from fedsilo.ops.contract_testing import check_silo_contract
from fedsilo.ops.simulate import load_silos
from fedsilo.policies.algorithms.base import algorithm_classes, names_of
from fedsilo.policies.algorithms.contract import Position, derived_train
from fedsilo.policies.loading import PolicyError, parse_policy
from fedsilo.policies.schema import Policy
from fedsilo.privacy.ledger import PrivacyLedger
from fedsilo.silo.agent import SiloAgent
from fedsilo.wire.messages import TaskMessage, TaskResult
from fedsilo.wire.payload import SpooledPayload, as_payload, digest_of
from fedsilo.wire.quantized import ScaleLayout, dequantize, quantize
from fedsilo.wire.tasks import Quantization, TrainTask, decode_task_config
from fedsilo.wire.tasks.tensor_names import MODEL, SCALES
from fedsilo.wire.tensors import ParameterSpec, TensorSpec, WireError
from tests.deployment import SILOS, free_port, policy_document, provision, sample, wait_for
from tests.silos import agent, answer, honest
from tests.test_bad_input import assert_refused, invoke
from tests.test_cross_site_validation import breast_cancer, matrix_of
from tests.test_deployment import scrape_at_round
from tests.wire_tasks import LOCAL

LEVELS = {8: 127, 16: 32767}

# -- the quantizer --------------------------------------------------------------------------------

# finite float32 values, 0 or at least 1e-30 in magnitude (so no group's scale, its largest
# magnitude over L, underflows float32)
finite = st.floats(-(2.0**100), 2.0**100, width=32, allow_subnormal=False).filter(
    lambda v: v == 0 or abs(v) >= 1e-30
)
quantizations = st.builds(
    Quantization, bits=st.sampled_from([8, 16]), block_size=st.none() | st.integers(1, 40)
)


@st.composite
def updates(draw: st.DrawFn) -> tuple[list[int], torch.Tensor]:
    """The sizes of a model's parameter tensors (some empty) and an update of that model."""
    sizes = draw(st.lists(st.integers(0, 90), min_size=1, max_size=4))
    values = draw(st.lists(finite, min_size=sum(sizes), max_size=sum(sizes)))
    return sizes, torch.tensor(values, dtype=torch.float32)


def quantized(
    received: torch.Tensor,
    trained: torch.Tensor,
    quantization: Quantization,
    sizes: list[int],
    seed: int = 0,
    norm_bound: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return quantize(received, trained, quantization, sizes, generator, norm_bound)


def per_value(scales: torch.Tensor, layout: ScaleLayout) -> torch.Tensor:
    """Each value's scale, in float64 (the layout applied to ones)."""
    ones = torch.ones(layout.numel, dtype=torch.float64)
    layout.scale_in_place(ones, scales.double(), 0)
    return ones


@settings(max_examples=200, deadline=None)
@given(updates(), quantizations, st.integers(0, 2**32 - 1))
def test_every_quantized_value_is_within_l_and_decodes_within_one_scale_of_the_update(
    update: tuple[list[int], torch.Tensor], quantization: Quantization, seed: int
) -> None:
    """For any finite update: |q| <= L = 2^(bits-1) - 1, the scales are non-negative, one per
    group, and |q * scale - u| <= scale for every value."""
    sizes, u = update
    q, scales = quantized(torch.zeros_like(u), u, quantization, sizes, seed)
    layout = ScaleLayout.of(sizes, quantization.block_size)
    assert q.dtype == (torch.int8 if quantization.bits == 8 else torch.int16)
    assert bool((q.int().abs() <= LEVELS[quantization.bits]).all())
    assert scales.shape == (layout.count,) and bool((scales >= 0).all())
    step = per_value(scales, layout)
    error = (q.double() * step - u.double()).abs()
    assert bool((error <= step * (1 + 1e-9)).all())


@settings(max_examples=100, deadline=None)
@given(
    st.integers(1, 300),
    st.integers(16, 64),
    st.sampled_from([8, 16]),
    st.lists(finite, min_size=1, max_size=1),
)
def test_a_tensors_last_block_may_be_shorter_and_each_block_has_its_own_absmax_scale(
    size: int, block: int, bits: int, spike: list[float]
) -> None:
    u = torch.linspace(-1, 1, size, dtype=torch.float32)
    u[size // 2] = spike[0]
    q, scales = quantized(torch.zeros(size), u, Quantization(bits=bits, block_size=block), [size])
    blocks = u.double().split(block)
    assert len(scales) == len(blocks) == -(-size // block)
    assert len(blocks[-1]) == size - block * (len(blocks) - 1)
    for scale, values in zip(scales, blocks, strict=True):
        assert float(scale) == float(torch.tensor(float(values.abs().max()) / LEVELS[bits]))


@given(st.lists(st.integers(0, 50), min_size=1, max_size=3), quantizations)
def test_a_zero_update_travels_as_zeros_and_decodes_to_the_model_sent(
    sizes: list[int], quantization: Quantization
) -> None:
    received = torch.randn(sum(sizes), generator=torch.Generator().manual_seed(sum(sizes)))
    q, scales = quantized(received, received.clone(), quantization, sizes)
    assert not q.any() and not scales.any()
    layout = ScaleLayout.of(sizes, quantization.block_size)
    assert torch.equal(dequantize(q, scales, received, layout), received)


@pytest.mark.parametrize(
    "quantization", [Quantization(bits=8), Quantization(bits=16, block_size=7)]
)
def test_stochastic_rounding_is_unbiased(quantization: Quantization) -> None:
    """E[q * scale] = u: the mean of 4000 independent roundings of one update (drawn from
    fixed seeds) is within five standard errors (at most scale / (2 sqrt(4000)) each) of u."""
    u = torch.linspace(-0.9, 1.0, 49, dtype=torch.float32)
    repeats = 4000
    tiled = u.repeat(repeats)  # one tensor per repeat: every repeat gets the same scales
    q, scales = quantized(torch.zeros_like(tiled), tiled, quantization, [len(u)] * repeats)
    layout = ScaleLayout.of([len(u)] * repeats, quantization.block_size)
    decoded = (q.double() * per_value(scales, layout)).view(repeats, len(u))
    step = per_value(scales, layout)[: len(u)]
    assert bool(((decoded.mean(0) - u.double()).abs() <= 5 * step / (2 * repeats**0.5)).all())


@settings(max_examples=60, deadline=None)
@given(updates(), quantizations, st.floats(1e-3, 10.0))
def test_under_a_norm_bound_the_decoded_update_is_no_longer_than_it(
    update: tuple[list[int], torch.Tensor], quantization: Quantization, bound: float
) -> None:
    """Client-level DP's clip holds for what the coordinator decodes, rounding included."""
    sizes, u = update
    u = u / max(float(u.double().norm()), 1e-30) * bound  # clipped to the bound, as a silo does
    q, scales = quantized(torch.zeros_like(u), u, quantization, sizes, norm_bound=bound)
    decoded = q.double() * per_value(scales, ScaleLayout.of(sizes, quantization.block_size))
    assert float(decoded.norm()) <= bound * (1 + 1e-6)


def test_a_non_finite_update_is_not_quantized() -> None:
    trained = torch.tensor([1.0, math.nan, 2.0])
    with pytest.raises(ValueError, match="not finite"):
        quantized(torch.zeros(3), trained, Quantization(bits=8), [3])


def test_the_same_seed_rounds_the_same_way_and_another_seed_differently() -> None:
    u = torch.linspace(-1, 1, 1000)
    first = quantized(torch.zeros(1000), u, Quantization(bits=8, block_size=64), [1000], 1)
    again = quantized(torch.zeros(1000), u, Quantization(bits=8, block_size=64), [1000], 1)
    other = quantized(torch.zeros(1000), u, Quantization(bits=8, block_size=64), [1000], 2)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert not torch.equal(first[0], other[0])


def test_a_task_carries_compression_as_one_json_object_and_refuses_other_bit_widths() -> None:
    task = TrainTask(local=LOCAL, compression=Quantization(bits=8, block_size=256))
    assert task.to_json()["compression"] == {"bits": 8, "block_size": 256}
    assert decode_task_config("train", task.to_json()) == task
    with pytest.raises(WireError, match="8 or 16 bits"):
        decode_task_config("train", task.to_json() | {"compression": {"bits": 4}})


# -- the policy -----------------------------------------------------------------------------------


def policy(compression: Any, **sections: Any) -> Policy:
    document = {"version": 1, "rounds": 1, "compression": compression, **sections}
    return parse_policy(document)


def refusal(compression: Any, **sections: Any) -> str:
    with pytest.raises(PolicyError) as refused:
        policy(compression, **sections)
    message = str(refused.value)
    assert "\n" not in message
    return message


CAPABLE = {name for cls in algorithm_classes() if cls.compresses_updates for name in names_of(cls)}
FEDAVG_FAMILY = {"fedavg", "fedprox", "approx_fedavg", "fedadam", "fedyogi", "fedadagrad"}
LOSS_WEIGHTED = {"afl", "agnostic_fedavg", "qfedavg", "term", "propfair", "aaggff"}


def test_the_fedavg_family_and_the_loss_weighted_schedules_can_compress_and_no_other() -> None:
    assert FEDAVG_FAMILY | LOSS_WEIGHTED == CAPABLE


@pytest.mark.parametrize(
    "name",
    ["scaffold", "feddc", "cyclic", "superfed", "fedevg", "multiboost", "drfa", "feddro", "local"],
)
def test_an_algorithm_that_cannot_use_compression_is_refused_naming_it_and_those_that_can(
    name: str,
) -> None:
    settings_ = {"channel": {"sealed_handoffs": True}} if name in ("feddc", "cyclic") else {}
    training = {"training": {"steps": 3}} if name == "drfa" else {}
    message = refusal({"bits": 8}, algorithm={"name": name}, **settings_, **training)
    assert "compression: " in message
    assert name in message and "fedavg" in message and "qfedavg" in message


@pytest.mark.parametrize(
    ("compression", "named"),
    [
        ({"bits": 4}, "compression.bits"),
        ({"bits": 32}, "compression.bits"),
        ({"bits": True}, "bits"),
        ({"scale": "block"}, "compression.bits"),
        ({"bits": 8, "scale": "tensor", "block_size": 64}, "compression.block_size"),
        ({"bits": 8, "block_size": 8}, "compression.block_size"),
        ({"bits": 8, "scale": "row"}, "compression.scale"),
        ({"bits": 8, "blocks": 64}, "blocks"),
    ],
)
def test_a_bad_compression_section_is_refused_in_one_message_naming_its_key(
    compression: dict[str, Any], named: str
) -> None:
    assert named in refusal(compression)


@pytest.mark.parametrize(
    ("sections", "named"),
    [
        ({"secure_aggregation": "masking"}, "secure_aggregation masking"),
        ({"secure_aggregation": "ckks"}, "secure_aggregation ckks"),
        (
            {"privacy": {"client_dp": {"clip": 1.0, "noise_multiplier": 1.0}}},
            "noise 'distributed'",
        ),
    ],
)
def test_compression_where_the_coordinator_cannot_decode_each_update_alone_is_refused(
    sections: dict[str, Any], named: str
) -> None:
    message = refusal({"bits": 8}, **sections)
    assert "compression: " in message and named in message


def test_compression_composes_with_robust_rules_dp_sgd_and_central_client_dp() -> None:
    policy({"bits": 8}, algorithm={"name": "fedavg", "robust": {"name": "median"}})
    policy({"bits": 16}, privacy={"dp_sgd": {"noise_multiplier": 1.0}})
    client_dp = {"clip": 1.0, "noise_multiplier": 1.0, "noise": "central"}
    policy({"bits": 8}, privacy={"client_dp": client_dp})


def test_the_command_line_refuses_compression_under_scaffold_with_exit_status_1(
    tmp_path: Path,
) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("version: 1\nalgorithm: {name: scaffold}\ncompression: {bits: 8}\n")
    assert_refused(invoke("policy", "validate", str(path)), "compression", "scaffold")


@pytest.mark.parametrize("compression", [None, {"bits": 8}, {"bits": 16, "scale": "tensor"}])
def test_the_section_reads_back_from_the_policy_it_dumps(compression: Any) -> None:
    """What the signed copy a silo reads, and every re-validation of a policy, relies on."""
    written = policy(compression)
    assert Policy.model_validate(written.model_dump()) == written


def test_without_compression_a_train_task_is_worded_as_before_and_with_it_carries_the_section() -> (
    None
):
    position = Position(1, "train", "silo-0")
    assert "compression" not in derived_train(policy(None), position).to_json()
    assert derived_train(policy({"bits": 8}), position).compression == Quantization(
        bits=8, block_size=256
    )
    assert derived_train(
        policy({"bits": 16, "scale": "tensor"}), position
    ).compression == Quantization(bits=16)


# -- a silo, under its own policy -----------------------------------------------------------------

SILO_DATA = {"source": "sklearn:breast_cancer", "partition": {"kind": "iid", "silos": 3}}


def silo_policy(compression: Any = None, **sections: Any) -> Policy:
    document = {"version": 1, "rounds": 2, "data": SILO_DATA, **sections}
    if compression is not None:
        document["compression"] = compression
    return parse_policy(document)


@functools.cache
def first_silo_data() -> Any:
    """The first of SILO_DATA's silos (the same under every policy here)."""
    return load_silos(silo_policy(), None)[0]


def silo(policy: Policy) -> SiloAgent:
    return agent(first_silo_data(), policy)


def train_task(site: SiloAgent, **chosen: Any) -> TaskMessage:
    spec = site.context.facts.spec
    model = torch.linspace(-0.5, 0.5, spec.numel)
    return honest(site, "train", 1, {MODEL: model}, spec, **chosen)


def test_a_silo_whose_policy_asks_sends_its_update_quantized_and_decodable() -> None:
    site = silo(silo_policy({"bits": 8}))
    task = train_task(site)
    result = answer(site, task)
    assert result.ok, result.error
    assert set(result.tensors) == {MODEL, SCALES + MODEL}
    assert result.tensors[MODEL].dtype == torch.int8
    plain = answer(silo(silo_policy()), train_task(silo(silo_policy())))
    layout = ScaleLayout.of([e.numel for e in task.spec.entries], 256)
    decoded = dequantize(result.tensors[MODEL], result.tensors[SCALES + MODEL],
                         task.tensors[MODEL], layout)  # fmt: skip
    step = per_value(result.tensors[SCALES + MODEL], layout)
    assert bool(((decoded.double() - plain.tensors[MODEL].double()).abs() <= step + 1e-6).all())


def test_a_silo_whose_policy_does_not_ask_refuses_a_task_that_would_have_it_quantize() -> None:
    """A coordinator cannot turn compression on: the silo holds the task to its own policy."""
    site = silo(silo_policy())
    result = answer(site, train_task(site, compression=Quantization(bits=8)))
    assert not result.ok and "config key 'compression' is set" in (result.error or "")


@pytest.mark.parametrize(
    "compression", [None, Quantization(bits=16, block_size=256), Quantization(bits=8)]
)
def test_a_silo_whose_policy_asks_refuses_a_task_with_other_compression(
    compression: Quantization | None,
) -> None:
    site = silo(silo_policy({"bits": 8}))
    result = answer(site, train_task(site, compression=compression))
    assert not result.ok and "compression" in (result.error or "")


@pytest.mark.parametrize(
    ("privacy", "silo_epsilon"),
    [
        ({"dp_sgd": {"noise_multiplier": 1.0, "max_grad_norm": 1.0}}, True),
        ({"client_dp": {"clip": 0.05, "noise_multiplier": 1.0, "noise": "central"}}, False),
    ],
    ids=["dp_sgd", "client_dp"],
)
def test_quantization_is_post_processing_the_ledger_books_the_same_epsilon(
    privacy: dict[str, Any], silo_epsilon: bool, tmp_path: Path
) -> None:
    """Noise first (in training, or on the clipped update), then the quantization of what is
    released: the silo books the same releases, and the same epsilon, with and without it
    (under central client-level DP the silo's epsilon is none: the coordinator adds the noise,
    and its published epsilon counts on the clip, which the next test holds)."""
    booked = []
    for compression in (None, {"bits": 8}):
        ledger = PrivacyLedger(tmp_path / f"{compression is None}.jsonl")
        site = agent(first_silo_data(), silo_policy(compression, privacy=privacy), ledger=ledger)
        result = answer(site, train_task(site))
        assert result.ok, result.error
        booked.append(([record.mechanism for record in ledger.records()], result.epsilon))
    assert booked[0] == booked[1] and booked[0][0]
    assert (booked[0][1] is not None and booked[0][1] > 0) == silo_epsilon


def test_under_client_dp_the_update_the_coordinator_decodes_stays_within_the_clip() -> None:
    clip = 0.05
    client_dp = {"clip": clip, "noise_multiplier": 1.0, "noise": "central"}
    site = silo(silo_policy({"bits": 8}, privacy={"client_dp": client_dp}))
    task = train_task(site)
    result = answer(site, task)
    layout = ScaleLayout.of([e.numel for e in task.spec.entries], 256)
    scales = result.tensors[SCALES + MODEL]
    decoded = result.tensors[MODEL].double() * per_value(scales, layout)
    assert 0 < float(decoded.norm()) <= clip * (1 + 1e-6)


def test_a_compressing_silos_every_honest_task_passes_its_contract_and_every_mutation_fails() -> (
    None
):
    """The silo-contract property of every algorithm (tests/test_silo_contracts.py), with the
    compression key among what a coordinator may not change."""
    run = check_silo_contract(silo_policy({"bits": 8}), examples=40)
    trains = [a.message for a in run.arrivals if a.message.kind == "train"]
    assert trains and all(m.config.compression == Quantization(bits=8, block_size=256)
                          for m in trains)  # fmt: skip


# -- the coordinator's decoding -------------------------------------------------------------------

SPEC = ParameterSpec((TensorSpec("w", (5, 7)), TensorSpec("b", (5,))))
QUANTIZATION = Quantization(bits=8, block_size=16)


def sent_task(silo_name: str, reference: torch.Tensor) -> TaskMessage:
    config = TrainTask(local=LOCAL, compression=QUANTIZATION)
    return TaskMessage(f"t-{silo_name}", 1, "train", silo_name, config, {MODEL: reference}, SPEC)


def quantized_answer(sent: TaskMessage, trained: torch.Tensor, **replaced: Any) -> bytes:
    q, scales = quantized(sent.tensors[MODEL], trained, QUANTIZATION, [35, 5], seed=len(sent.silo))
    tensors = {MODEL: q, SCALES + MODEL: scales} | replaced
    return TaskResult(
        sent.task_id, sent.silo, "train", num_samples=10, tensors=tensors, spec=SPEC
    ).encode()


def accepted(sent: TaskMessage, trained: torch.Tensor, **replaced: Any) -> Accepted | Dropout:
    return accept(as_payload(quantized_answer(sent, trained, **replaced)), sent, WeightedMean())


def test_the_coordinator_reads_a_quantized_answer_as_the_model_sent_plus_q_times_scale() -> None:
    reference = torch.linspace(-1, 1, 40)
    sent = sent_task("a", reference)
    trained = reference + torch.linspace(0.3, -0.2, 40)
    reply = accepted(sent, trained)
    assert isinstance(reply, Accepted) and set(reply.lazy) == {MODEL}
    q, scales = quantized(reference, trained, QUANTIZATION, [35, 5], seed=1)
    layout = ScaleLayout.of([35, 5], 16)
    assert torch.equal(reply.lazy[MODEL].load(), dequantize(q, scales, reference, layout))
    assert reply.lazy[MODEL].dtype == torch.float32 and reply.lazy[MODEL].shape == (40,)


@pytest.mark.parametrize(
    ("replaced", "reason"),
    [
        ({MODEL: torch.zeros(40)}, "'model' is (40,) float32"),
        ({MODEL: torch.zeros(40, dtype=torch.int16)}, "'model' is (40,) int16"),
        ({MODEL: torch.zeros(39, dtype=torch.int8)}, "'model' is (39,) int8"),
        ({SCALES + MODEL: torch.zeros(3)}, "(4,) float32 scales"),
        ({SCALES + MODEL: torch.full((4,), math.inf)}, "negative or not finite"),
        ({SCALES + MODEL: -torch.ones(4)}, "negative or not finite"),
    ],
    ids=["float model", "16 bits", "short", "scales", "infinite scale", "negative scale"],
)
def test_an_answer_that_is_not_the_quantized_update_asked_for_is_that_silos_dropout(
    replaced: dict[str, torch.Tensor], reason: str
) -> None:
    sent = sent_task("a", torch.zeros(40))
    reply = accepted(sent, torch.ones(40), **replaced)
    assert isinstance(reply, Dropout) and reply.reason.startswith("malformed reply")
    assert reason in reply.reason


def test_an_answer_without_its_scales_is_that_silos_dropout() -> None:
    sent = sent_task("a", torch.zeros(40))
    q, _ = quantized(torch.zeros(40), torch.ones(40), QUANTIZATION, [35, 5])
    payload = TaskResult("t-a", "a", "train", num_samples=3, tensors={MODEL: q}, spec=SPEC).encode()
    reply = accept(as_payload(payload), sent, WeightedMean())
    assert isinstance(reply, Dropout) and "scales/model" in reply.reason


@settings(max_examples=25, deadline=None)
@given(st.permutations(["a", "b", "c", "d"]), st.integers(1, 45), st.booleans())
def test_the_mean_of_quantized_answers_has_the_same_bits_whatever_their_order_and_slicing(
    order: list[str], slice_elements: int, at_the_end: bool
) -> None:
    """Summed as they arrive or all at the end, in slices of any size: the same bits."""
    reference = torch.linspace(-1, 1, 40)
    trained = {s: reference + (i + 1) * torch.linspace(0.1, -0.3, 40) for i, s in enumerate("abcd")}
    replies = {s: accepted(sent_task(s, reference), trained[s]) for s in "abcd"}

    def mean(silos: list[str]) -> torch.Tensor:
        summed = RunningMean(WeightedMean(), silos)
        for silo_name in silos:
            summed.accepted(silo_name, replies[silo_name])  # type: ignore[arg-type]
        return summed.mean(replies)[0][MODEL]  # type: ignore[arg-type]

    expected = mean(list("abcd"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(running_mean, "SLICE_ELEMENTS", slice_elements)
        if at_the_end:
            patch.setattr(running_mean, "RUNNING_SUM_BYTES", 0)
        assert torch.equal(mean(order), expected)
    decoded = {s: r.lazy[MODEL].load().double() for s, r in replies.items()}  # type: ignore[union-attr]
    assert torch.allclose(expected.double(), sum(decoded.values()) / 4, atol=1e-6)


def test_a_spooled_quantized_answer_reads_as_the_same_model_as_one_held_in_memory(
    tmp_path: Path,
) -> None:
    """An answer above the spooling threshold waits on disk; its slices are copied into the
    reader's buffers and decoded alike."""
    reference = torch.linspace(-1, 1, 40)
    sent = sent_task("a", reference)
    data = quantized_answer(sent, reference + torch.linspace(0.2, -0.4, 40))
    spooled = SpooledPayload(str(tmp_path))
    spooled.append(data)
    from_disk = accept(spooled.seal(digest_of([data])), sent, WeightedMean())
    in_memory = accept(as_payload(data), sent, WeightedMean())
    assert isinstance(from_disk, Accepted) and isinstance(in_memory, Accepted)
    reader = SliceReader()
    sliced = torch.cat([reader.peek(from_disk.lazy[MODEL], a, min(a + 7, 40)).clone()
                        for a in range(0, 40, 7)])  # fmt: skip
    assert torch.equal(sliced, in_memory.lazy[MODEL].load())


# -- consortia through the real engine and silo agents --------------------------------------------

ROUNDS = 3


@functools.cache
def run(compression: str, seed: int = 0, robust: bool = False) -> dict[str, Any]:
    written = bench_policy("digits", compression, seed, ROUNDS)
    if robust:
        document = written.model_dump() | {"algorithm": {"name": "fedavg",
                                                         "robust": {"name": "median"}}}  # fmt: skip
        written = Policy.model_validate(document)
    history, sites = run_consortium(written)
    return {
        "accuracy": history.final.summary["accuracy"]["weighted_mean"],
        "train_upload": sum(site.sent["train"] for site in sites),
        "model": history.state.model,
    }


@pytest.mark.parametrize(("compression", "fewer"), [("8-bit block", 3.5), ("16-bit block", 1.9)])
def test_fedavg_with_compression_sends_about_4x_or_2x_fewer_bytes_at_about_the_same_accuracy(
    compression: str, fewer: float
) -> None:
    plain, compressed = run("none"), run(compression)
    assert plain["train_upload"] / compressed["train_upload"] > fewer
    assert abs(compressed["accuracy"] - plain["accuracy"]) <= 0.02


def test_a_compressed_run_repeats_bit_for_bit() -> None:
    first = run("8-bit block")["model"]
    again = bench_policy("digits", "8-bit block", 0, ROUNDS)
    history, _ = run_consortium(again)
    assert torch.equal(history.state.model, first)


def test_a_robust_rule_combines_the_decoded_updates() -> None:
    plain, compressed = run("none", robust=True), run("8-bit block", robust=True)
    assert abs(compressed["accuracy"] - plain["accuracy"]) <= 0.02
    assert not torch.equal(compressed["model"], run("8-bit block")["model"])


def test_a_slice_of_a_quantized_answer_is_decoded_into_the_readers_buffer() -> None:
    """The coordinator reads a quantized answer a slice at a time into the buffer it keeps
    from slice to slice, never a copy of the model's size."""
    reference = torch.linspace(-1, 1, 40)
    reply = accepted(sent_task("a", reference), reference + 0.5)
    assert isinstance(reply, Accepted)
    buffer = torch.empty(8)
    part = reply.lazy[MODEL].peek(8, 16, buffer)
    assert part.data_ptr() == buffer.data_ptr()
    assert torch.equal(part, reply.lazy[MODEL].load()[8:16])


def test_cross_site_validation_evaluates_each_sites_decoded_model() -> None:
    """The coordinator keeps each site's last model as it decodes it: every row of the matrix
    is a model that predicts, not its quantized values read as parameters."""
    written = breast_cancer(compression={"bits": 8})
    history, sites = run_consortium(written)
    matrix = matrix_of(history.records[-1])
    assert set(matrix.rows) == {GLOBAL_ROW, *(site.agent.context.name for site in sites)}
    assert all(cell["accuracy"] > 0.8 for row in matrix.rows.values() for cell in row.values())


def test_the_benchs_quick_configuration_runs_every_compression_and_writes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """bench/compression.py on its tiny `--quick` configuration; nothing here judges a number
    but the ratios' direction."""

    def no_write(*_: object) -> None:
        raise AssertionError("--quick writes nothing")

    monkeypatch.setattr(compression_bench, "write", no_write)
    threads = torch.get_num_threads()  # the bench pins one thread; later tests' sums use more
    try:
        document = compression_bench.main(["--quick"])
    finally:
        torch.set_num_threads(threads)
    assert {r["compression"] for r in document["runs"]} == set(compression_bench.COMPRESSION)
    ratios = {r["compression"]: r["train_upload_bytes_ratio"] for r in document["summary"]}
    assert ratios["none"] == 1.0 < ratios["16-bit block"] < ratios["8-bit block"]


def test_a_deployment_over_mtls_counts_the_compressed_answers_in_fedsilo_bytes_total(
    tmp_path: Path,
) -> None:
    """Real coordinator and silo processes: each site's payload bytes up to round 3 stay
    well below what its float32 models alone would take (its initial model, sent whole, and
    three trained ones), as the coordinator's Prometheus counter counts them."""
    consortium = provision(tmp_path)
    try:
        hidden = 256
        document = policy_document(
            model={"name": "mlp", "hidden": [hidden]}, compression={"bits": 8}
        )
        consortium.start_coordinator(
            consortium.write_policy(document), "--metrics-port", str(port := free_port())
        )
        for name in SILOS:
            consortium.start_silo(name)
        text = wait_for(lambda: scrape_at_round(port, 3), 120, "round 3 in /metrics", consortium)
        parameters = 30 * hidden + hidden + hidden * 2 + 2  # breast cancer's 30 features, 2 classes
        models = 4 * parameters * (1 + 3)
        for name in SILOS:
            sent = sample(text, "fedsilo_bytes_total", direction="from_silo", silo=name)
            assert 0 < sent < 0.6 * models
    finally:
        consortium.stop_all()
