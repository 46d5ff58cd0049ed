"""A job's id: one attempt at running a signed policy in a consortium, named by the policy's
`name`, a short digest of the signed policy and, from the second attempt on, the attempt
(e.g. `heart-fedavg-3f9a1c2e`, then `heart-fedavg-3f9a1c2e-attempt2`).

The coordinator and every silo derive it the same way from the policy they both verified (and
the attempt, which the operator signs: `job submit --retry`), so task ids, ledger records,
state rows, metric labels and results of different jobs of one consortium, or of two attempts
at one policy, never meet.
"""

from __future__ import annotations

DIGEST_CHARS = 8


def job_id(policy_name: str, policy_digest: str, attempt: int = 1) -> str:
    """The id of attempt `attempt` at the job that runs the policy called `policy_name` whose
    signed bytes have `policy_digest` (hex)."""
    if attempt < 1:
        raise ValueError(f"attempt {attempt}: attempts count from 1")
    first = f"{policy_name}-{policy_digest[:DIGEST_CHARS]}"
    return first if attempt == 1 else f"{first}-attempt{attempt}"
