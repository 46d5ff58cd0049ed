"""Every policy the schema accepts runs or is refused in one message (issue 37).

Policies are drawn across every axis of the schema (tests/policy_space.py: each section from
its own pydantic model, the data from a catalogue of sources, partitions and plug-ins) and put
to the command line as a user would: `fedsilo model pin` for a plug-in network, then
`fedsilo policy validate`, then `fedsilo simulate`. The property every draw keeps:

- a command that refuses exits with status 1 and one message (`Error: ...`) naming a field of
  the policy, never a Python traceback;
- a policy `policy validate` accepts, whose data it read here, runs under `simulate` to the end,
  and every silo's final headline metric is finite (or the run says which silos' are not: a
  training that diverged, which a policy can ask for); or, where a rule only the run can meet
  stops it (a weight rule applied to a mixing schedule's weights), `simulate` refuses it in one
  message in which no silo's task crashed;
- under DP, every release a silo booked is one of its plan's (silo/budget_plan.py), so its
  epsilon is at most the plan's, and equal where it took every planned position; and with a cap
  below a silo's plan, `simulate` refuses the job before round 1 and no ledger is written.

CI draws a fixed, derandomised sample (`EXAMPLES`, a few minutes); `make fuzz` draws many more
at a random seed (FEDSILO_POLICY_EXAMPLES, FEDSILO_POLICY_SEED). A crash found here becomes a
named regression test (tests/test_policy_regressions.py).
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
import textwrap
from collections import Counter
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from click.testing import CliRunner, Result
from hypothesis import HealthCheck, Phase, assume, event, given, seed, settings
from hypothesis import strategies as st

from fedsilo.models import plugins
from fedsilo.models.plugins import GROUP
from fedsilo.ops.cli import main
from fedsilo.ops.cli_support import USER_ERRORS
from fedsilo.ops.plan_cli import consortium_plans
from fedsilo.ops.simulate import check_consortium, load_silos, simulate
from fedsilo.policies.loading import PolicyError, load_policy, parse_policy
from fedsilo.policies.schema import Policy
from fedsilo.privacy.accounting import Mechanism
from fedsilo.privacy.ledger import PrivacyLedger
from fedsilo.silo.budget_plan import BudgetPlan
from fedsilo.wire.messages import SIMULATION
from fedsilo.wire.tensors import decode_tensors
from tests.deployment import provision
from tests.policy_space import PLUGIN_FACTORIES, plugin_factory, policies

EXAMPLES = int(os.environ.get("FEDSILO_POLICY_EXAMPLES", "300"))
SEED = os.environ.get("FEDSILO_POLICY_SEED")  # unset: derandomised, the same draws every run
FILES = Path(tempfile.mkdtemp(prefix="fedsilo-policy-space-"))
# What a silo's refusal names when a task crashed in it rather than refused (silo/agent.py
# reports a failed task as its exception's type and message).
CRASHES = re.compile(
    r"\b(RuntimeError|TypeError|KeyError|IndexError|AttributeError|ZeroDivisionError"
    r"|AssertionError|NameError|UnboundLocalError|OverflowError|NotImplementedError"
    r"|LinAlgError|FloatingPointError)\b"
)
SECTIONS = re.compile(
    r"\b(version|name|seed|rounds|eval_every|algorithm|model|training|participants|compute"
    r"|data|privacy|secure_aggregation|channel)\b"
)


@pytest.fixture(autouse=True)
def installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The example package's network and the test fixtures' dropout network, installed."""
    entry_points = [
        EntryPoint(name=value.rsplit(":", 1)[1], value=value, group=GROUP)
        for value in PLUGIN_FACTORIES
    ]
    monkeypatch.setattr(plugins, "installed_factories", lambda: entry_points)


