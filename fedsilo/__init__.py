"""fedsilo: privacy-hardened cross-silo federated learning.

The code lives in the repository's top-level folders (wire/, policies/, privacy/, models/,
coordinator/, silo/, ops/), installed as sub-packages of this one; see docs/architecture.md for
the map and the import direction.

The names in `__all__` are the Python API (docs/python-api.md), stable across versions:
`tests/test_python_api.py` imports exactly the documented ones. They are imported when first
used, so `import fedsilo` (and every `fedsilo` command) does not pay for torch up front.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__version__ = "0.2.0"  # SemVer; the wire protocol has its own (wire/messages.py)

# name -> the module that defines it
_API = {
    "Policy": "fedsilo.policies.schema",
    "PolicyError": "fedsilo.policies.loading",
    "load_policy": "fedsilo.policies.loading",
    "parse_policy": "fedsilo.policies.loading",
    "simulate": "fedsilo.ops.simulate",
    "load_silos": "fedsilo.ops.simulate",
    "SimulationResult": "fedsilo.ops.simulate",
    "write_results": "fedsilo.ops.report",
    "load_final_model": "fedsilo.models.card",
    "SiloDataset": "fedsilo.silo.data",
    "DataError": "fedsilo.silo.data",
    "PluginData": "fedsilo.silo.data.plugins",
    "PluginDataset": "fedsilo.silo.data.plugins",
    "TaskPlugin": "fedsilo.silo.data.plugins",
    "TrainingStep": "fedsilo.silo.training_step",
    "StepTools": "fedsilo.silo.training_step",
    "PluginAlgorithm": "fedsilo.policies.algorithms.plugins",
    "Strategy": "fedsilo.coordinator.strategies.base",
    "ServerState": "fedsilo.coordinator.strategies.base",
    "RoundContext": "fedsilo.coordinator.strategies.base",
    "RoundScript": "fedsilo.coordinator.strategies.base",
    "Phase": "fedsilo.coordinator.phases",
    "Task": "fedsilo.coordinator.phases",
    "WeightedMean": "fedsilo.coordinator.phases",
    "PhaseOutcome": "fedsilo.coordinator.phases",
    "SiloContract": "fedsilo.policies.algorithms.contract",
    "averaging_contract": "fedsilo.policies.algorithms.contract",
    "MODEL": "fedsilo.wire.tasks.tensor_names",
    "check_silo_contract": "fedsilo.ops.contract_testing",
    "ContractViolation": "fedsilo.ops.contract_testing",
}
__all__ = ["__version__", *_API]


def __getattr__(name: str) -> Any:
    if name not in _API:
        raise AttributeError(f"module 'fedsilo' has no attribute {name!r}")
    value = getattr(import_module(_API[name]), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
