"""The `algorithm:` section: which strategy runs, with all of its own parameters, one typed
config class per algorithm (each in the module named like its strategy in
`coordinator/strategies/`). A new algorithm adds its class to `AlgorithmConfig`."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from fedsilo.policies.algorithms.cyclic import CyclicConfig
from fedsilo.policies.algorithms.drfa import DrfaConfig, DrflmConfig
from fedsilo.policies.algorithms.fedavg import ApproxFedAvgConfig, FedAvgConfig, FedProxConfig
from fedsilo.policies.algorithms.feddc import FedDcConfig
from fedsilo.policies.algorithms.feddro import FedDroConfig
from fedsilo.policies.algorithms.fedevg import FedEvgConfig
from fedsilo.policies.algorithms.fedopt import FedOptConfig
from fedsilo.policies.algorithms.loss_weighted import (
    AAggFFConfig,
    AflConfig,
    AgnosticFedAvgConfig,
    PropFairConfig,
    QFedAvgConfig,
    TermConfig,
)
from fedsilo.policies.algorithms.multiboost import MultiBoostConfig
from fedsilo.policies.algorithms.references import CentralConfig, LocalConfig
from fedsilo.policies.algorithms.scaffold import ScaffoldConfig
from fedsilo.policies.algorithms.superfed import SuperFedConfig

AlgorithmConfig = Annotated[
    FedAvgConfig
    | FedProxConfig
    | FedOptConfig
    | CentralConfig
    | LocalConfig
    | FedDcConfig
    | DrfaConfig
    | DrflmConfig
    | AflConfig
    | AgnosticFedAvgConfig
    | QFedAvgConfig
    | TermConfig
    | PropFairConfig
    | AAggFFConfig
    | ApproxFedAvgConfig
    | SuperFedConfig
    | FedEvgConfig
    | ScaffoldConfig
    | CyclicConfig
    | FedDroConfig
    | MultiBoostConfig,
    Field(discriminator="name"),
]
