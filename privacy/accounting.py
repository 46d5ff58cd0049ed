"""Privacy accounting: `Mechanism`, what one release of a silo's data is, and `epsilon`, what
all the releases of one deployment cost together, composed with Opacus' accountants.

Every noised release is a (sub)sampled Gaussian mechanism, the one thing Opacus' accountants
compose: a noise multiplier (noise std / L2 sensitivity), a sample rate and a number of steps.

- `dp_sgd`: a DP-SGD training run (Opacus): noise multiplier, sample rate, steps, clip norm.
- `gaussian`: one Gaussian-noised vector or scalar with L2 sensitivity (its clip) and noise
  std; noise multiplier std/sensitivity, one step. Its sample rate is 1 for a noisy report,
  and below 1 for client-level DP in a round that samples silos.
- `none`: a release without noise. It is booked like any other, but it has no DP guarantee:
  a composition that contains one has epsilon `inf`, whatever else it holds. (The ledger books
  a deployment whose policy asks for no DP without any epsilon at all; see `ledger.py`.)
- `public`: a release that does not depend on the silo's data (a model built from the run's
  seed, an acknowledgement, an error): booked for its digest, it costs nothing.

`total` adds up what separate jobs spent (basic sequential composition: their epsilons add,
as do their deltas), which is what a site's cap over all its jobs holds.

`epsilon` is deterministic: the same releases, delta and accountant give the same float on the
same machine, which is what lets an audit recompute a booked value exactly.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any, Literal, get_args

import numpy as np

Accountant = Literal["rdp", "prv"]
Kind = Literal["dp_sgd", "gaussian", "none", "public"]
ACCOUNTANTS: tuple[str, ...] = get_args(Accountant)
KINDS: tuple[str, ...] = get_args(Kind)
PARAMETERS: dict[str, tuple[str, ...]] = {
    "dp_sgd": ("noise_multiplier", "sample_rate", "steps", "max_grad_norm"),
    "gaussian": ("sensitivity", "noise_std", "sample_rate"),
    "none": (),
    "public": (),
}

# One entry of an Opacus accountant's history: (noise multiplier, sample rate, steps).
HistoryEntry = tuple[float, float, int]


class AccountingError(ValueError):
    """A mechanism, delta or accountant that cannot be accounted; the message says which."""


@dataclass(frozen=True)
class Mechanism:
    """One release of a silo's data; build it with `dp_sgd`, `gaussian` or `none`.

    Only the parameters of its kind are set; the others stay None."""

    kind: Kind
    noise_multiplier: float | None = None
    sample_rate: float | None = None
    steps: int | None = None
    max_grad_norm: float | None = None
    sensitivity: float | None = None
    noise_std: float | None = None

    @classmethod
    def dp_sgd(
        cls, *, noise_multiplier: float, sample_rate: float, steps: int, max_grad_norm: float
    ) -> Mechanism:
        """A DP-SGD run: `steps` noisy steps, each on a Poisson sample at `sample_rate`."""
        return cls(
            "dp_sgd",
            noise_multiplier=noise_multiplier,
            sample_rate=sample_rate,
            steps=steps,
            max_grad_norm=max_grad_norm,
        )

    @classmethod
    def gaussian(
        cls, *, sensitivity: float, noise_std: float, sample_rate: float = 1.0
    ) -> Mechanism:
        """One release of a value with L2 `sensitivity` plus N(0, noise_std^2) noise."""
        return cls(
            "gaussian", sensitivity=sensitivity, noise_std=noise_std, sample_rate=sample_rate
        )

    @classmethod
    def none(cls) -> Mechanism:
        """A release without noise: booked, but with no DP guarantee."""
        return cls("none")

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise AccountingError(f"unknown mechanism kind {self.kind!r}; known: {list(KINDS)}")
        wanted = PARAMETERS[self.kind]
        for name in _PARAMETER_NAMES:
            value = getattr(self, name)
            if name not in wanted:
                if value is not None:
                    raise AccountingError(f"a {self.kind} mechanism has no parameter {name}")
            elif name == "steps":
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise AccountingError(
                        f"{self.kind}: steps must be an integer >= 1, not {value!r}"
                    )
            else:
                object.__setattr__(self, name, _checked_float(self.kind, name, value))

    @classmethod
    def public(cls) -> Mechanism:
        """A release that does not depend on the silo's data: booked, free."""
        return cls("public")

    @property
    def is_private(self) -> bool:
        """Whether the release has a DP guarantee (every kind but `none`)."""
        return self.kind != "none"

    def history_entry(self) -> HistoryEntry:
        """(noise multiplier, sample rate, steps) as Opacus' accountants compose it."""
        if self.kind == "dp_sgd":
            return (self.noise_multiplier, self.sample_rate, self.steps)
        if self.kind == "gaussian":
            return (self.noise_std / self.sensitivity, self.sample_rate, 1)
        raise AccountingError(f"a {self.kind} release has no (noise, sample rate, steps) entry")

    def to_json(self) -> dict[str, Any]:
        """{"kind": ..., and the parameters of that kind, in a fixed order}."""
        return {"kind": self.kind, **{name: getattr(self, name) for name in PARAMETERS[self.kind]}}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Mechanism:
        """The inverse of `to_json`; a missing, unknown or invalid parameter is an error."""
        if not isinstance(data, Mapping) or data.get("kind") not in KINDS:
            raise AccountingError(f"not a mechanism (kind one of {list(KINDS)}): {data!r}")
        kind = data["kind"]
        given = set(data) - {"kind"}
        if given != set(PARAMETERS[kind]):
            raise AccountingError(
                f"a {kind} mechanism has exactly the parameters {list(PARAMETERS[kind])}, "
                f"not {sorted(given)}"
            )
        return cls(kind, **{name: data[name] for name in given})


