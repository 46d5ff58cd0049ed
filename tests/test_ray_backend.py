"""`fedsilo simulate --backend ray`: the same results as in process, bit for bit, on a local Ray
instance (2 CPUs, started once for the module); the resources a silo's actor requests, GPU
placement included, checked against a stated cluster (no GPU here: the mapping is tested on
the resource requests it builds, not on a GPU)."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from click.testing import CliRunner

from fedsilo.ops.backends import BackendError
from fedsilo.ops.cli import main
from fedsilo.ops.ray_backend import LOCAL_START_ATTEMPTS, actor_options, pool_size, ray_session
from fedsilo.policies.compute import ComputeConfig, SiloResources
from fedsilo.policies.loading import load_policy
from fedsilo.silo.data import load_consortium
from fedsilo.silo.data.transfer import SPLITS, decode_dataset, encode_dataset

EXAMPLES = Path(__file__).parent.parent / "policies" / "examples"
# what each run must have gone through (FedDC: hand-offs and masked aggregations both)
PHASES = {
    "heart-fedavg.yaml": {"train", "evaluate"},
    "heart-feddc.yaml": {"daisy", "aggregate", "evaluate_local_test"},
    "heart-aaggff.yaml": {"train", "loss", "evaluate"},
    "heart-superfed.yaml": {"train", "evaluate"},
    "fedavg_dp.yaml": {"train", "evaluate"},
}
# the only fields allowed to differ: wall-clock ones, and a DP run's ledger heads (each ledger
# record carries the time it was booked, so two runs' hash chains differ)
TIMINGS = {"seconds", "compute_seconds", "ledger_head"}


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray instance for the module (2 CPUs); runs inside it reuse its actors."""
    with ray_session(num_cpus=2):
        yield


def short(example: str, folder: Path, **changes: Any) -> Path:
    """The example policy with fewer rounds (and `changes`), written to `folder`."""
    document = yaml.safe_load((EXAMPLES / example).read_text())
    algorithm = {**document["algorithm"], **changes.pop("algorithm", {})}
    document.update(changes, algorithm=algorithm)
    path = folder / example
    path.write_text(yaml.safe_dump(document))
    return path


def run(policy: Path, out: Path, *backend: str) -> dict:
    result = CliRunner().invoke(
        main, ["simulate", "--policy", str(policy), "--out", str(out), *backend]
    )
    assert result.exit_code == 0, result.output
    return json.loads((out / "results.json").read_text())


def without_timings(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: without_timings(v) for k, v in value.items() if k not in TIMINGS}
    if isinstance(value, list):
        return [without_timings(v) for v in value]
    return value


@pytest.mark.parametrize(
    ("example", "changes"),
    [
        ("heart-fedavg.yaml", {"rounds": 3}),
        # 4 hand-offs and 2 aggregations (masked), evaluated on the hosted models too
        (
            "heart-feddc.yaml",
            {"rounds": 6, "eval_every": 3, "algorithm": {"aggregation_period": 3}},
        ),
        ("heart-aaggff.yaml", {"rounds": 3, "eval_every": 1}),  # a mixing schedule
        # silo-side state: each silo's local model, trained from round 2 on
        ("heart-superfed.yaml", {"rounds": 4, "eval_every": 2}),
        # DP-SGD: each silo books a ledger in its actor, and the epsilons match
        ("fedavg_dp.yaml", {"rounds": 2, "eval_every": 2}),
    ],
)
def test_ray_gives_the_in_process_results_bit_for_bit(
    local_ray: None, tmp_path: Path, example: str, changes: dict
) -> None:
    policy = short(example, tmp_path, **changes)
    in_process = run(policy, tmp_path / "in-process")
    on_ray = run(policy, tmp_path / "ray", "--backend", "ray")
    assert without_timings(on_ray) == without_timings(in_process)
    assert [r["status"] for r in on_ray["history"]] == ["completed"] * changes["rounds"]
    phases = {phase for r in on_ray["history"] for phase in r["phases"]}
    assert phases >= PHASES[example]
    model = (tmp_path / "ray" / "final_model.safetensors").read_bytes()
    assert model == (tmp_path / "in-process" / "final_model.safetensors").read_bytes()
    if "privacy" in in_process:  # a DP policy: the actors' ledgers came back, as booked here
        assert on_ray["privacy"]["epsilon"] == in_process["privacy"]["epsilon"]
        booked = sorted(p.name for p in (tmp_path / "ray" / "ledgers").iterdir())
        assert booked == sorted(p.name for p in (tmp_path / "in-process" / "ledgers").iterdir())
        assert booked  # one per silo
    for name in ("silos.csv",):
        ray_file = (tmp_path / "ray" / name).read_bytes()
        assert ray_file == (tmp_path / "in-process" / name).read_bytes()


