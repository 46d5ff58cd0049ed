"""Tensors and messages on the wire: safetensors, bit-exact, and refusing anything malformed."""

import json

import pytest
import safetensors.torch
import torch

from fedsilo.wire.messages import PROTOCOL_VERSION, TaskMessage, TaskResult
from fedsilo.wire.payload import Payload
from fedsilo.wire.tasks import InitTask, LocalTraining, TrainTask
from fedsilo.wire.tensors import (
    ParameterSpec,
    TensorBlocks,
    WireError,
    decode_tensors,
    encode_tensors,
    index_tensors,
    read_only,
)


def awkward_floats() -> torch.Tensor:
    specials = torch.tensor([0.0, -0.0, 1e-45, -3.4e38, 3.4e38, float("nan"), float("inf")])
    return torch.cat([specials, torch.randn(1000, generator=torch.Generator().manual_seed(1))])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_tensor_round_trip_is_bit_exact() -> None:
    original = {"model": awkward_floats(), "counts": torch.arange(5, dtype=torch.int64)}
    decoded, header = decode_tensors(encode_tensors(original, {"k": [1, "a"]}))
    assert header == {"k": [1, "a"]}
    for name, tensor in original.items():
        assert decoded[name].dtype == tensor.dtype
        assert (
            decoded[name]
            .view(torch.uint8 if tensor.dtype != torch.int64 else torch.int64)
            .equal(tensor.view(torch.uint8 if tensor.dtype != torch.int64 else torch.int64))
        )


def test_parameter_spec_flattens_and_unflattens_in_order() -> None:
    named = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.tensor([7.0, 8.0])}
    spec = ParameterSpec.of(named)
    flat = spec.flatten(named)
    assert flat.tolist() == [0, 1, 2, 3, 4, 5, 7, 8]
    back = spec.unflatten(flat)
    assert list(back) == ["w", "b"] and back["w"].equal(named["w"]) and back["b"].equal(named["b"])
    assert ParameterSpec.from_json(spec.to_json()) == spec


def test_parameter_spec_refuses_a_vector_of_another_size() -> None:
    spec = ParameterSpec.of({"w": torch.zeros(3)})
    with pytest.raises(WireError, match="does not match"):
        spec.unflatten(torch.zeros(4))


def test_parameter_spec_refuses_mixed_dtypes() -> None:
    with pytest.raises(WireError, match="mix dtypes"):
        ParameterSpec.of({"a": torch.zeros(2), "b": torch.zeros(2, dtype=torch.float64)})


def test_task_message_round_trip() -> None:
    spec = ParameterSpec.of({"w": torch.zeros(3)})
    config = TrainTask(local=LocalTraining(epochs=1, batch_size=8, optimizer="sgd", lr=0.1, seed=0))
    message = TaskMessage(
        "t1", 3, "train", "a", config, {"model": torch.tensor([1.0, 2.0, 3.0])}, spec
    )
    decoded = TaskMessage.decode(message.encode())
    assert (decoded.task_id, decoded.round, decoded.kind, decoded.silo) == ("t1", 3, "train", "a")
    assert decoded.config == config
    assert decoded.spec == spec and decoded.tensors["model"].equal(message.tensors["model"])


def test_task_result_round_trip_keeps_scalar_reports() -> None:
    result = TaskResult(
        "t1",
        "a",
        "evaluate",
        num_samples=12,
        metrics={"accuracy": 0.5, "auroc": float("nan")},
        compute_seconds=0.25,
    )
    decoded = TaskResult.decode(result.encode())
    assert decoded.num_samples == 12 and decoded.metrics["accuracy"] == 0.5
    assert decoded.metrics["auroc"] != decoded.metrics["auroc"]  # NaN survives
    assert decoded.ok and decoded.compute_seconds == 0.25


@pytest.mark.parametrize("payload", [b"", b"not safetensors", b"\x08" + b"\x00" * 7 + b"{}garbage"])
def test_malformed_payloads_are_refused(payload: bytes) -> None:
    with pytest.raises(WireError):
        TaskMessage.decode(payload)


def test_a_result_is_not_accepted_as_a_task() -> None:
    with pytest.raises(WireError, match="expected a task"):
        TaskMessage.decode(TaskResult("t", "a", "train").encode())


def test_another_protocol_version_is_refused() -> None:
    payload = encode_tensors({}, {"type": "task", "protocol": PROTOCOL_VERSION + 1})
    with pytest.raises(WireError, match="protocol version"):
        TaskMessage.decode(payload)


def test_tasks_carrying_the_same_tensors_share_one_encoding_of_them() -> None:
    model = awkward_floats()
    blocks = TensorBlocks()
    payloads = {
        silo: TaskMessage(
            f"t-{silo}", 1, "init", silo, InitTask(seed=0), {"model": model}
        ).encode_payload(blocks)
        for silo in ("a", "b", "c")
    }
    shared = {id(p.parts[-1].obj) for p in payloads.values()}
    assert len(shared) == 1  # one tensor block, three small headers
    for silo, payload in payloads.items():
        decoded = TaskMessage.decode(payload.to_bytes())
        assert decoded.silo == silo and same_bits(decoded.tensors["model"], model)


