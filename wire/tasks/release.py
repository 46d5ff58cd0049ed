"""What an answer of each task kind sends, declared once per kind on its config class
(`TaskConfig.SENDS`): the silo's release gate (silo/release_gate.py) reads it to decide whether
a kind may run under the silo's policy, and `TaskResult` (wire/messages.py) to decide what an
answer of the kind may hold, on the silo that builds it and on the coordinator that decodes it.

An answer of a kind whose model or update leaves masked, encrypted or sealed (`tensors_only`)
holds tensors and nothing beside them: no metric (a training loss beside a masked input is the
loss of a model the coordinator chose, on the silo's rows), no parameter spec, and no sample
count except at the protocol steps that release the training count a secure sum's weights
need, as a `train` task releases it (`TaskConfig.RELEASES_COUNT`: the advertise step, keys
folded into an unmask answer, a CKKS join).
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import Any


class Release(Enum):
    """What a task kind sends, as far as secure aggregation is concerned."""

    NOTHING_PRIVATE = "no model, update or sum input (public values, metrics, acknowledgements)"
    IN_THE_CLEAR = "a model, update or sum input in the clear"
    MASKED = "pairwise-masked protocol messages"
    ENCRYPTED = "CKKS protocol messages"
    SEALED_HANDOFF = "a model sealed to another member, or sent in the clear when told to"
    DATA = "point clouds built from the silo's records, which only the policy's opt-in allows"

    @property
    def tensors_only(self) -> bool:
        """Whether an answer of such a kind holds tensors only (a secure sum's protocol steps,
        a hand-off)."""
        return self in (Release.MASKED, Release.ENCRYPTED, Release.SEALED_HANDOFF)


def answer_problem(
    kind: str,
    sends: Release,
    releases_count: bool,
    num_samples: int,
    metrics: Mapping[str, float],
    spec: Any,
) -> str | None:
    """Why an answer of `kind` (which `sends`, and releases the training count when
    `releases_count`) may not carry `num_samples`, `metrics` and `spec`; None when it may."""
    if not sends.tensors_only:
        return None
    carried = sorted(metrics)
    if num_samples and not releases_count:
        carried.append("num_samples")
    if spec is not None:
        carried.append("spec")
    if not carried:
        return None
    return (
        f"a {kind} answer holds tensors only ({sends.value}), and this one carries "
        f"{', '.join(carried)} beside them"
    )
