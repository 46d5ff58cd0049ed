"""Refactors keep behaviour: every example policy, simulated for a few rounds, gives the same
round records and the same final model, bit for bit, as when the baseline was recorded
(`tests/fixtures/examples_baseline.json`). A change that means to alter results records a new
baseline on purpose: `python -m tests.test_examples_unchanged --record`, and says why.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from fedsilo.ops.simulate import load_silos, simulate
from fedsilo.policies.loading import load_policy
from fedsilo.policies.schema import Policy

EXAMPLES = Path(__file__).resolve().parents[1] / "policies" / "examples"
BASELINE = Path(__file__).resolve().parent / "fixtures" / "examples_baseline.json"
ROUNDS = 2
RECORDED = ("status", "evaluation", "summary", "mixing", "client_epsilon", "error")


def short(policy: Policy) -> Policy:
    """The example cut to `ROUNDS` rounds, evaluated every round."""
    document = {**policy.model_dump(), "rounds": min(ROUNDS, policy.rounds), "eval_every": 1}
    return Policy.model_validate(document)


def fingerprint(example: Path) -> dict[str, Any]:
    """What a refactor must not change: each round's outcome, as exact float hex, and the
    BLAKE2b of the final server state's tensors."""
    policy = short(load_policy(example))
    result = simulate(policy, load_silos(policy, EXAMPLES))
    rounds = [
        {key: _exact(getattr(record, key)) for key in RECORDED if getattr(record, key) is not None}
        for record in result.history.records
    ]
    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in sorted(result.history.state.tensors.items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return {"rounds": rounds, "final_state": digest.hexdigest()}


def _exact(value: Any) -> Any:
    if isinstance(value, float):
        return value.hex()
    if isinstance(value, dict):
        return {str(k): _exact(v) for k, v in sorted(value.items())}
    if isinstance(value, (list, tuple)):
        return [_exact(v) for v in value]
    return value


def examples() -> list[Path]:
    return sorted(EXAMPLES.glob("*.yaml"))


@pytest.mark.parametrize("example", examples(), ids=lambda p: p.stem)
def test_every_example_policy_behaves_as_recorded(example: Path) -> None:
    baseline = json.loads(BASELINE.read_text())
    assert example.name in baseline, f"no baseline for {example.name}: record one on purpose"
    assert fingerprint(example) == baseline[example.name]


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:
    recorded = {example.name: fingerprint(example) for example in examples()}
    BASELINE.write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")
    print(f"recorded {len(recorded)} examples in {BASELINE}")