def fedsilo(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


def refused_in_one_message(result: Result, command: str) -> str:
    """The refusal's message, after checking it is one: status 1, no traceback, one `Error:`
    naming a field of the policy."""
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"{command} crashed") from result.exception
    assert result.exit_code == 1, (command, result.output)
    assert "Traceback" not in result.output, (command, result.output)
    errors = [line for line in result.output.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1, (command, result.output)
    message = result.output[result.output.index("Error: ") :]
    assert SECTIONS.search(message), (command, "names no field", message)
    return message


def pinned(document: dict[str, Any], folder: Path) -> dict[str, Any] | None:
    """The document with its plug-in network pinned by `fedsilo model pin`, or None when the
    command refused it (in one message)."""
    path = folder / "unpinned.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    result = fedsilo("model", "pin", str(path))
    if result.exit_code != 0:
        refused_in_one_message(result, "model pin")
        event("refused by model pin")
        return None
    block = yaml.safe_load(textwrap.dedent(result.output))
    return {**document, "model": {**document["model"], **block}}


def check_one(document: dict[str, Any]) -> None:
    """The property, for one drawn policy."""
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        if plugin_factory(document) is not None:
            pinned_document = pinned(document, folder)
            if pinned_document is None:
                return
            document = pinned_document
        policy = folder / "policy.yaml"
        policy.write_text(yaml.safe_dump(document, sort_keys=False))
        validated = fedsilo("policy", "validate", str(policy))
        if validated.exit_code != 0:
            message = refused_in_one_message(validated, "policy validate")
            event(f"refused by validate: {message.split(':')[2].strip()[:40]}")
            return
        if validated.exception is not None:
            raise AssertionError("policy validate crashed") from validated.exception
        assert "data: not checked here" not in validated.output  # the catalogue is all here
        out = folder / "out"
        ran = fedsilo("simulate", "--policy", str(policy), "--out", str(out))
        if ran.exit_code != 0:
            # a rule only the run meets (a weight rule on a mixing schedule's weights, a
            # budget spent): one message, in which no silo crashed
            message = refused_in_one_message(ran, "simulate")
            assert not CRASHES.search(message), ("a silo crashed", message)
            event(f"refused by simulate: {message[7:60]}")
            return
        results = json.loads((out / "results.json").read_text())
        final = results["final"]["per_silo"]
        assert final, "no silo was evaluated"
        metric = _headline(results)
        lost = [s for s, m in final.items() if m.get(metric) is None]  # JSON's NaN and inf
        if lost:  # a training that diverged, as the run says
            said = " ".join(ran.output.split())  # as printed, wrapped at any width
            assert f"the final {metric} is not finite at {', '.join(sorted(lost))}" in said
            event("ran, and said it diverged")
            return
        assert all(math.isfinite(m[metric]) for m in final.values()), final
        event("ran")
        if (out / "ledgers").is_dir():
            check_budget(policy, out / "ledgers")


def undominated(booked: Counter[Mechanism], planned: Counter[Mechanism]) -> list[Mechanism]:
    """The booked mechanisms no distinct planned one covers: a Gaussian report is covered by a
    planned Gaussian of the same noise and at least its sensitivity (a plan counts the largest
    release a task may make, e.g. SuPerFed's evaluation of a silo that trained that round, which
    a silo the round did not sample makes smaller; it costs less epsilon)."""
    left = list(planned.elements())
    missing = []
    for mechanism in sorted(booked.elements(), key=lambda m: -(m.sensitivity or 0.0)):
        cover = next(
            (
                m
                for m in sorted(left, key=lambda m: m.sensitivity or 0.0)
                if m.kind == mechanism.kind == "gaussian"
                and m.noise_std == mechanism.noise_std
                and (m.sensitivity or 0.0) >= (mechanism.sensitivity or 0.0)
            ),
            None,
        )
        if cover is None:
            missing.append(mechanism)
        else:
            left.remove(cover)
    return missing


def check_budget(path: Path, ledgers: Path) -> None:
    """Booked within planned at every silo (each booked release planned, or covered by a larger
    planned one: `undominated`); a cap below the plan refused before anything."""
    policy = load_policy(path)
    plans = planned_by_silo(policy, path.parent)
    for silo, plan in plans.items():
        booked = Counter(
            r.mechanism
            for r in PrivacyLedger(ledgers / f"{silo}.jsonl").records()
            if r.mechanism.kind != "public"
        )
        planned = Counter(m for m in plan.releases if m.kind != "public")
        unplanned = undominated(booked - planned, planned - booked)
        assert not unplanned, (silo, unplanned)
        if booked == planned:
            spent = PrivacyLedger(ledgers / f"{silo}.jsonl").spent(SIMULATION)
            assert math.isclose(plan.epsilon, spent, rel_tol=1e-9), (silo, plan.epsilon, spent)
    least = min((p.epsilon for p in plans.values() if p.epsilon), default=None)
    if least is None or not math.isfinite(least):
        return
    document = yaml.safe_load(path.read_text())
    document["privacy"]["epsilon_cap"] = least / 2
    capped = path.parent / "capped.yaml"
    capped.write_text(yaml.safe_dump(document, sort_keys=False))
    out = path.parent / "capped-out"
    refused = fedsilo("simulate", "--policy", str(capped), "--out", str(out))
    assert refused.exit_code == 1, refused.output
    refused_in_one_message(refused, "simulate")
    assert not out.exists()
    event("under DP: booked within plan, a cap below it refused")


def planned_by_silo(policy: Policy, base_dir: Path) -> dict[str, BudgetPlan]:
    """Each simulated silo's plan, its agent built as `simulate` builds it."""
    return {p.silo: p for p in consortium_plans(policy, load_silos(policy, base_dir))}


def _headline(results: dict[str, Any]) -> str:
    summary = results["final"]["summary"] or {}
    return next((m for m in ("accuracy", "rmse", "c_index") if m in summary), "loss")


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=SEED is None,
    database=None,
    suppress_health_check=list(HealthCheck),
    phases=[Phase.explicit, Phase.generate, Phase.shrink],
)
@given(document=policies(FILES))
def test_every_drawn_policy_runs_to_finite_metrics_or_is_refused_in_one_message(
    document: dict[str, Any],
) -> None:
    check_one(document)


