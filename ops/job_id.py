"""A job's id: one signed policy run of a consortium, named by the policy's `name` and a short
digest of the signed policy (e.g. `heart-fedavg-3f9a1c2e`).

The coordinator and every silo derive it the same way from the policy they both verified, so
task ids, ledger records, state rows, metric labels and results of different jobs of one
consortium never meet.
"""

from __future__ import annotations

DIGEST_CHARS = 8


def job_id(policy_name: str, policy_digest: str) -> str:
    """The id of the job that runs the policy called `policy_name` whose signed bytes have
    `policy_digest` (hex)."""
    return f"{policy_name}-{policy_digest[:DIGEST_CHARS]}"
