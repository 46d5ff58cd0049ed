"""On a CUDA device, silos train where `compute.device` puts them and the run matches the CPU's.

Skipped without a CUDA device (CI has none); run on a GPU machine with
`pytest tests/test_cuda.py`. Floating-point sums on a GPU run in another order than on the
CPU, so results agree to a tolerance, not bit for bit; the privacy accounting and a repeated
run hold exactly, and a masked mean matches the plain one to the fixed point's precision.
"""

import pytest
import torch

from fedsilo.ops.simulate import load_silos, simulate
from tests.test_simulation import heart_policy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def run(device: str, **overrides: object):
    policy = heart_policy(compute={"device": device}, **overrides)
    return simulate(policy, load_silos(policy, None))


def final_model(result) -> torch.Tensor:
    return result.history.state.model.detach().cpu().double()


@pytest.mark.parametrize(
    "algorithm",
    [
        {"name": "fedavg"},
        {"name": "fedadam"},
        {"name": "scaffold"},
        {"name": "superfed"},
    ],
    ids=lambda a: a["name"],
)
def test_an_algorithm_trains_on_the_gpu_to_the_cpu_result(algorithm: dict) -> None:
    on_gpu, on_cpu = run("cuda", algorithm=algorithm), run("cpu", algorithm=algorithm)
    assert "cuda" in on_gpu.device
    assert torch.isfinite(final_model(on_gpu)).all()
    assert torch.allclose(final_model(on_gpu), final_model(on_cpu), atol=1e-4, rtol=1e-3)


def test_a_gpu_run_repeats_bit_for_bit() -> None:
    assert final_model(run("cuda")).equal(final_model(run("cuda")))


def test_dp_sgd_on_the_gpu_books_the_cpu_epsilon() -> None:
    privacy = {"dp_sgd": {"noise_multiplier": 1.0, "max_grad_norm": 1.0}}
    on_gpu, on_cpu = run("cuda", privacy=privacy), run("cpu", privacy=privacy)
    assert torch.isfinite(final_model(on_gpu)).all()
    assert epsilons(on_gpu) == epsilons(on_cpu)
    assert all(e is not None and e > 0 for e in epsilons(on_gpu).values())


def epsilons(result) -> dict[tuple[int, str], float | None]:
    """Each silo's epsilon as it reported it after each round."""
    return {
        (record.round, silo): report["epsilon"]
        for record in result.history.records
        for silo, report in (record.privacy or {}).items()
    }


@pytest.mark.parametrize("neighbours", [None, 2], ids=["complete", "sparse"])
def test_a_masked_mean_of_gpu_updates_is_the_plain_mean(neighbours: int | None) -> None:
    secure = {"method": "masking", "threshold": 2}
    if neighbours is not None:
        secure["neighbours"] = neighbours
    masked, plain = run("cuda", secure_aggregation=secure), run("cuda")
    assert torch.allclose(final_model(masked), final_model(plain), atol=1e-5)
