"""What a strategy yields (a `Phase` of `Task`s, optionally with an aggregate it wants) and what
it gets back (a `PhaseOutcome`).

The phase decides what the strategy may see: when it declares `aggregate=WeightedMean(...)`
the outcome carries only the weighted mean of the results' tensors, never one silo's; with
`aggregate=Identical(...)` it carries one copy of tensors every silo must agree on, and each
silo's digest of them; only phases without an aggregate return every silo's tensors.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import torch

from fedsilo.policies.algorithms.robust import RobustRuleBase
from fedsilo.wire.tasks import TaskConfig
from fedsilo.wire.tasks.tensor_names import MODEL
from fedsilo.wire.tensors import ParameterSpec


@dataclass(frozen=True)
class Task:
    """One silo's part of a phase: its task's typed config (whose class names the kind) and
    the tensors it needs."""

    silo: str
    config: TaskConfig
    tensors: Mapping[str, torch.Tensor] = field(default_factory=dict)
    spec: ParameterSpec | None = None

    @property
    def kind(self) -> str:
        return self.config.KIND


@dataclass(frozen=True)
class WeightedMean:
    """Aggregate result tensors as sum_k a_k x_k / sum_k a_k over the silos that answered.

    a_k is the silo's reported sample count, or `weights[silo]` when given (a strategy's
    mixing coefficients); a silo missing from `weights` counts with weight 0.

    Each summed tensor is taken relative to a reference, the tensor of the same name its task
    sends (e.g. the model a silo trains from); `references` supplies it for tasks that send no
    such tensor (e.g. zeros for a gradient). The strategy declares this whatever the policy;
    the engine decides from the policy how the mean is taken (in the clear, masked or under
    CKKS, where each silo sends only its update to the reference) and applies client-level DP
    (coordinator/engine.py).

    `robust`: a robust rule (`algorithm.robust`) the engine combines the updates to the
    reference with instead of the weighted mean, in the clear only (coordinator/robust_mean.py);
    the outcome still carries the combination alone, never one silo's tensors.
    """

    tensors: tuple[str, ...] = (MODEL,)
    weights: Mapping[str, float] | None = None
    # the shape each reply's tensor must have, for tensors that are not the model (whose shape
    # the task's parameter spec fixes); a reply of another shape is that silo's dropout
    shapes: Mapping[str, tuple[int, ...]] | None = None
    references: Mapping[str, torch.Tensor] | None = None
    robust: RobustRuleBase | None = None

    def flattened(self) -> WeightedMean:
        """The same aggregate over flat tensors (what a secure protocol's replies carry)."""
        if not self.shapes:
            return self
        return replace(self, shapes={n: (math.prod(s),) for n, s in self.shapes.items()})


@dataclass(frozen=True)
class Identical:
    """The answering silos must all return the same tensors (e.g. the initial model).

    The outcome's `tensors` hold one copy (the first silo's in sorted order) and `digests`
    every silo's BLAKE2b of its tensors, so the strategy can name a silo that disagrees while
    the coordinator holds one copy, not one per silo.
    """

    tensors: tuple[str, ...] = (MODEL,)


@dataclass(frozen=True)
class Phase:
    name: str
    tasks: tuple[Task, ...]
    aggregate: WeightedMean | Identical | None = None
    # answers needed: an aggregating or routed phase needs at least the policy's min_silos
    # whatever it states; another the stated quorum, else min(min_silos, len(tasks))
    quorum: int | None = None
    # sender -> recipient: each sender's model is handed to its recipient (daisy chaining);
    # sealed to the recipient when the policy says so, and never seen by the strategy
    route: Mapping[str, str] | None = None


@dataclass(frozen=True)
class SiloReport:
    """The scalars one silo reported for a task (these always reach the strategy)."""

    num_samples: int
    metrics: Mapping[str, float]
    compute_seconds: float
    epsilon: float | None = None  # the silo's epsilon for the deployment, as it reports it
    ledger_head: str | None = None  # the silo's ledger head (an audit's anchor)


@dataclass(frozen=True)
class PhaseOutcome:
    phase: str
    reports: Mapping[str, SiloReport]
    dropped: Mapping[str, str]  # silo -> why (deadline, error, malformed)
    mean: Mapping[str, torch.Tensor] = field(default_factory=dict)
    total_weight: float = 0.0
    tensors: Mapping[str, Mapping[str, torch.Tensor]] = field(default_factory=dict)
    spec: ParameterSpec | None = None
    digests: Mapping[str, str] = field(default_factory=dict)  # silo -> hex (Identical only)
    routes: Mapping[str, str] = field(default_factory=dict)  # hand-offs delivered (route only)
    # a masked mean's evidence for model lineage (coordinator/lineage.py; None: none kept)
    evidence: Mapping[str, torch.Tensor] | None = None

    @property
    def answered(self) -> tuple[str, ...]:
        return tuple(self.reports)


class QuorumNotMet(RuntimeError):
    """Fewer silos answered a phase than its quorum; the round is abandoned.

    Carries who answered and who dropped (and why), so the round's record still shows them.
    """

    def __init__(
        self,
        message: str,
        phase: str = "",
        answered: Mapping[str, SiloReport] | None = None,
        dropped: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.phase = phase
        self.answered = dict(answered or {})
        self.dropped = dict(dropped or {})