def test_tensors_can_be_read_slice_by_slice_without_decoding_the_payload() -> None:
    tensors = {"model": awkward_floats(), "counts": torch.arange(7, dtype=torch.int64)}
    payload = Payload([encode_tensors(tensors, {"type": "x"})])
    lazy, header = index_tensors(payload)
    assert header == {"type": "x"}
    assert same_bits(lazy["model"].read(2, 9), tensors["model"][2:9])
    assert torch.equal(lazy["counts"].load(), tensors["counts"])
    assert lazy["model"].shape == tuple(tensors["model"].shape)


def lying_offsets(data: bytes) -> bytes:
    header_len = int.from_bytes(data[:8], "little")
    document = json.loads(data[8 : 8 + header_len])
    document["model"]["data_offsets"][1] += 4
    text = json.dumps(document).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + data[8 + header_len :]


def test_an_index_whose_offsets_disagree_with_the_shape_is_refused() -> None:
    data = encode_tensors({"model": torch.zeros(4)}, {"type": "x"})
    with pytest.raises(WireError, match="offsets"):
        index_tensors(Payload([lying_offsets(data)]))


@pytest.mark.parametrize("payload", [b"", b"\xff" * 8 + b"{}", b"\x02" + b"\x00" * 7 + b"[]"])
def test_a_malformed_index_is_refused(payload: bytes) -> None:
    with pytest.raises(WireError):
        index_tensors(Payload([payload]))


def test_what_fedsilo_encodes_the_safetensors_package_reads_and_the_reverse() -> None:
    tensors = {"model": awkward_floats(), "counts": torch.arange(5, dtype=torch.int64)}
    ours = encode_tensors(tensors, {"k": 1})
    theirs = safetensors.torch.load(ours)
    assert same_bits(theirs["model"], tensors["model"])
    assert torch.equal(theirs["counts"], tensors["counts"])
    metadata = {"fedsilo": json.dumps({"k": 2})}
    decoded, header = decode_tensors(safetensors.torch.save(tensors, metadata=metadata))
    assert header == {"k": 2} and torch.equal(decoded["counts"], tensors["counts"])
    assert same_bits(decoded["model"], tensors["model"])


def test_tensors_that_overlap_or_leave_trailing_bytes_are_refused() -> None:
    data = encode_tensors({"a": torch.zeros(2), "b": torch.ones(2)}, {"type": "x"})
    with pytest.raises(WireError, match="after the last tensor"):
        index_tensors(Payload([data, b"\x00" * 4]))
    header_len = int.from_bytes(data[:8], "little")
    document = json.loads(data[8 : 8 + header_len])
    document["b"]["data_offsets"] = document["a"]["data_offsets"]
    text = json.dumps(document).encode()
    text += b" " * (-len(text) % 8)
    with pytest.raises(WireError, match="overlaps"):
        index_tensors(Payload([len(text).to_bytes(8, "little") + text + data[8 + header_len :]]))


@pytest.mark.parametrize("cut", [None, 3, 37], ids=["one part", "header cut", "tensor cut"])
def test_peek_reads_what_read_reads_and_shares_memory_where_one_part_holds_the_slice(
    cut: int | None,
) -> None:
    tensors = {"a": torch.arange(10, dtype=torch.float32), "b": torch.randn(7, dtype=torch.float64)}
    data = bytearray(encode_tensors(tensors, {}))
    payload = Payload([data] if cut is None else [data[:cut], data[cut:]])
    lazy, _ = index_tensors(payload)
    for name, tensor in tensors.items():
        assert torch.equal(lazy[name].peek(2, 6), lazy[name].read(2, 6))
        assert torch.equal(lazy[name].peek(0, tensor.numel()), tensor)
    if cut is None:  # a view of the received bytes: what the payload holds, it shows
        peeked = lazy["a"].peek(0, 10)
        data[peeked.data_ptr() - torch.frombuffer(data, dtype=torch.uint8).data_ptr()] ^= 0xFF
        assert not torch.equal(peeked, tensors["a"])


def test_a_tasks_tensors_are_copied_out_when_read_and_its_model_can_be_read_in_place() -> None:
    spec = ParameterSpec.of({"w": torch.zeros(2, 3)})
    config = TrainTask(local=LocalTraining(epochs=1, batch_size=8, optimizer="sgd", lr=0.1, seed=0))
    model, anchor = torch.arange(6, dtype=torch.float32), torch.ones(6)
    data = bytearray(
        TaskMessage(
            "t1", 1, "train", "a", config, {"model": model, "anchor": anchor}, spec
        ).encode()
    )
    base = torch.frombuffer(data, dtype=torch.uint8).data_ptr()

    def in_payload(tensor: torch.Tensor) -> bool:
        return base <= tensor.data_ptr() < base + len(data)

    message = TaskMessage.decode(Payload([data]))
    in_place = read_only(message.tensors, "model")
    assert torch.equal(in_place, model) and in_payload(in_place)  # no copy
    copied = message.tensors["anchor"]
    assert torch.equal(copied, anchor) and not in_payload(copied)  # its own storage
    assert message.tensors["anchor"] is copied  # copied once
    loaded = message.tensors["model"]
    assert read_only(message.tensors, "model") is loaded  # once copied, the copy is read
    assert sorted(message.tensors) == ["anchor", "model"] and len(message.tensors) == 2
    assert read_only({"model": model}, "model") is model  # a plain mapping: itself
