"""A researcher's own code without forking fedsilo: a package that `fedsilo new --strategy
--step` writes outside the repository, with a strategy plug-in (FedBN, written against the
public API only) and training steps, installed as pip installs one (offline, into a folder on
PYTHONPATH).

- Its policy runs in a simulation plainly, under DP-SGD and under masking, and in a real
  deployment (coordinator and silo processes over mTLS) under DP-SGD and masking at once;
  its own tests pass, the silo-contract property among them (`fedsilo.check_silo_contract`).
- FedBN's silos keep their normalisation layers: what leaves a silo in their place is what it
  received, so the global model's stay as initialised while FedAvg's move.
  A coordinator that writes its own values there gets back exactly those, never a silo's.
- Bad input gets one message: a step that goes around the privacy engine under DP-SGD (it
  back-propagates or moves the parameters itself, or descends twice), a step DP-SGD cannot
  account for (early stopping), a pin whose version or digest differs from the installed
  code (strategy or step), a strategy plug-in without a silo contract, an unknown algorithm, a
  step under an algorithm that trains with its own task kind.
"""

from __future__ import annotations

import importlib
import math
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner

import fedsilo
from fedsilo.coordinator.jobs import COMPLETED
from fedsilo.models.zoo import build_model
from fedsilo.ops.cli import main
from fedsilo.ops.contract_testing import record
from fedsilo.policies.loading import PolicyError
from fedsilo.policies.seeding import derive_seed
from fedsilo.silo.local_parameters import KEPT
from fedsilo.wire.messages import TaskMessage, TaskResult
from fedsilo.wire.tasks.tensor_names import MODEL
from fedsilo.wire.tensors import ParameterSpec
from tests.deployment import provision, wait_until_ended

NAME, PACKAGE = "site-plugins", "site_plugins"
DP_SGD = {
    "delta": 1e-5,
    "dp_sgd": {"noise_multiplier": 1.0, "max_grad_norm": 1.0, "poisson_sampling": False},
}


@dataclass(frozen=True)
class Installed:
    folder: Path  # the package `fedsilo new` wrote
    site: Path  # the folder it is installed in

    @property
    def policy(self) -> dict:
        return yaml.safe_load((self.folder / "policy.yaml").read_text())

    def env(self) -> dict[str, str]:
        paths = [str(self.site), os.environ.get("PYTHONPATH", "")]
        return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths))}


