"""`all_finite` (wire/tensors.py), the check every update, masked input and hand-off passes
before it enters a sum, says what `torch.isfinite(t).all()` says, for every dtype and size,
with NaN and infinities anywhere."""

from __future__ import annotations

import math

import torch
from hypothesis import given
from hypothesis import strategies as st

from fedsilo.wire.tensors import all_finite

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
INTEGERS = [torch.int8, torch.int32, torch.int64, torch.uint8]
SPECIAL = [math.nan, math.inf, -math.inf, 0.0, -0.0, 1e30, -1e-30]


@given(
    dtype=st.sampled_from(FLOATS),
    values=st.lists(st.floats(allow_nan=False, allow_infinity=False, width=16), max_size=64),
    specials=st.lists(st.tuples(st.integers(0, 63), st.sampled_from(SPECIAL)), max_size=4),
)
def test_a_float_tensor_is_finite_exactly_when_torch_says_so(dtype, values, specials) -> None:
    tensor = torch.tensor(values, dtype=torch.float64)
    for index, value in specials:
        if index < len(values):
            tensor[index] = value
    tensor = tensor.to(dtype)
    assert all_finite(tensor) == bool(torch.isfinite(tensor).all())


@given(dtype=st.sampled_from(INTEGERS), values=st.lists(st.integers(0, 100), max_size=16))
def test_an_integer_tensor_is_always_finite(dtype, values) -> None:
    assert all_finite(torch.tensor(values, dtype=dtype))


def test_a_large_tensor_with_one_nan_or_infinity_is_not_finite() -> None:
    for value in (math.nan, math.inf, -math.inf):
        tensor = torch.zeros(1001 * 999)
        tensor[777_777] = value
        assert not all_finite(tensor)
        assert not all_finite(tensor.view(1001, 999)[:, 1:])  # strided views too


def test_a_complex_tensor_is_finite_when_both_parts_are() -> None:
    assert all_finite(torch.tensor([1 + 2j, 0j]))
    assert not all_finite(torch.tensor([1 + 2j, complex(0, math.inf)]))
    assert not all_finite(torch.tensor([complex(math.nan, 0)]))
