"""Server-side strategies, one file per family, looked up by the policy's `algorithm.name`."""

from __future__ import annotations

from fedsilo.coordinator.strategies.base import Strategy
from fedsilo.coordinator.strategies.cyclic import Cyclic
from fedsilo.coordinator.strategies.drfa import Drfa, Drflm
from fedsilo.coordinator.strategies.fedavg import ApproxFedAvg, FedAvg, FedProx
from fedsilo.coordinator.strategies.feddc import FedDC
from fedsilo.coordinator.strategies.feddro import FedDro
from fedsilo.coordinator.strategies.fedevg import FedEvg
from fedsilo.coordinator.strategies.fedopt import FedAdagrad, FedAdam, FedYogi
from fedsilo.coordinator.strategies.loss_weighted import (
    AAggFF,
    Afl,
    AgnosticFedAvg,
    PropFair,
    QFedAvg,
    Term,
)
from fedsilo.coordinator.strategies.multiboost import MultiBoost
from fedsilo.coordinator.strategies.references import Central, Local
from fedsilo.coordinator.strategies.scaffold import Scaffold
from fedsilo.coordinator.strategies.superfed import SuperFed
from fedsilo.policies.algorithms.plugins import PluginAlgorithm, PluginAlgorithmError
from fedsilo.policies.schema import Policy

STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls
    for cls in (
        *(FedAvg, FedProx, FedAdam, FedYogi, FedAdagrad, Central, Local, FedDC, SuperFed, FedEvg),
        *(Drfa, Drflm, Afl, AgnosticFedAvg, QFedAvg, Term, PropFair, AAggFF, ApproxFedAvg),
        *(Scaffold, Cyclic, MultiBoost),
        *(FedDro,),
    )
}


def make_strategy(policy: Policy) -> Strategy:
    """The strategy of the policy's algorithm: a built-in one, or the one its strategy plug-in
    names (which must be a `Strategy` of that name)."""
    algorithm = policy.algorithm
    if not isinstance(algorithm, PluginAlgorithm):
        return STRATEGIES[algorithm.name](policy)
    cls = algorithm.strategy_class()
    if not (isinstance(cls, type) and issubclass(cls, Strategy)) or cls.name != algorithm.name:
        raise PluginAlgorithmError(
            f"strategy plug-in {algorithm.name!r}: {algorithm.strategy} is not a "
            f"fedsilo.Strategy whose name is {algorithm.name!r}"
        )
    return cls(policy)