def test_a_dataset_travels_as_safetensors_bit_for_bit() -> None:
    policy = load_policy(EXAMPLES / "heart-agnostic-fedavg-by-sex.yaml")
    data = load_consortium(policy.data, policy.seed, base_dir=EXAMPLES)[0]
    assert data.domains  # domain codes travel too
    back = decode_dataset(encode_dataset(data))
    for split in SPLITS:
        assert torch.equal(getattr(back, split), getattr(data, split))
        assert getattr(back, split).dtype == getattr(data, split).dtype
    assert back.domain_codes.keys() == data.domain_codes.keys()
    assert all(torch.equal(back.domain_codes[k], v) for k, v in data.domain_codes.items())
    fields = ("name", "task", "num_classes", "feature_names", "input_shape", "domains", "outputs")
    assert [getattr(back, f) for f in fields] == [getattr(data, f) for f in fields]


CPU_ONLY = {"CPU": 16.0, "memory": 64.0 * 2**30}
ONE_GPU = {**CPU_ONLY, "GPU": 1.0}


@pytest.mark.parametrize(
    ("device", "gpus", "cluster", "expected"),
    [
        ("cpu", None, ONE_GPU, 0.0),  # a CPU silo never holds a GPU
        ("auto", None, CPU_ONLY, 0.0),
        ("auto", None, ONE_GPU, 1.0),  # auto takes a GPU where the cluster has one
        ("cuda", None, CPU_ONLY, 1.0),  # asks anyway: Ray waits for a GPU node
        ("cuda:1", None, ONE_GPU, 1.0),
        ("cuda", 0.25, ONE_GPU, 0.25),  # four silos share one GPU
        ("auto", 0.5, CPU_ONLY, 0.5),
    ],
)
def test_a_silos_device_becomes_its_actors_gpu_request(device, gpus, cluster, expected) -> None:
    compute = ComputeConfig(device=device, resources=SiloResources(cpus=2, gpus=gpus))
    assert actor_options(compute, cluster) == {"num_cpus": 2.0, "num_gpus": expected}


def test_memory_is_reserved_in_bytes() -> None:
    compute = ComputeConfig(device="cpu", resources=SiloResources(memory_mb=512))
    assert actor_options(compute, CPU_ONLY)["memory"] == 512 * 2**20


def test_a_cuda_silo_with_no_gpu_share_is_refused() -> None:
    compute = ComputeConfig(device="cuda", resources=SiloResources(gpus=0))
    with pytest.raises(BackendError, match="compute.resources.gpus is 0"):
        actor_options(compute, ONE_GPU)


def test_a_cpu_silo_with_a_gpu_share_is_refused_by_the_policy() -> None:
    with pytest.raises(ValueError, match="resources.gpus is 1 but device is cpu"):
        ComputeConfig(device="cpu", resources=SiloResources(gpus=1))


@pytest.mark.parametrize(
    ("options", "silos", "expected"),
    [
        ({"num_cpus": 1.0, "num_gpus": 0.0}, 100, 16),  # 16 CPUs: 16 actors
        ({"num_cpus": 1.0, "num_gpus": 0.0}, 5, 5),  # never more actors than silos
        ({"num_cpus": 2.0, "num_gpus": 0.25}, 100, 4),  # 1 GPU in quarters: 4
        ({"num_cpus": 1.0, "num_gpus": 0.0, "memory": 24.0 * 2**30}, 100, 2),  # 64 GiB / 24
    ],
)
def test_the_pool_is_as_large_as_the_cluster_holds(options, silos, expected) -> None:
    assert pool_size(options, ONE_GPU, silos) == expected