def pip_install(site: Path, *folders: Path) -> None:
    install = subprocess.run(
        [
            *(sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index"),
            *("--no-build-isolation", "--target", str(site), *map(str, folders)),
        ],
        capture_output=True,
        text=True,
    )
    assert install.returncode == 0, install.stderr


@pytest.fixture(scope="module")
def package(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    root = tmp_path_factory.mktemp("research")
    made = CliRunner().invoke(
        main, ["new", NAME, "--strategy", "--step", "--out", str(root / NAME)]
    )
    assert made.exit_code == 0, made.output
    site = root / "site-packages"
    pip_install(site, root / NAME)
    return Installed(root / NAME, site)


@pytest.fixture
def installed(package: Installed, monkeypatch: pytest.MonkeyPatch) -> Iterator[Installed]:
    """The package importable in this process (and in the processes it starts)."""
    monkeypatch.syspath_prepend(str(package.site))
    monkeypatch.setenv("PYTHONPATH", package.env()["PYTHONPATH"])
    importlib.invalidate_caches()
    yield package


def simulated(document: dict, base: Path) -> fedsilo.SimulationResult:
    return fedsilo.simulate(fedsilo.parse_policy(document), fedsilo.load_silos(
        fedsilo.parse_policy(document), base))  # fmt: skip


@pytest.mark.parametrize("privacy", ["none", "dp_sgd", "masking"])
def test_the_packages_strategy_and_step_run_in_a_simulation(
    installed: Installed, privacy: str
) -> None:
    document = {**installed.policy, "rounds": 2}
    if privacy == "dp_sgd":
        document["privacy"] = DP_SGD
    if privacy == "masking":
        document |= {"secure_aggregation": "masking", "participants": {"min_silos": 3}}
    result = simulated(document, installed.folder)
    assert {r.round: r.status for r in result.history.records if r.round} == {
        1: "completed",
        2: "completed",
    }
    assert all(math.isfinite(m["accuracy"]) for m in result.history.final.evaluation.values())
    assert bool(result.ledgers) == (privacy == "dp_sgd")


def test_the_packages_own_tests_pass_the_silo_contract_property_among_them(
    package: Installed,
) -> None:
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
        cwd=package.folder,
        env=package.env(),
        capture_output=True,
        text=True,
    )
    assert tests.returncode == 0, tests.stdout + tests.stderr
    assert "5 passed" in tests.stdout


def test_fedbn_sends_back_the_normalisation_layers_it_received_and_fedavg_does_not(
    installed: Installed,
) -> None:
    """The global model's `norm` entries are the initial model's under FedBN (each silo trains
    its own and sends back what it received), and moved under FedAvg with the same settings."""
    document = {**installed.policy, "rounds": 2}
    policy = fedsilo.parse_policy(document)
    initial = build_model(policy.model, (12,), 3, derive_seed(policy.seed, "model-init"))
    fedavg = {
        **document,
        "algorithm": {"name": "fedavg"},
    }
    finals = {
        name: simulated(doc, installed.folder).history.state.tensors[MODEL]
        for name, doc in (("fedbn", document), ("fedavg", fedavg))
    }
    offset, norm = 0, []
    for name, parameter in initial.named_parameters():
        if name.startswith("norm."):
            norm.append((offset, parameter.detach().reshape(-1)))
        offset += parameter.numel()
    for start, values in norm:
        span = slice(start, start + values.numel())
        assert torch.allclose(finals["fedbn"][span], values, atol=1e-6)
        assert not torch.allclose(finals["fedavg"][span], values, atol=1e-6)
    assert not torch.equal(finals["fedbn"], finals["fedavg"])


SNEAKY = '''"""Steps that go around the privacy engine."""

import torch

import fedsilo


class Backward(fedsilo.TrainingStep):
    def step(self, rows, tools):
        losses = tools.row_losses(*tools.batch(rows))
        losses.mean().backward()
        tools.descend(losses)


class Moves(fedsilo.TrainingStep):
    def step(self, rows, tools):
        with torch.no_grad():
            next(tools.model.parameters()).add_(1.0)
        tools.descend(tools.row_losses(*tools.batch(rows)))


class Twice(fedsilo.TrainingStep):
    def step(self, rows, tools):
        tools.descend(tools.row_losses(*tools.batch(rows)))
        tools.descend(tools.row_losses(*tools.batch(rows)))
'''
CONTRACTLESS = '''"""A strategy plug-in that declares no silo contract."""

from typing import ClassVar, Literal

import fedsilo


class NoContract(fedsilo.PluginAlgorithm):
    strategy: ClassVar[str] = "contractless.strategy:Strategy"
    name: Literal["contractless"]
'''


def write_distribution(root: Path, name: str, module: str, entry_points: str) -> Path:
    """A one-module package `name` (folder with pyproject.toml) to pip install."""
    folder = root / name
    (folder / name).mkdir(parents=True)
    (folder / name / "__init__.py").write_text(module)
    (folder / "pyproject.toml").write_text(
        f'[build-system]\nrequires = ["setuptools>=64"]\nbuild-backend = "setuptools.build_meta"\n'
        f'[project]\nname = "{name}"\nversion = "1.0"\n{entry_points}'
        f'[tool.setuptools]\npackages = ["{name}"]\n'
    )
    return folder


@pytest.fixture(scope="module")
def broken_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("broken")
    steps = '[project.entry-points."fedsilo.steps"]\n' + "".join(
        f'{cls.lower()} = "sneaky:{cls}"\n' for cls in ("Backward", "Moves", "Twice")
    )
    algorithms = '[project.entry-points."fedsilo.algorithms"]\n'
    algorithms += 'contractless = "contractless:NoContract"\n'
    site = root / "site-packages"
    pip_install(
        site,
        write_distribution(root, "sneaky", SNEAKY, steps),
        write_distribution(root, "contractless", CONTRACTLESS, algorithms),
    )
    return site


def pinned(plugin: str) -> dict:
    """The `package:` block `fedsilo plugin pin PLUGIN` prints."""
    printed = CliRunner().invoke(main, ["plugin", "pin", plugin])
    assert printed.exit_code == 0, printed.output
    return yaml.safe_load(printed.output)["package"]


@pytest.mark.parametrize(
    ("cls", "refusal"),
    [
        ("Backward", "bypasses the privacy engine: it back-propagated into the model's parameters"),
        ("Moves", "bypasses the privacy engine: it changed the model's parameters itself"),
        ("Twice", "descended 2 times in one batch"),
    ],
)
def test_a_step_that_goes_around_the_privacy_engine_under_dp_sgd_is_refused_in_one_message(
    installed: Installed,
    broken_site: Path,
    monkeypatch: pytest.MonkeyPatch,
    cls: str,
    refusal: str,
) -> None:
    monkeypatch.syspath_prepend(str(broken_site))
    importlib.invalidate_caches()
    step = {"plugin": f"sneaky:{cls}", "package": pinned(f"sneaky:{cls}")}
    document = {
        **installed.policy,
        "rounds": 1,
        "algorithm": {"name": "fedavg"},
        "training": {**installed.policy["training"], "step": step},
        "privacy": DP_SGD,
        "participants": {"max_consecutive_failed_rounds": 1},
    }
    with pytest.raises(Exception, match=refusal) as raised:
        result = simulated(document, installed.folder)
        failed = [r for r in result.history.records if r.status != "completed"]
        raise AssertionError(str(failed))
    assert f"training.step: {cls}" in str(raised.value)


def test_early_stopping_under_dp_sgd_is_refused_before_training_with_the_reason(
    installed: Installed,
) -> None:
    training = installed.policy["training"]
    step = {**training["step"], "plugin": f"{PACKAGE}.steps:JitterUntilPlateau"}
    document = {**installed.policy, "training": {**training, "step": step}, "privacy": DP_SGD}
    with pytest.raises(ValueError, match="stops early on the validation split, which no noise"):
        simulated(document, installed.folder)
    del document["privacy"]
    simulated({**document, "rounds": 1}, installed.folder)  # without DP-SGD it runs


@pytest.mark.parametrize("field", ["version", "digest"])
def test_a_pin_that_differs_from_the_installed_code_is_refused_naming_the_key(
    installed: Installed, field: str
) -> None:
    other = {"version": "0.1.1", "digest": "0" * 64}[field]
    algorithm = installed.policy["algorithm"]
    wrong = {**algorithm, "package": {**algorithm["package"], field: other}}
    with pytest.raises(PolicyError, match=rf"algorithm: package\.{field}: "):
        fedsilo.parse_policy({**installed.policy, "algorithm": wrong})
    training = installed.policy["training"]
    step = {**training["step"], "package": {**training["step"]["package"], field: other}}
    document = {**installed.policy, "training": {**training, "step": step}}
    with pytest.raises(ValueError, match=rf"training\.step\.package\.{field}: "):
        simulated(document, installed.folder)


def test_policy_validate_refuses_a_changed_strategy_in_one_line_and_exit_status_1(
    installed: Installed, tmp_path: Path
) -> None:
    algorithm = installed.policy["algorithm"]
    wrong = {**algorithm, "package": {**algorithm["package"], "digest": "f" * 64}}
    policy = tmp_path / "policy.yaml"
    policy.write_text(yaml.safe_dump({**installed.policy, "algorithm": wrong}))
    result = CliRunner().invoke(main, ["policy", "validate", str(policy)])
    assert result.exit_code == 1
    assert "algorithm: package.digest: the code of site-plugins 0.1.0 installed here" in (
        result.output
    )
    assert "Traceback" not in result.output


def test_a_strategy_plugin_without_a_silo_contract_is_refused_in_one_message(
    broken_site: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(broken_site))
    importlib.invalidate_caches()
    package = pinned("contractless")
    with pytest.raises(PolicyError, match="declares no silo contract"):
        fedsilo.parse_policy(
            {"version": 1, "algorithm": {"name": "contractless", "package": package}}
        )


def test_an_unknown_algorithm_names_the_closest_and_the_installed_plugins(
    installed: Installed,
) -> None:
    with pytest.raises(PolicyError) as raised:
        fedsilo.parse_policy({"version": 1, "algorithm": {"name": "fedbm"}})
    assert "algorithm: unknown value 'fedbm' (did you mean 'fedbn'?); allowed: " in str(
        raised.value
    )
    assert "strategy plug-ins installed here (entry points fedsilo.algorithms: fedbn)" in str(
        raised.value
    )


def test_a_step_under_an_algorithm_that_trains_with_its_own_task_kind_is_refused(
    installed: Installed,
) -> None:
    document = {**installed.policy, "algorithm": {"name": "superfed"}}
    with pytest.raises(PolicyError, match="training.step: superfed trains with its own task kind"):
        fedsilo.parse_policy(document)


def test_fedbn_with_its_step_runs_in_a_real_deployment_under_dp_sgd_and_masking(
    installed: Installed, tmp_path: Path
) -> None:
    consortium = provision(tmp_path)
    try:
        data = {**installed.policy["data"], "args": {"n": 600}}
        consortium.start_serve()
        consortium.wait_for_log("coordinator", "serving mTLS gRPC")
        rules = {
            "allowed_model_factories": [installed.policy["model"]["factory"]],
            "allowed_strategy_plugins": ["fedbn"],
            "allowed_training_steps": [installed.policy["training"]["step"]["plugin"]],
        }
        for silo in ("silo-0", "silo-1", "silo-2"):
            consortium.start_silo(silo, consortium.write_silo_config(silo, data=data, **rules))
        document = {
            **installed.policy,
            "rounds": 2,
            "privacy": DP_SGD,
            "secure_aggregation": "masking",
            "participants": {"min_silos": 3, "phase_timeout_s": 60},
        }
        job = consortium.submit(consortium.write_policy(document))
        ended = wait_until_ended(consortium, job, timeout=240)
        assert ended.status == COMPLETED, (ended, consortium.log("coordinator")[-3000:])
    finally:
        consortium.stop_all()


@pytest.mark.parametrize(
    ("algorithm", "refusal"),
    [
        ({"name": "feddc"}, "feddc trains with its own task kind (daisy_train)"),
        ({"name": "drflm"}, "drflm trains on mixed or domain-weighted rows"),
        ({"name": "approx_fedavg"}, "approx_fedavg trains on mixed or domain-weighted rows"),
    ],
)
def test_a_step_under_a_daisy_chain_or_mixed_or_domain_weighted_rows_is_refused_when_read(
    installed: Installed, algorithm: dict, refusal: str
) -> None:
    training = {k: v for k, v in installed.policy["training"].items() if k != "epochs"}
    document = {**installed.policy, "algorithm": algorithm, "training": {**training, "steps": 2}}
    with pytest.raises(PolicyError, match=re.escape(f"training.step: {refusal}")):
        fedsilo.parse_policy(document)


def test_a_coordinator_that_sends_chosen_values_for_the_kept_layers_gets_back_only_those(
    installed: Installed,
) -> None:
    """A deviating coordinator writes its own values into the `norm` entries of round 2's
    models: every silo trains with its own kept values and answers with exactly the values it
    was sent there, never its own."""
    chosen = 7.0
    policy = fedsilo.parse_policy({**installed.policy, "rounds": 2})

    def kept_entries(spec: ParameterSpec) -> list[slice]:
        spans, offset = [], 0
        for entry in spec.entries:
            if entry.name.startswith("norm."):
                spans.append(slice(offset, offset + entry.numel))
            offset += entry.numel
        return spans

    def rewrite(message: TaskMessage) -> TaskMessage:
        if message.kind != "train" or message.round != 2 or message.spec is None:
            return message
        model = message.tensors[MODEL].clone()
        for span in kept_entries(message.spec):
            model[span] = chosen
        return replace(message, tensors={**dict(message.tensors.items()), MODEL: model})

    run = record(policy, installed.folder, rewrite=rewrite)
    answers = [TaskResult.decode(reply) for reply in run.replies]
    trained = [a for a in answers if a.kind == "train" and "/r2/" in a.task_id]
    assert len(trained) == 3
    for answer in trained:
        assert answer.spec is not None
        sent = answer.tensors[MODEL]
        for span in kept_entries(answer.spec):
            assert torch.all(sent[span] == chosen), answer.silo
        own = run.agents[answer.silo].context.state.latest(KEPT, 3)
        assert own is not None and not torch.all(own["norm.weight"] == chosen)