_PARAMETER_NAMES = tuple(f.name for f in fields(Mechanism) if f.name != "kind")


def epsilon(mechanisms: Iterable[Mechanism], delta: float, accountant: Accountant = "rdp") -> float:
    """The epsilon at `delta` of all `mechanisms` composed (0.0 for none, `inf` if any release
    was not noised), by Opacus' RDP or PRV accountant.

    Releases with the same noise multiplier and sample rate are composed as one history entry
    with their steps added (composition does not depend on order), so a long deployment costs
    one entry per distinct setting; entries keep the order of first appearance."""
    check_accounting(delta, accountant)
    mechanisms = list(mechanisms)
    for mechanism in mechanisms:
        if not isinstance(mechanism, Mechanism):
            raise AccountingError(f"not a Mechanism: {mechanism!r}")
    if not all(m.is_private for m in mechanisms):
        return math.inf
    return _compose(_history(mechanisms), delta, accountant)


def would_reach(
    booked: Sequence[Mechanism],
    extra: Sequence[Mechanism],
    delta: float,
    accountant: Accountant = "rdp",
) -> float:
    """The epsilon a deployment that has booked `booked` would reach after also releasing
    `extra`: what a silo compares with its cap before it runs a task."""
    return epsilon([*booked, *extra], delta, accountant)


def total(job_epsilons: Iterable[float | None]) -> float:
    """The epsilon of several jobs together: their sum (None, a job without DP, adds 0)."""
    spent = [e for e in job_epsilons if e is not None]
    return math.inf if math.inf in spent else math.fsum(spent)


def check_accounting(delta: float, accountant: str) -> None:
    """Raise `AccountingError` unless 0 < delta < 1 and `accountant` is one we know."""
    if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not 0 < delta < 1:
        raise AccountingError(f"delta must be a number in (0, 1), not {delta!r}")
    if accountant not in ACCOUNTANTS:
        raise AccountingError(f"unknown accountant {accountant!r}; known: {list(ACCOUNTANTS)}")


def _history(mechanisms: Sequence[Mechanism]) -> list[HistoryEntry]:
    steps: dict[tuple[float, float], int] = {}
    for mechanism in mechanisms:
        if mechanism.kind == "public":
            continue
        noise_multiplier, sample_rate, count = mechanism.history_entry()
        key = (noise_multiplier, sample_rate)
        steps[key] = steps.get(key, 0) + count
    return [(noise, rate, count) for (noise, rate), count in steps.items()]


OPTIMAL_ORDER_WARNING = r"Optimal order is the (smallest|largest) alpha"


def _compose(history: list[HistoryEntry], delta: float, accountant: Accountant) -> float:
    if not history:
        return 0.0
    # Imported on first use: opacus brings torch, and a process that never accounts (the
    # `fedsilo` CLI, a silo without DP) should not wait for it.
    from opacus.accountants import PRVAccountant, RDPAccountant

    composer = RDPAccountant() if accountant == "rdp" else PRVAccountant()
    composer.history = history
    # PRV's Gaussian at sample rate 1 takes log(1 - q) = log(0) on purpose; numpy warns.
    with np.errstate(divide="ignore", invalid="ignore"), quiet_optimal_order():
        return float(composer.get_epsilon(delta))


@contextmanager
def quiet_optimal_order() -> Iterator[None]:
    """Silence exactly Opacus' UserWarning that the optimal RDP order is the smallest or
    largest alpha it tries: the epsilon it returns is still a valid upper bound (only a looser
    one, for noise far from the usual), and the warning would fill a silo's log on every
    task. Every other warning passes."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore",
            message=OPTIMAL_ORDER_WARNING,
            category=UserWarning,
            module=r"opacus\.accountants\.analysis\.rdp",
        )
        yield


def _checked_float(kind: str, name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise AccountingError(f"{kind}: {name} must be a number, not {value!r}")
    value = float(value)
    upper = 1.0 if name == "sample_rate" else math.inf
    if not (0 < value <= upper and math.isfinite(value)):
        bounds = "in (0, 1]" if name == "sample_rate" else "positive and finite"
        raise AccountingError(f"{kind}: {name} must be {bounds}, not {value!r}")
    return value
