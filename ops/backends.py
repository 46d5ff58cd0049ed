"""The backends `fedsilo simulate` runs silos on, by name, and the error of one that cannot run:
light, so the command line names them without loading the simulation (ops/simulate.py) or Ray
(ops/ray_backend.py)."""

from __future__ import annotations

IN_PROCESS = "inprocess"
RAY = "ray"
BACKENDS = (IN_PROCESS, RAY)


class BackendError(ValueError):
    """The Ray backend cannot run: Ray missing, a cluster unreachable, no room for one silo."""
