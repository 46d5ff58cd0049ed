"""The call-shape bench (bench/grpc_call_shapes.py) carries the same frames both ways in every
shape over the consortium's mutual TLS, and reports each shape's CPU per call beside the
stream-stream call fedsilo makes. Its times are the bench's to report; nothing here asserts a
duration."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.grpc_call_shapes import SHAPES, measure
from fedsilo.ops.demo import LocalConsortium


@pytest.mark.parametrize("size", [1_000, 300_000])
def test_every_shape_is_measured_beside_the_stream_stream_call(tmp_path: Path, size: int) -> None:
    LocalConsortium.provision(tmp_path, "shapes", ["s0"])
    measured = measure(tmp_path / "kits", size, calls=2)
    assert tuple(measured) == SHAPES
    for row in measured.values():
        assert row["wall_ms"] > 0 and row["client_cpu_ms"] >= 0 and row["server_cpu_ms"] >= 0
    assert measured["stream_stream"]["wall_ms_vs_stream_stream"] == 1.0
