"""The `evaluation:` section: what a job evaluates beyond each evaluation round's metrics of its
model on the silos' held-out data (how often those run is `eval_every`)."""

from __future__ import annotations

from fedsilo.policies.base import PolicyModel


class EvaluationConfig(PolicyModel):
    """Cross-site validation: the matrix of every model the coordinator holds on every site's
    test split, once, after the job's final evaluation (coordinator/cross_site.py)."""

    # after the final evaluation, evaluate every model the coordinator holds in the clear (the
    # global model, and each site's model of the last round where it reached the coordinator
    # unmasked) on every site's test split: the cross-site validation matrix, which shows a
    # broken site; each evaluation is booked like any other (false by default)
    cross_site: bool = False
