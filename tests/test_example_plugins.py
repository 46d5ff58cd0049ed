"""The example plug-in package (examples/fedsilo-example-plugins, installed by `make setup`) as
a hospital team would use it: its policy trains in a simulation and over real processes (with
DP-SGD and masked sums), its final model loads back into the package's network, and real silo
processes refuse, naming the reason, what their rules do not allow, what is not installed,
what the installed version does not build, and a BatchNorm network under DP-SGD.
"""

from __future__ import annotations

import copy
import json
from importlib.resources import files
from pathlib import Path

import pytest
import torch
import yaml
from fedsilo_example_plugins.models import ResidualCnn

from fedsilo.models import architecture, plugins
from fedsilo.models.card import load_final_model
from fedsilo.ops.report import write_final_model
from fedsilo.ops.simulate import load_silos, simulate
from fedsilo.policies.loading import parse_policy
from fedsilo.policies.model import PINNING, PluginModel
from fedsilo.wire.tensors import decode_tensors
from tests.deployment import Consortium, provision

PACKAGE = "fedsilo_example_plugins"
RESNET = f"{PACKAGE}.models:residual_cnn"
BATCHNORM = f"{PACKAGE}.models:residual_cnn_batchnorm"
NOT_INSTALLED = f"{PACKAGE}.models:unet_v2"
SCHEMA = ((1, 16, 16), 10)  # the digits loader's images and classes
EXAMPLE = files(PACKAGE) / "policies" / "digits-resnet.yaml"
DP = {"delta": 1e-5, "dp_sgd": {"noise_multiplier": 1.0, "max_grad_norm": 1.0}}


def example_document(rows: int = 300, silos: int = 3, **overrides: object) -> dict:
    """The package's policy (digits-resnet.yaml), cut to 2 rounds on `rows` images."""
    document = yaml.safe_load(EXAMPLE.read_text())
    document["data"]["args"]["rows"] = rows
    document["data"]["partition"]["silos"] = silos
    document["training"]["epochs"] = 1
    return {**document, "rounds": 2, **overrides}


def pinned_model(factory: str, **args: object) -> dict:
    """A model section naming `factory`, pinned to what it builds for the digits."""
    unpinned = PluginModel.model_validate(
        {"name": "plugin", "factory": factory, "args": args}, context={PINNING: True}
    )
    lines = architecture.describe(plugins.build_plugin(unpinned, *SCHEMA, seed=0))
    return {
        "name": "plugin",
        "factory": factory,
        "args": args,
        "architecture": {
            "digest": architecture.digest(lines),
            "tensors": lines,
            "input_shape": list(SCHEMA[0]),
            "output_dim": SCHEMA[1],
        },
    }


def test_the_example_policy_pins_what_the_installed_package_builds() -> None:
    policy = parse_policy(yaml.safe_load(EXAMPLE.read_text()))
    assert (
        policy.model.architecture
        == PluginModel.model_validate(pinned_model(RESNET, width=8, blocks=2)).architecture
    )


def test_the_example_policy_simulates_and_its_final_model_predicts_like_the_evaluation(
    tmp_path: Path,
) -> None:
    policy = parse_policy(example_document())
    silos = load_silos(policy, None)
    result = simulate(policy, silos)
    write_final_model(tmp_path, policy, result.history.state)

    model = load_final_model(tmp_path / "final_model.safetensors")
    assert isinstance(model, ResidualCnn) and not model.training
    evaluation = result.history.final.evaluation
    with torch.no_grad():
        for silo in silos:
            predicted = model(silo.x_test.float()).argmax(dim=1)
            accuracy = (predicted == silo.y_test).double().mean().item()
            assert accuracy == pytest.approx(evaluation[silo.name]["accuracy"], abs=1e-12)


@pytest.fixture
def consortium(tmp_path: Path):
    consortium = provision(tmp_path, ("silo-0", "silo-1", "silo-2", "silo-3"))
    yield consortium
    consortium.stop_all()


