"""The removed `mixing:` section, whose settings are now the algorithms' own (under
`algorithm:`, same names): the message an old policy gets, naming where each of its keys
moved, and the schedule settings a comparison variant keeps (`Policy.with_algorithm`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedsilo.policies.algorithms.base import readers_of

SCHEDULE_SETTINGS = frozenset(
    {
        *("step", "step_decay", "floor", "init", "loss_cap", "silos_per_round", "uniform_mix"),
        *("min_contributors", "mixup_alpha", "probe", "variant", "mixup_on", "count_window"),
        *("domains", "temperature", "domain_reduction", "q", "tilt", "baseline", "transform"),
    }
)


def moved_message(section: Any, algorithm: Any) -> str:
    """Why a policy with a `mixing:` section is refused: where each of its keys went, and which
    algorithms read a key that the policy's algorithm (`algorithm`, its section) does not."""
    name = algorithm.get("name") if isinstance(algorithm, Mapping) else None
    keys = [str(key) for key in section] if isinstance(section, Mapping) else []
    moves = [_moved(key, name) for key in keys]
    return "mixing: the section is gone, its settings are the algorithm's own now" + (
        ": " + "; ".join(moves) if moves else ""
    )


def _moved(key: str, name: Any) -> str:
    if key not in SCHEDULE_SETTINGS:
        return f"mixing.{key} is no setting of any algorithm"
    readers = readers_of(key)
    moved = f"mixing.{key} moved to algorithm.{key}"
    if name in readers:
        return moved
    return f"{moved} (read by {', '.join(readers)}" + (f", not {name})" if name else ")")