def test_a_silo_larger_than_the_cluster_is_one_clear_message() -> None:
    with pytest.raises(
        BackendError, match="one silo asks for num_cpus 32.*the Ray cluster has CPU 16"
    ):
        pool_size({"num_cpus": 32.0, "num_gpus": 0.0}, ONE_GPU, 4)


def test_without_ray_the_flag_says_how_to_install_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    result = CliRunner().invoke(
        main, ["simulate", "--backend", "ray", "--out", str(tmp_path / "r")]
    )
    assert result.exit_code == 1
    assert "--backend ray needs Ray, an optional extra: pip install 'fedsilo[ray]'" in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "r").exists()


def test_address_without_the_ray_backend_is_refused(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["simulate", "--address", "auto", "--out", str(tmp_path)])
    assert result.exit_code == 1
    assert "--address: only with --backend ray" in result.output


def test_an_address_where_no_head_answers_is_one_clear_message(tmp_path: Path) -> None:
    with socket.socket() as closed:  # a port nothing listens on: bound, never listening
        closed.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{closed.getsockname()[1]}"
        args = ["simulate", "--backend", "ray", "--address", address, "--out", str(tmp_path / "r")]
        result = CliRunner().invoke(main, args)
    assert result.exit_code == 1
    assert f"--address {address}: no Ray head answers there" in result.output
    assert not (tmp_path / "r").exists()


RAYLET_TIMEOUT = Exception("The current node timed out during startup. This could happen ...")
# what Ray 2.52 raises when its GCS did not come up and it looks for the error log
GCS_NOT_UP = FileNotFoundError(
    2, "No such file or directory", "/tmp/ray/session_x/logs/gcs_server.err"
)


class SlowRaylet:
    """A stand-in for `ray` whose local start fails as Ray's does on a loaded machine (by
    default a bare Exception after its fixed 30 s wait for the raylet) the first `timeouts`
    times."""

    def __init__(self, timeouts: int, failure: Exception = RAYLET_TIMEOUT) -> None:
        self.timeouts, self.failure, self.starts, self.shutdowns = timeouts, failure, 0, 0

    def is_initialized(self) -> bool:
        return False

    def init(self, **_: object) -> None:
        self.starts += 1
        if self.starts <= self.timeouts:
            raise self.failure

    def shutdown(self) -> None:
        self.shutdowns += 1


@pytest.mark.parametrize("failure", [RAYLET_TIMEOUT, GCS_NOT_UP], ids=["raylet", "gcs"])
def test_a_local_start_that_failed_once_is_tried_again(monkeypatch, failure) -> None:
    ray = SlowRaylet(timeouts=1, failure=failure)
    monkeypatch.setattr("fedsilo.ops.ray_backend.import_ray", lambda: ray)
    with ray_session(num_cpus=1) as session:
        assert session is ray
    assert ray.starts == 2


def test_a_local_start_that_always_times_out_is_one_clear_message(monkeypatch) -> None:
    ray = SlowRaylet(timeouts=LOCAL_START_ATTEMPTS)
    monkeypatch.setattr("fedsilo.ops.ray_backend.import_ray", lambda: ray)
    starting = ray_session(num_cpus=1)
    with pytest.raises(BackendError, match="cannot start a local Ray instance: .*timed out"):
        starting.__enter__()
    assert ray.starts == LOCAL_START_ATTEMPTS


def test_any_other_error_of_a_local_start_is_not_retried(monkeypatch) -> None:
    ray = SlowRaylet(timeouts=1, failure=FileNotFoundError(2, "No such file", "/data/x.csv"))
    monkeypatch.setattr("fedsilo.ops.ray_backend.import_ray", lambda: ray)
    with pytest.raises(FileNotFoundError):
        ray_session(num_cpus=1).__enter__()
    assert ray.starts == 1
