"""The bench's floor (bench/grpc_floor.py) really exchanges a round's bytes over the
consortium's mutual TLS: every client process takes the round's payload and gives back as many
bytes, each round, and a client without the consortium's certificate gets nothing. Its times are
the bench's to report; nothing here asserts a duration."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from bench import grpc_floor
from bench.grpc_floor import floor_round_seconds, measured_floor
from fedsilo.ops.demo import LocalConsortium

SILOS = ["s0", "s1"]


@pytest.fixture(scope="module")
def kits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("floor")
    LocalConsortium.provision(root, "floor", SILOS)
    return root / "kits"


def test_every_client_returns_every_round_of_the_payload(kits: Path, monkeypatch) -> None:
    returned: list[int] = []
    give_back = grpc_floor.FloorRound.give_back

    def counted(self, request: bytes, context) -> bytes:
        returned.append(len(request))
        return give_back(self, request, context)

    monkeypatch.setattr(grpc_floor.FloorRound, "give_back", counted)
    result = floor_round_seconds(kits, SILOS, parameters=1000, rounds=3)
    assert returned == [4000] * len(SILOS) * 4  # the warm-up round and three measured
    assert 0 < result["floor_round_seconds_min"] <= result["floor_round_seconds"]
    assert result["floor_round_seconds"] <= result["floor_round_seconds_max"]


def test_a_client_without_a_consortium_certificate_is_refused(kits: Path, tmp_path: Path) -> None:
    stranger = tmp_path / "stranger"
    LocalConsortium.provision(tmp_path, "other", ["x"])
    (tmp_path / "kits" / "silos" / "x").rename(stranger)
    exchange = grpc_floor.FloorRound(bytes(4), 1)
    server, port = grpc_floor.serve(kits, exchange)
    try:
        client = subprocess.run(
            grpc_floor.this_module(
                "client", "--kit", str(stranger), "--port", str(port), "--rounds", "1"
            ),
            capture_output=True,
            text=True,
            timeout=60,
            cwd=grpc_floor.REPO,
        )
    finally:
        server.stop(grace=None)
    assert client.returncode != 0
    assert "StatusCode.UNAVAILABLE" in client.stderr, client.stderr  # the handshake failed
    assert exchange.returned == 0


@pytest.mark.parametrize("service_allocator", [False, True])
def test_the_floor_runs_in_a_fresh_process_with_either_allocator_setting(
    kits: Path, service_allocator: bool
) -> None:
    result = measured_floor(kits, SILOS, 1000, 2, service_allocator=service_allocator)
    assert 0 < result["floor_round_seconds_min"] <= result["floor_round_seconds"]
    assert result["floor_server_cpu_ms_per_round"] > 0
