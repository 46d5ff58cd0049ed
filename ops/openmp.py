"""OpenMP's wait policy for the `fedsilo` command's processes, set before torch loads.

torch's CPU kernels run on OpenMP threads that, by default, spin for a while at every barrier
instead of sleeping. A coordinator and its silos sharing cores (several silos on one host, the
gRPC threads beside the training thread, `fedsilo demo`, `bench/transport`) then burn their
cores spinning while another process waits for them: measured on 2 cores with a 1e5-parameter
model (bench/transport's workload), a round's median was 0.23-0.64 s with spinning threads and
0.09-0.10 s with sleeping ones for 3 silos, 0.79-1.03 s and 0.25-0.26 s for 10.
PASSIVE makes them sleep; the number of threads and how work is split among them stay the same,
so every result is bit-for-bit the same. OpenMP reads its environment once, when torch's
libraries load: `ops/cli.py` imports this module before anything that imports torch. An
operator's own `OMP_WAIT_POLICY` is kept.
"""

from __future__ import annotations

import os

WAIT_POLICY = "PASSIVE"

os.environ.setdefault("OMP_WAIT_POLICY", WAIT_POLICY)
