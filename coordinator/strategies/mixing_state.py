"""What a mixing schedule (the loss-weighted schedules, DRFA and DRFLM) keeps between rounds,
typed: `MixingState`, stored in `ServerState.extra[MIXING]` as JSON (`to_json`) so that a
restarted coordinator resumes it exactly (`from_json`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class MixingState:
    """`silos`: the deployment's silos, fixed at the first round, in the order of every vector
    over silos. The rest is absent (None) until the schedule first sets it:

    - `lam`: lambda, over `silos` (or over `domains` when the schedule weighs domains);
    - `loss_cap`: the bound the losses are clipped to, fixed at the first probe;
    - `counts`: the sample counts of the last `count_window` rounds (AgnosticFedAvg);
    - `domains`, `omega`: the data's domains seen at the first probe and the weight each
      domain's rows train with (AgnosticFedAvg over the data's domains);
    - `aaggff`: AAggFF's optimiser state (`AAggFFSState` or `AAggFFDState` as JSON);
    - `weights`: each silo's coefficient in the last round's mean (what the round record and
      `fedsilo_mixing_weight` show).
    """

    silos: tuple[str, ...]
    lam: tuple[float, ...] | None = None
    loss_cap: float | None = None
    counts: tuple[tuple[float, ...], ...] | None = None
    domains: tuple[str, ...] | None = None
    omega: Mapping[str, float] | None = None
    aaggff: Mapping[str, Any] | None = None
    weights: Mapping[str, float] | None = None

    @classmethod
    def of(cls, extra: Mapping[str, Any], key: str, silos: tuple[str, ...]) -> MixingState:
        """The state kept in `extra[key]`, or a fresh one over the sorted `silos`."""
        return cls.from_json(extra[key]) if key in extra else cls(tuple(sorted(silos)))

    def to_json(self) -> dict[str, Any]:
        """Every field that is set, vectors as lists."""
        encoded: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if f.name == "counts":
                value = [list(row) for row in value]
            elif isinstance(value, tuple):
                value = list(value)
            elif isinstance(value, Mapping):
                value = dict(value)
            encoded[f.name] = value
        return encoded

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> MixingState:
        """The inverse of `to_json`; a key it does not know is refused."""
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"a mixing state has no {unknown}")
        return cls(
            silos=tuple(data["silos"]),
            lam=_tuple(data.get("lam")),
            loss_cap=data.get("loss_cap"),
            counts=None if "counts" not in data else tuple(tuple(row) for row in data["counts"]),
            domains=_tuple(data.get("domains")),
            omega=_dict(data.get("omega")),
            aaggff=_dict(data.get("aaggff")),
            weights=_dict(data.get("weights")),
        )


def _tuple(values: Any) -> tuple[Any, ...] | None:
    return None if values is None else tuple(values)


def _dict(values: Any) -> dict[str, Any] | None:
    return None if values is None else dict(values)
