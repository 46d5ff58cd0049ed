"""The policy's `mixing:` section: the parameters of the loss-driven mixing schedules, the
algorithms that change how much each silo counts from the losses the silos report (DRFA and
DRFLM, AFL, AgnosticFedAvg, q-FedAvg, TERM, PropFair, AAggFF), and ApproxFedAvg, which weights
domains inside each silo's own training instead. Every field belongs to some of them; a field set
for an algorithm that does not read it is refused with the algorithms that do.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedsilo.policies.base import PolicyModel

RESPONSE_TRANSFORMS = ("weibull", "exponential", "frechet", "normal", "gumbel", "logistic")


class MixingConfig(PolicyModel):
    """Defaults follow the spec (robust-and-daisy-chain.md §3-6, thesis-methods.md §2.10).

    - `step`: DRFA/DRFLM and AFL's lambda ascent step gamma, AgnosticFedAvg's EG step.
    - `step_decay`: DRFA's step multiplied by this every round (R-FedTorch: 0.9); None: constant
      (the `fedtorch` variant: 0.9).
    - `variant`: DRFA/DRFLM as the paper (`paper`: silos drawn from lambda with replacement,
      a uniform mean with multiplicities) or as the R-FedTorch reference code (`fedtorch`,
      spec §4.6: silos drawn uniformly without replacement, the update importance weighted by
      lambda_k K / |C|, the checkpoint before step k' ~ U{1..tau-1}).
    - `floor`: lambda's floor after each update, then renormalised (DRFA, AFL).
    - `init`: lambda's start, `counts` (proportional to the released sample counts) or `uniform`.
    - `loss_cap`: losses are clipped to [0, loss_cap] before they move lambda; None: 10 times
      the median loss of the first round (spec §1.5).
    - `silos_per_round`: DRFA's M, the draws from lambda (with replacement) and the size of the
      uniform loss probe; None: every silo.
    - `uniform_mix`: DRFA draws from (1 - e) lambda + e/K, so a collapsed lambda still samples
      everyone now and then (spec §4.8's mitigation, 0.1; 0 is the paper).
    - `min_contributors`: DRFA never averages fewer distinct silos (redraws, then skips the
      round): a "mean" of one silo is that silo's model (spec §1.3).
    - `mixup_alpha`, `probe`: DRFLM's Beta(alpha, alpha) local mixup and whether the lambda
      probe's loss is on mixed (`mixup`) or `clean` data.
    - `mixup_on`: DRFLM mixes the `inputs`, or the `embedding` g(x) that the model's last layer
      reads (spec §5.2; the head sees the mixed embedding, gradients reach g through both rows).
    - `count_window`: AgnosticFedAvg's r, the rounds of released counts averaged into N-bar.
    - `domains`: AgnosticFedAvg's domains: each `silo` is one, or the values of the silos'
      `data.domain` column (`data`: lambda over those, every silo reports per-domain losses).
    - `temperature`, `domain_reduction`: ApproxFedAvg's mu and whether a batch's domain loss is
      the `sum` of its rows' losses (the survey's form; divided by the batch size) or their `mean`.
    - `q`, `tilt`, `baseline`: q-FedAvg's q, TERM's tilt t, PropFair's M.
    - `transform`: AAggFF's response CDF.
    """

    step: float = Field(default=0.1, gt=0)
    step_decay: float | None = Field(default=None, gt=0, le=1)
    floor: float = Field(default=1e-3, ge=0, lt=1)
    init: Literal["counts", "uniform"] = "counts"
    loss_cap: float | None = Field(default=None, gt=0)
    silos_per_round: int | None = Field(default=None, ge=1)
    uniform_mix: float = Field(default=0.1, ge=0, le=1)
    min_contributors: int = Field(default=2, ge=1)
    mixup_alpha: float = Field(default=1.0, gt=0)
    probe: Literal["mixup", "clean"] = "mixup"
    variant: Literal["paper", "fedtorch"] = "paper"
    mixup_on: Literal["inputs", "embedding"] = "inputs"
    count_window: int = Field(default=5, ge=1)
    domains: Literal["silo", "data"] = "silo"
    temperature: float = Field(default=1.0, gt=0)
    domain_reduction: Literal["sum", "mean"] = "sum"
    q: float = Field(default=1.0, ge=0)
    tilt: float = Field(default=1.0)
    baseline: float = Field(default=3.0, gt=0)
    transform: Literal[RESPONSE_TRANSFORMS] = "normal"  # type: ignore[valid-type]


# which algorithm reads which field (a field set for another is a mistake worth naming)
READERS: dict[str, frozenset[str]] = {
    "step": frozenset({"drfa", "drflm", "afl", "agnostic_fedavg"}),
    "step_decay": frozenset({"drfa", "drflm"}),
    "floor": frozenset({"drfa", "drflm", "afl"}),
    "init": frozenset({"drfa", "drflm", "afl", "agnostic_fedavg"}),
    "loss_cap": frozenset({"drfa", "drflm", "afl", "agnostic_fedavg"}),
    "silos_per_round": frozenset({"drfa", "drflm"}),
    "uniform_mix": frozenset({"drfa", "drflm"}),
    "min_contributors": frozenset({"drfa", "drflm"}),
    "mixup_alpha": frozenset({"drflm"}),
    "probe": frozenset({"drflm"}),
    "variant": frozenset({"drfa", "drflm"}),
    "mixup_on": frozenset({"drflm"}),
    "count_window": frozenset({"agnostic_fedavg"}),
    "domains": frozenset({"agnostic_fedavg"}),
    "temperature": frozenset({"approx_fedavg"}),
    "domain_reduction": frozenset({"approx_fedavg"}),
    "q": frozenset({"qfedavg"}),
    "tilt": frozenset({"term"}),
    "baseline": frozenset({"propfair"}),
    "transform": frozenset({"aaggff"}),
}
