"""Warm starts (`model.init`): a job starts from a model file, pinned by the digest of its
tensors. The coordinator (or simulate) alone reads the file; under model lineage every silo
holds the first model it is sent to its own policy's digest, so a coordinator cannot start the
job from another model (the attack is run against unmodified silos with the real engine and
protocol, tests/adversarial/rewriting.py, with and without lineage as the lineage tests do).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner, Result
from hypothesis import given, settings
from hypothesis import strategies as st

from fedsilo.coordinator.engine import RoundRecord
from fedsilo.models.card import CARD_KEY, ModelCard
from fedsilo.models.warm_start import flat_digest, read_warm_start, tensors_digest
from fedsilo.ops.cli import main
from fedsilo.ops.report import write_final_model
from fedsilo.ops.simulate import simulate
from fedsilo.policies.loading import parse_policy
from fedsilo.policies.model import LinearModel
from fedsilo.policies.schema import Policy
from fedsilo.wire.messages import TaskResult
from fedsilo.wire.tasks.tensor_names import MODEL
from fedsilo.wire.tensors import ParameterSpec, encode_tensors
from tests.adversarial.rewriting import Consortium
from tests.adversarial.test_model_lineage import MODEL_CARRYING, rewriting, rounds, with_model
from tests.deployment import Consortium as Deployment
from tests.deployment import policy_document, wait_until_ended

DOCUMENT: dict = {
    "version": 1,
    "name": "first",
    "seed": 5,
    "rounds": 2,
    "algorithm": {"name": "fedavg"},
    "model": {"name": "linear"},
    "training": {"epochs": 1, "batch_size": 32, "lr": 0.1},
    "participants": {"min_silos": 2, "phase_timeout_s": 60},
    "data": {"source": "sklearn:breast_cancer", "partition": {"kind": "iid", "silos": 3}},
}


@dataclass(frozen=True)
class FirstJob:
    """Job A, simulated: its final model's file and digest, and its final evaluation."""

    file: Path
    digest: str
    model: torch.Tensor
    evaluation: Mapping[str, Mapping[str, float]]


def run_first_job(folder: Path, **sections: object) -> FirstJob:
    """Job A (DOCUMENT with `sections` replaced), simulated, its final model written in
    `folder`."""
    result = simulate(parse_policy(DOCUMENT | sections))
    write_final_model(folder, result.policy, result.history.state)
    file = folder / "final_model.safetensors"
    assert result.history.final.evaluation is not None
    return FirstJob(
        file,
        read_warm_start(file).digest,
        result.history.state.model,
        result.history.final.evaluation,
    )


@pytest.fixture(scope="module")
def first_job(tmp_path_factory: pytest.TempPathFactory) -> FirstJob:
    return run_first_job(tmp_path_factory.mktemp("first-job"))


def warm(job: FirstJob, **sections: object) -> Policy:
    """Job B: job A's policy started from A's final model, with `sections` replaced."""
    init = {"file": str(job.file), "digest": job.digest}
    return parse_policy(
        DOCUMENT | {"name": "second", "model": {"name": "linear", "init": init}} | sections
    )


def fedsilo(*args: str | Path) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args])


# A job starts where the other ended


SCALED = {**DOCUMENT["data"], "scaling": "federated"}


@pytest.mark.parametrize(
    "sections",
    [
        {"secure_aggregation": {"method": "masking"}},
        {"data": SCALED},  # setup's standardisation first (not under masking: raw moments)
    ],
    ids=["masking with model lineage", "federated scaling"],
)
def test_a_job_warm_started_from_another_jobs_final_model_starts_at_its_final_metrics(
    sections: dict, tmp_path: Path
) -> None:
    """Job B starts from job A's final model bit for bit, after setup's other phases:
    evaluated before any training, it has A's final metrics on every silo, and every silo
    trains round 1 from it (under model lineage each takes it as its first model only once
    its digest is the pinned one)."""
    first = run_first_job(tmp_path, data=sections.get("data", DOCUMENT["data"]))
    c = Consortium(warm(first, **sections))
    engine = c.engine()
    state, _ = engine._start()
    assert torch.equal(state.model, first.model)
    before = RoundRecord(1, "final", 0.0)
    engine._evaluate(state, 1, before)
    assert before.evaluation == first.evaluation
    engine._run_round(state, 1)
    trained = [a for a in c.answers if a.message.round == 1 and MODEL in a.message.tensors]
    assert {a.message.silo for a in trained if a.result.ok} == set(c.silos)
    assert all(torch.equal(a.message.tensors[MODEL], first.model) for a in trained)
    assert not c.refusals()


# The attack: a coordinator that starts the job from another model


