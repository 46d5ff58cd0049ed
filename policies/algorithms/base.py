"""What every algorithm's config declares: its capabilities, which the policy's checks hold it
to (so `policies/schema.py` never names an algorithm), and `check(policy)` for the rules only
the algorithm knows. A setting that another algorithm reads is refused with the algorithms that
read it."""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import model_validator

from fedsilo.policies.base import PolicyModel

if TYPE_CHECKING:
    from fedsilo.policies.algorithms.contract import Position, SiloContract, SiloFacts
    from fedsilo.policies.schema import Policy

# Every algorithm evaluates on the silos' held-out data, and weights silos by sample counts.
SAMPLE_WEIGHTED: frozenset[str] = frozenset({"counts", "metrics"})


class AlgorithmBase(PolicyModel):
    """An algorithm's settings (`name` picks it) and its capabilities."""

    reports: ClassVar[frozenset[str]] = SAMPLE_WEIGHTED  # report kinds it cannot run without
    averages: ClassVar[bool] = True  # every aggregate is a mean: secure aggregation applies
    clips_updates: ClassVar[bool] = False  # a mean of clipped updates: client-level DP applies
    # its silos' trained models go, alone, to a weighted mean of `train` answers the coordinator
    # decodes: `compression:` (quantized updates) applies
    compresses_updates: ClassVar[bool] = False
    hands_off: ClassVar[bool] = False  # hands single silos' models on to other silos
    needs_fixed_steps: ClassVar[bool] = False  # local work is `training.steps`, never epochs
    # why DP-SGD's per-row clipping would not bound a record's influence (None: it does)
    dp_sgd_problem: ClassVar[str | None] = None
    releases_data: ClassVar[bool] = False  # sends data-like releases (point clouds of records)
    # why its silos cannot derive each round's model themselves under masking (None: they can,
    # `secure_aggregation.lineage`): a round that is not FedAvg's train-and-average
    lineage_gap: ClassVar[str | None] = (
        "its round is not FedAvg's (one masked mean of the models, then a server step the "
        "silos can repeat)"
    )
    name: str

    @property
    def needs_domains(self) -> bool:
        """Whether its silos train or probe per domain of their data's `domain` column."""
        return False

    @property
    def title(self) -> str:
        """The algorithm as messages name it (with the setting that decides a capability)."""
        return self.name

    def local_parameters(self) -> tuple[str, ...]:
        """Shell-style patterns (fnmatch) of the model's parameter names each silo keeps to
        itself (FedBN's normalisation layers): a silo trains and evaluates with its own values of
        those, and sends back the values it received in their place (silo/local_parameters.py);
        none here."""
        return ()

    def check(self, policy: Policy) -> None:
        """Refuse (ValueError) what this algorithm cannot run with in `policy`."""

    def silo_contract(self, policy: Policy) -> SiloContract:
        """What a silo under `policy` answers, and nothing else (policies/algorithms/contract.py):
        every algorithm declares its own; one that does not cannot run."""
        raise NotImplementedError(f"{self.name} declares no silo contract")

    def train_options(self, policy: Policy, position: Position) -> dict[str, Any]:
        """The options of its `train` tasks that it derives from the policy (none here)."""
        return {}

    def chosen_train_options(self, policy: Policy) -> dict[str, Callable[[Any, SiloFacts], Any]]:
        """The options of its `train` tasks a coordinator chooses, each with the check a silo
        holds it to (none here)."""
        return {}

    def consortium_problem(self, policy: Policy, silos: int) -> str | None:
        """Why this algorithm cannot run `policy` over `silos` silos (a simulation's partition
        at check time, a deployment's consortium at the start of the run); None: it can."""
        return None

    def model_problem(self, policy: Policy, silos: int, parameters: int) -> str | None:
        """Why this algorithm cannot aggregate a model of `parameters` parameters over
        `silos` silos, once the data says how large the model is; None: it can."""
        return None

    def task_problem(self, task: str, classes: int | None) -> str | None:
        """Why this algorithm cannot learn a `task` of `classes` classes (None: not a
        classification), once the data says which (`policy validate`, `simulate`; a silo
        refuses the task itself too); None: it can."""
        return None

    @model_validator(mode="before")
    @classmethod
    def _name_who_reads_a_setting(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key in data:
                readers = readers_of(str(key))
                if key not in cls.model_fields and readers:
                    raise ValueError(
                        f"{data.get('name')} does not read '{key}' (read by "
                        f"{', '.join(readers)}); drop it or choose one of those algorithms"
                    )
        return data


def algorithm_classes() -> list[type[AlgorithmBase]]:
    """Every built-in algorithm's config class (those that name their algorithms; a strategy
    plug-in's, loaded or not, is none of them)."""
    found, pending = [], list(AlgorithmBase.__subclasses__())
    while pending:
        cls = pending.pop(0)
        pending.extend(cls.__subclasses__())
        if names_of(cls) and cls.__module__.startswith("fedsilo."):
            found.append(cls)
    return found


def names_of(cls: type[AlgorithmBase]) -> tuple[str, ...]:
    """The algorithm names a config class stands for (its `name` literal)."""
    return typing.get_args(cls.model_fields["name"].annotation)


def readers_of(setting: str) -> list[str]:
    """The algorithms that read `setting`, sorted."""
    return sorted(
        name
        for cls in algorithm_classes()
        if setting in cls.model_fields and setting != "name"
        for name in names_of(cls)
    )


def task_kind(task: str, classes: int | None) -> str:
    """A task as messages name it: "classification task of 3 classes", "regression task"."""
    return f"{task} task" + (f" of {classes} classes" if task == "classification" else "")


def classification_problem(name: str, task: str, classes: int | None) -> str | None:
    """Why `name`, which learns per class, cannot learn `task`; None for a classification."""
    if task == "classification" and (classes or 0) >= 2:
        return None
    kind = task_kind(task, classes)
    return f"algorithm: {name} works per class (classification only); this data is a {kind}"