def test_a_dp_deployment_with_masked_sums_trains_the_plugin_and_its_model_loads_back(
    consortium: Consortium,
) -> None:
    """silo-3's rules do not list the factory: it refuses, and the three others train."""
    document = example_document(
        silos=4,
        privacy=DP,
        secure_aggregation="masking",
        participants={"min_silos": 2, "phase_timeout_s": 60},
    )
    policy = consortium.write_policy(document)
    consortium.start_coordinator(policy, "--out", "results")
    allowed = {"allowed_model_factories": [RESNET]}
    for silo in ("silo-0", "silo-1", "silo-2"):
        consortium.start_silo(
            silo, consortium.write_silo_config(silo, data=document["data"], **allowed)
        )
    consortium.start_silo("silo-3", consortium.write_silo_config("silo-3", data=document["data"]))

    assert consortium.wait("coordinator", timeout=240) == 0, consortium.log("coordinator")
    assert (
        f"silo silo-3 refused the policy: allowed_model_factories: the policy's model factory "
        f"'{RESNET}' is not in []"
    ) in consortium.log("coordinator")
    history = json.loads((consortium.root / "results" / "history.json").read_text())
    last = history["rounds"][-1]
    assert sorted(last["privacy"]) == ["silo-0", "silo-1", "silo-2"]
    assert all(0 < entry["epsilon"] < 50 for entry in last["privacy"].values())
    ledger = (consortium.root / "sites" / "silo-0" / "privacy-ledger.jsonl").read_text()
    assert "/r2/train/mask/silo-0" in ledger  # the training sums were masked

    path = consortium.root / "results" / "final_model.safetensors"
    model = load_final_model(path)
    assert isinstance(model, ResidualCnn)
    tensors, _ = decode_tensors(path.read_bytes())
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert torch.equal(flat, tensors["model"])


def refusing_document(model: dict, **overrides: object) -> dict:
    return {**example_document(silos=1), "model": model, **overrides}


REFUSALS = {
    "not installed": (
        refusing_document({**pinned_model(RESNET, width=8, blocks=2), "factory": NOT_INSTALLED}),
        NOT_INSTALLED,
        f"model factory '{NOT_INSTALLED}' is not installed at this site",
    ),
    "another architecture": (
        refusing_document(pinned_model(RESNET, width=8, blocks=2)),
        RESNET,
        "tensor 15 'head.weight': the policy pins [10, 9] float32, this site builds [10, 8] "
        "float32",
    ),
    "batchnorm under dp": (
        refusing_document(pinned_model(BATCHNORM, width=8, blocks=2), privacy=DP),
        BATCHNORM,
        "BatchNorm2d at 'stem.1'",
    ),
}


def test_silo_processes_refuse_a_plugin_not_installed_not_as_pinned_or_batchnorm_under_dp(
    tmp_path: Path,
) -> None:
    """Three one-silo consortia at once; each silo allows the factory, and refuses the job."""
    runs: dict[str, tuple[Consortium, str]] = {}
    try:
        for case, (document, factory, reason) in REFUSALS.items():
            document = copy.deepcopy(document)
            if case == "another architecture":  # one tensor's shape edited, the pin re-signed
                pin = document["model"]["architecture"]
                index = pin["tensors"].index("head.weight [10,8] float32")
                pin["tensors"][index] = "head.weight [10,9] float32"
                pin["digest"] = architecture.digest(pin["tensors"])
            root = tmp_path / case.replace(" ", "-")
            root.mkdir()
            consortium = provision(root, ("silo-0",))
            runs[case] = (consortium, reason)
            policy = consortium.write_policy(document)
            consortium.start_coordinator(policy, join_timeout_s=120)
            config = consortium.write_silo_config(
                "silo-0", data=document["data"], allowed_model_factories=[factory]
            )
            consortium.start_silo("silo-0", config)
        for case, (consortium, reason) in runs.items():
            assert consortium.wait("coordinator", timeout=120) != 0, case
            log = consortium.log("coordinator")
            assert "silo silo-0 refused the policy: " in log, log
            assert reason in log, (case, log)
    finally:
        for consortium, _ in runs.values():
            consortium.stop_all()