@pytest.mark.parametrize("lineage", [True, False])
def test_a_coordinator_sending_another_first_model_than_the_pinned_one_is_refused_by_every_silo(
    first_job: FirstJob, lineage: bool
) -> None:
    """The coordinator ignores the warm start and sends the model built from the seed (any
    other model is the same to the silos). Under model lineage every silo refuses it, naming
    `model.init.digest` and both digests; without lineage (`lineage: false`) the coordinator
    chooses every model, the first one too, and the silos train it."""
    c = Consortium(warm(first_job, secure_aggregation={"method": "masking", "lineage": lineage}))

    def seeded() -> TaskResult:
        """An answer to the `init` task: the model every silo built from the seed."""
        return next(a.result for a in c.answers if a.message.kind == "init")

    c.rewrite = rewriting(MODEL_CARRYING, 1, lambda m: with_model(m, seeded().tensors[MODEL]))
    rounds(c, 1)
    if lineage:
        refused = c.refusals("secagg_mask")
        assert set(refused) == set(c.silos)
        sent = flat_digest(seeded().tensors[MODEL], seeded().spec)
        for error in refused.values():
            assert "model.init.digest" in error
            assert first_job.digest in error and sent in error
        assert not c.answered("secagg_mask")
    else:
        assert set(c.answered("secagg_mask")) == set(c.silos)


# The digest is the tensors', not the file's


names = st.text("abcdefgh.", min_size=1, max_size=6)
shapes = st.lists(st.integers(0, 3), min_size=0, max_size=3)


@st.composite
def named_tensors(draw: st.DrawFn) -> dict[str, torch.Tensor]:
    """One to four tensors of distinct names, float32 or float64, each of its own shape, with
    any values (NaN and infinities included: the digest reads bytes)."""
    tensors = {}
    for name in draw(st.lists(names, min_size=1, max_size=4, unique=True)):
        shape = draw(shapes)
        dtype = draw(st.sampled_from([torch.float32, torch.float64]))
        count = int(torch.tensor(shape, dtype=torch.int64).prod()) if shape else 1
        values = draw(st.lists(st.floats(width=32), min_size=count, max_size=count))
        tensors[name] = torch.tensor(values, dtype=dtype).reshape(shape)
    return tensors


@given(tensors=named_tensors(), data=st.data())
@settings(max_examples=60, deadline=None)
def test_the_digest_is_the_same_for_the_same_tensors_in_any_order_and_changes_with_any_of_them(
    tensors: dict[str, torch.Tensor], data: st.DataObject
) -> None:
    """Property: reordering the tensors keeps the digest; changing one value's bits, one name,
    one shape (the same bytes reshaped) or one dtype changes it."""
    digest = tensors_digest(tensors)
    order = data.draw(st.permutations(list(tensors)))
    assert tensors_digest({name: tensors[name] for name in order}) == digest
    name = data.draw(st.sampled_from(sorted(tensors)))
    tensor = tensors[name]
    changes = {
        "renamed": {(f"{n}!" if n == name else n): t for n, t in tensors.items()},
        "retyped": {
            **tensors,
            name: tensor.to(torch.float64 if tensor.dtype == torch.float32 else torch.float32),
        },
        "reshaped": {**tensors, name: tensor.reshape(1, *tensor.shape)},
    }
    if tensor.numel():
        flipped = tensor.clone()
        byte = data.draw(st.integers(0, tensor.numel() * tensor.element_size() - 1))
        flipped.reshape(-1).view(torch.uint8)[byte] ^= 1 << data.draw(st.integers(0, 7))
        changes["one value"] = {**tensors, name: flipped}
    for what, changed in changes.items():
        assert tensors_digest(changed) != digest, what


