"""How the test process ends, and the one fixture many files share.

`consortium`: a provisioned consortium of three silos in the test's own folder
(tests/deployment.py); every process a test started in it is killed when the test ends.

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

from tests.deployment import Consortium, provision

_STATUS: list[int] = []


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
