"""How the test process ends, and the fixtures many files share.

`consortium`: a provisioned consortium of three silos in the test's own folder
(tests/deployment.py); every process a test started in it is killed when the test ends.
`silo_kit`: one silo's startup kit of the example consortium.yaml, provisioned once per run,
for a silo.yaml that `silo check` must find a kit for (read only).

The process ends without the interpreter's teardown.

The suite leaves native threads behind (gRPC's, torch's and TenSEAL's pools, started by tests
that run silos on daemon threads), and tearing the interpreter down under them has aborted the
process after every test passed ("terminate called without an active exception", exit status
134, in 2 of 6 full runs on 2 cores). The process therefore exits with pytest's own status
once pytest has reported, skipping that teardown; nothing of a test's outcome is lost.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.deployment import Consortium, provision

_STATUS: list[int] = []


@pytest.fixture(scope="session")
def silo_kit(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from fedsilo.ops.provision import provision as provision_kits
    from fedsilo.policies.consortium import EXAMPLE, parse_consortium

    folder = tmp_path_factory.mktemp("example-consortium")
    provision_kits(parse_consortium(yaml.safe_load(EXAMPLE)), folder / "kits")
    return folder / "kits" / "silos" / "cleveland"


@pytest.fixture
def consortium(tmp_path: Path) -> Iterator[Consortium]:
    running = provision(tmp_path)
    yield running
    running.stop_all()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _STATUS.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    if _STATUS:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_STATUS[-1])
