"""A phase's robust combination in the clear (`WeightedMean.robust`, `algorithm.robust`): each
accepted reply's tensors less the reference its task sent, one float64 row per silo in sorted
silo order, combined by the rule (coordinator/robust_aggregation.py) and added back to the
reference, so the bits do not depend on the order the replies arrive in.

Unlike the running mean (coordinator/running_mean.py) a rule needs every update at once (a
median, Krum's distances): the coordinator holds n rows of the summed tensors' size in
float64, n the answering silos.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from fedsilo.coordinator.phases import Task, WeightedMean
from fedsilo.coordinator.replies import Accepted, raw_weights
from fedsilo.coordinator.robust_aggregation import robust_update


def robust_mean(
    aggregate: WeightedMean, tasks: Sequence[Task], results: Mapping[str, Accepted]
) -> tuple[dict[str, torch.Tensor], float]:
    """The robust combination of `results` (the accepted replies to `tasks`) by
    `aggregate.robust`, and the total weight of the silos it combined (those of positive
    weight); an empty combination when there are none."""
    assert aggregate.robust is not None
    weights = raw_weights(aggregate.weights, results)
    silos = [silo for silo in sorted(results) if weights[silo] > 0]
    total = math.fsum(weights[silo] for silo in silos)
    if not silos:
        return {}, total
    sent = {task.silo: task for task in tasks}
    names = aggregate.tensors
    references = {name: reference(aggregate, sent, silos, name) for name in names}
    rows = np.stack(
        [
            np.concatenate(
                [_flat(results[silo].lazy[name].load()) - references[name] for name in names]
            )
            for silo in silos
        ]
    )
    update = robust_update(aggregate.robust, rows, np.array([weights[silo] for silo in silos]))
    combined, offset = {}, 0
    for name in names:
        first, size = results[silos[0]].lazy[name], references[name].size
        moved = references[name] + update[offset : offset + size]
        combined[name] = torch.from_numpy(moved).to(first.dtype).view(first.shape)
        offset += size
    return combined, total


def reference(
    aggregate: WeightedMean, sent: Mapping[str, Task], silos: Sequence[str], name: str
) -> np.ndarray:
    """Tensor `name`'s reference, flat in float64: the tensor of that name the silos' tasks sent
    (else the aggregate's `references`), one for every silo combined, since a rule moves one
    model."""
    given = (aggregate.references or {}).get(name)
    found = [sent[silo].tensors.get(name, given) for silo in silos]
    first = found[0]
    if first is None or any(t is None or not torch.equal(t, first) for t in found[1:]):
        raise ValueError(f"a robust rule needs one reference {name!r} for every silo it combines")
    return _flat(first)


def _flat(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().reshape(-1).to(torch.float64).numpy()
