"""A diagnostic of `bench.secagg`: the same run with parts of pairwise masking's work made free,
to show how much of a masked round each part is. Not a measurement of fedsilo (what it runs is
not secure): it bounds what removing that work could win.

`--free streams`: no mask streams (a silo's masks are zeros and the coordinator removes none, so
the sum is still right); `--free signatures`: Ed25519 checks pass without checking (advertisements
and confirmations); `--free streams,signatures`: both. Every other argument goes to
`bench.secagg` (e.g. `--sizes 1e6 --silos 10 --methods masking,sparse --rounds 40`; with
`--out NAME` the result file records the run, its `settings` do not say what was free: name it).
"""

from __future__ import annotations

import argparse
import runpy
import sys

import numpy as np
from nacl.signing import VerifyKey

from fedsilo.privacy import masking
from fedsilo.silo.tasks import secure_sum

PARTS = ("streams", "signatures")


def zero_masks(length: int, *_: object) -> np.ndarray:
    return np.zeros(length, dtype=np.uint32)


def free(parts: set[str]) -> None:
    """Replace the named parts' functions in this process."""
    if "streams" in parts:
        masking.KeyStreams.add_to = lambda self, part: None  # type: ignore[method-assign]
        secure_sum.mask_streams = zero_masks  # type: ignore[assignment]
    if "signatures" in parts:
        VerifyKey.verify = lambda self, smessage, signature=None, encoder=None: smessage  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--free", required=True, help=f"comma-separated, of {', '.join(PARTS)}")
    args, rest = parser.parse_known_args()
    parts = set(args.free.split(","))
    unknown = sorted(parts - set(PARTS))
    if unknown:
        parser.error(f"--free: unknown part(s) {unknown}; choose from {', '.join(PARTS)}")
    free(parts)
    sys.argv = ["bench.secagg", *rest]
    runpy.run_module("bench.secagg", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