@given(flat=st.lists(st.floats(width=32), min_size=8, max_size=8), version=st.text(max_size=8))
@settings(max_examples=20, deadline=None)
def test_two_model_files_of_the_same_tensors_under_other_metadata_have_one_digest(
    flat: list[float], version: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A final-model file's card and header (another fedsilo version, extras) are not the
    model: its digest is the tensors' digest."""
    spec = ParameterSpec.from_json(
        {"dtype": "float32", "entries": [["fc.weight", [2, 3]], ["fc.bias", [2]]]}
    )
    model = torch.tensor(flat, dtype=torch.float32)
    folder = tmp_path_factory.mktemp("files")
    digests = set()
    for index, extra in enumerate(({}, {"note": version, "rounds": 7})):
        card = ModelCard.describe(
            fedsilo_version=version if index else "0.2.0",
            algorithm="fedavg",
            model=LinearModel(name="linear"),
            spec=spec,
            scaling="local",
            seed=index,
        )
        header = {"spec": spec.to_json(), "extra": extra, CARD_KEY: card.to_json()}
        path = folder / f"{index}.safetensors"
        path.write_bytes(encode_tensors({MODEL: model}, header))
        digests.add(read_warm_start(path).digest)
    assert digests == {tensors_digest(spec.unflatten(model))}


# The operator's commands


def test_model_digest_prints_the_block_that_validate_and_simulate_read_from_the_policys_folder(
    first_job: FirstJob, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`fedsilo model digest FILE` prints the block to paste; pasted with the file beside the
    policy, a relative `file` is read from the policy file's folder, not the working directory:
    `policy validate` checks the digest and that the tensors fit the network, and `simulate`
    starts from the file."""
    folder = tmp_path / "next"
    folder.mkdir()
    (folder / "start.safetensors").write_bytes(first_job.file.read_bytes())
    printed = fedsilo("model", "digest", folder / "start.safetensors")
    assert printed.exit_code == 0, printed.output
    block = yaml.safe_load("model:\n" + printed.output)["model"]["init"]
    assert block["digest"] == first_job.digest
    document = DOCUMENT | {
        "model": {"name": "linear", "init": {**block, "file": "start.safetensors"}}
    }
    (folder / "policy.yaml").write_text(yaml.safe_dump(document))
    monkeypatch.chdir(tmp_path)  # the policy is next/policy.yaml from here
    checked = fedsilo("policy", "validate", "next/policy.yaml")
    assert checked.exit_code == 0, checked.output
    assert "model.init: " in checked.output and "they fit the network" in checked.output
    ran = fedsilo("simulate", "--policy", "next/policy.yaml", "--out", "runs")
    assert ran.exit_code == 0, ran.output


def test_a_digest_other_than_the_files_is_refused_by_policy_validate_in_one_message(
    first_job: FirstJob, tmp_path: Path
) -> None:
    policy = tmp_path / "policy.yaml"
    init = {"file": str(first_job.file), "digest": "0" * 64}
    policy.write_text(yaml.safe_dump(DOCUMENT | {"model": {"name": "linear", "init": init}}))
    result = fedsilo("policy", "validate", policy)
    assert result.exit_code == 1
    assert result.exception is None or isinstance(result.exception, SystemExit)
    (line,) = result.output.strip().splitlines()
    assert "model.init.digest" in line and "0" * 64 in line and first_job.digest in line


def test_simulate_refuses_a_model_file_of_another_network_naming_the_tensor(
    first_job: FirstJob, tmp_path: Path
) -> None:
    """Job A's linear model cannot start an MLP: one message at simulate's start names
    `model.init.file` and the first tensor that differs; nothing is written."""
    policy = tmp_path / "policy.yaml"
    init = {"file": str(first_job.file), "digest": first_job.digest}
    policy.write_text(yaml.safe_dump(DOCUMENT | {"model": {"name": "mlp", "init": init}}))
    result = fedsilo("simulate", "--policy", policy, "--out", tmp_path / "out")
    assert result.exit_code == 1
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "model.init.file: tensor 0: the file holds 1.weight [2,30] float32" in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


# Through a real deployment


def test_a_deployed_job_starts_from_the_final_model_job_results_fetched(
    consortium: Deployment,
) -> None:
    """`coordinator serve` and three silo agents: job A runs, `fedsilo job results` fetches its
    results and prints the `init:` block; job B, pasted from it and under masking with model
    lineage, validates against the fetched file, completes (every silo took A's final model as
    B's first only once its digest was the pinned one) and ends with the model a simulation of
    B gives, bit for bit."""
    consortium.serve_with_silos()
    a = consortium.write_policy(policy_document(rounds=1, name="first"), "a.yaml")
    first = consortium.submit(a)
    assert wait_until_ended(consortium, first, 120).status == "completed", consortium.log(
        "coordinator"
    )
    out = consortium.root / "fetched"
    fetched = fedsilo("job", "results", first, "--kit", consortium.kits / "operator", "--out", out)
    assert fetched.exit_code == 0, fetched.output
    block = fetched.output.split("to start a job from this model:\n", 1)[1]
    init = yaml.safe_load("model:\n" + block)["model"]["init"]
    assert init["digest"] == read_warm_start(out / "final_model.safetensors").digest
    document = policy_document(
        rounds=1,
        name="second",
        model={"name": "linear", "init": init},
        secure_aggregation={"method": "masking"},
    )
    b = consortium.write_policy(document, "b.yaml")
    assert fedsilo("policy", "validate", b).exit_code == 0
    second = consortium.submit(b)
    assert wait_until_ended(consortium, second, 120).status == "completed", consortium.log(
        "coordinator"
    )
    ours = consortium.root / "second"
    fetched = fedsilo(
        "job", "results", second, "--kit", consortium.kits / "operator", "--out", ours
    )
    assert fetched.exit_code == 0, fetched.output
    simulated = simulate(parse_policy(document)).history.state.model
    assert torch.equal(read_warm_start(ours / "final_model.safetensors").model, simulated)