# the budget's property needs DP, which few draws of the whole space turn on: these draw every
# section as above and a DP privacy section
DP_EXAMPLES = int(os.environ.get("FEDSILO_POLICY_DP_EXAMPLES", "80"))
DP_PRIVACY = st.one_of(
    st.fixed_dictionaries(
        {"dp_sgd": st.fixed_dictionaries({"noise_multiplier": st.floats(0.5, 3)})}
    ),
    st.fixed_dictionaries(
        {"dp_sgd": st.fixed_dictionaries({"training_epsilon": st.floats(1, 50)})}
    ),
    st.fixed_dictionaries({"job_epsilon": st.floats(5, 200), "dp_sgd": st.just({})}),
    st.fixed_dictionaries(
        {
            "client_dp": st.fixed_dictionaries(
                {"clip": st.floats(0.1, 5), "noise_multiplier": st.floats(0.5, 3)}
            )
        }
    ),
)


@settings(
    max_examples=DP_EXAMPLES,
    deadline=None,
    derandomize=SEED is None,
    database=None,
    suppress_health_check=list(HealthCheck),
    phases=[Phase.explicit, Phase.generate],
)
@given(document=policies(FILES), privacy=DP_PRIVACY)
def test_under_dp_every_silo_books_within_its_plan_and_a_cap_below_it_starts_nothing(
    document: dict[str, Any], privacy: dict[str, Any]
) -> None:
    check_one({**document, "privacy": privacy})


# accepted policies run over real processes, drawn as the property test draws them
DEPLOYED = int(os.environ.get("FEDSILO_POLICY_DEPLOYED", "2"))


@settings(
    max_examples=DEPLOYED,
    deadline=None,
    derandomize=SEED is None,
    database=None,
    suppress_health_check=list(HealthCheck),
    phases=[Phase.generate],
)
@given(document=policies(FILES))
def test_a_sample_of_accepted_policies_runs_over_real_processes_as_simulated(
    document: dict[str, Any],
) -> None:
    # A drawn policy the simulation takes (no plug-in network: the silo processes have only
    # what is installed) runs as a deployment: a coordinator and one silo agent per silo of its
    # data section, each its own process over mutual TLS, to the end; without noise drawn from
    # the silos' secrets (DP) or CKKS's approximate sums, to the simulation's very model.
    assume(plugin_factory(document) is None)
    assume("partition" in document["data"])  # each site selects its silo of the same rows
    # central pools every silo's rows: a simulation's reference, which a coordinator refuses
    assume(document.get("algorithm", {}).get("name") != "central")
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        policy = load_policy_document(document)
        assume(policy is not None)
        try:
            datasets = load_silos(policy, None)
            check_consortium(policy, datasets)
        except USER_ERRORS:
            assume(False)
        names = [d.name for d in datasets]
        assume(all(re.fullmatch(r"[a-z][a-z0-9-]*", n) for n in names))
        try:
            simulated = simulate(policy, datasets)
        except USER_ERRORS:  # what this machine refuses to run (a GPU it lacks) is not deployed
            assume(False)
        assume(bool(simulated.history.failed) is False)
        consortium = provision(root, tuple(names))
        try:
            signed = consortium.write_policy(
                {**document, "participants": {**document.get("participants", {}),
                                              "phase_timeout_s": 60}}
            )  # fmt: skip
            consortium.start_coordinator(signed, "--out", "results")
            for name in names:
                consortium.start_silo(
                    name, consortium.write_silo_config(name, data=document["data"])
                )
            assert consortium.wait("coordinator", timeout=240) == 0, consortium.log("coordinator")
        finally:
            consortium.stop_all()
        results = json.loads((root / "results" / "results.json").read_text())
        assert [r["status"] for r in results["history"]] == ["completed"] * policy.rounds
        exact = (
            not policy.privacy.differentially_private and policy.secure_aggregation.method != "ckks"
        )
        if exact:
            tensors, _ = decode_tensors((root / "results" / "final_model.safetensors").read_bytes())
            expected = simulated.history.state.tensors  # `local`: each silo's model, no global one
            assert set(tensors) == set(expected)
            assert all(torch.equal(tensors[name], tensor) for name, tensor in expected.items())
        event(f"deployed {policy.algorithm.name} on {policy.data.source}")


def load_policy_document(document: dict[str, Any]) -> Policy | None:
    try:
        return parse_policy(document)
    except PolicyError:
        return None


if SEED is not None:  # `make fuzz`: a seed of its own, printed, so a failure can be rerun
    test_every_drawn_policy_runs_to_finite_metrics_or_is_refused_in_one_message = seed(int(SEED))(
        test_every_drawn_policy_runs_to_finite_metrics_or_is_refused_in_one_message
    )
    test_a_sample_of_accepted_policies_runs_over_real_processes_as_simulated = seed(int(SEED))(
        test_a_sample_of_accepted_policies_runs_over_real_processes_as_simulated
    )
