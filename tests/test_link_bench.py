"""bench/links.py on a small configuration (one size, 3 silos, 2 rounds, over 100 Mbit/s links
in network namespaces), as root: fedsilo's rounds complete in both send modes, every number
the docs quote is there, and the namespaces are gone afterwards, also when the bench is
killed. Without root it says so in one line. Nothing here judges a time."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import links, netns

REPO = Path(__file__).resolve().parent.parent
needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("tc") is None or shutil.which("ip") is None,
    reason="network namespaces and tc need root and iproute2 (CI runs as root)",
)


def test_the_bound_is_the_last_silos_model_then_its_training_then_its_update() -> None:
    # 3 silos, 1 MB models, 8 Mbit/s: one model-time is 1 s
    bound = links.bound_seconds(1_000_000, 3, 8.0, train_s=0.5, rtt_s=0.01)
    assert bound["bound_seconds"] == pytest.approx(4 + 0.5 + 0.01)
    assert bound["side_by_side_bound_seconds"] == pytest.approx(6 + 0.5 + 0.01)


@needs_root
def test_a_small_run_completes_in_both_send_modes_and_leaves_no_namespace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FEDSILO_FLOWER_PYTHON", "/nonexistent")  # fedsilo's side only
    written = {}

    def write(name: str, document: dict, figure: object) -> Path:
        written[name] = document
        return Path(name)

    monkeypatch.setattr(links, "write", write)
    document = links.main(
        ["--sizes", "1e5", "--silos", "3", "--rates", "100", "--rounds", "2", "--repeats", "1",
         "--out", "links-test"]
    )  # fmt: skip
    assert written == {"links-test": document}
    (row,) = document["rows"]
    assert (row["silos"], row["rate_mbit"]) == (3, 100.0)
    assert set(row["systems"]) == {"fedsilo concurrent", "fedsilo staggered"}
    for measured in row["systems"].values():
        assert measured["round_seconds"] > 0
        assert measured["bound_seconds"] < measured["side_by_side_bound_seconds"]
        # every byte of a round crossed the shaped link, framing and TLS on top
        assert measured["link_bytes_over_protocol"] >= 1
        assert len(measured["over_bound_runs"]) == 1
    assert "not measured" in document["flower"]
    mine = f"{netns.PREFIX}{os.getpid()}-"
    assert [n for n in netns.list_namespaces() if n.startswith(mine)] == []


@needs_root
def test_a_killed_bench_leaves_no_namespace(tmp_path: Path) -> None:
    bench = subprocess.Popen(
        [sys.executable, "-m", "bench.links", "--sizes", "1e5", "--silos", "3", "--rates",
         "100", "--rounds", "50", "--repeats", "1", "--sends", "staggered", "--out", "unused"],
        cwd=REPO,
        env={**os.environ, "FEDSILO_FLOWER_PYTHON": "/nonexistent"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    mine = f"{netns.PREFIX}{bench.pid}-"
    deadline = time.monotonic() + 120
    while not any(n.startswith(mine) for n in netns.list_namespaces()):
        assert bench.poll() is None and time.monotonic() < deadline, "no namespace appeared"
        time.sleep(0.1)
    time.sleep(3)  # the coordinator and silos are starting inside them
    bench.send_signal(signal.SIGKILL)
    bench.wait()
    deadline = time.monotonic() + 60
    while any(n.startswith(mine) for n in netns.list_namespaces()):
        assert time.monotonic() < deadline, "the killed bench's namespaces are still there"
        time.sleep(0.2)


def test_without_root_the_bench_says_so_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(SystemExit) as exit_:
        links.main(["--sizes", "1e5"])
    assert exit_.value.code == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: ") and "root" in line


def test_an_unknown_send_mode_is_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(netns, "link_problem", lambda: None)
    monkeypatch.setattr(links, "link_problem", lambda: None)
    with pytest.raises(SystemExit) as exit_:
        links.main(["--sends", "sideways"])
    assert exit_.value.code == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert "--sends" in line and "sideways" in line
