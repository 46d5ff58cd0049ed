"""The committed gRPC stubs are the ones fedsilo.proto generates."""

from pathlib import Path

import pytest

from fedsilo.wire import stubs


def test_committed_stubs_match_the_proto(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    for generated in stubs.generate(tmp_path):
        committed = stubs.PROTO.parent / generated.name
        assert committed.read_text() == generated.read_text(), (
            f"run `make proto`: {committed.name} is stale"
        )
