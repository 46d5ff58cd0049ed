"""The policy's `mixing:` section: the parameters of the loss-driven mixing schedules, the
algorithms that change how much each silo counts from the losses the silos report (DRFA and
DRFLM, AFL, AgnosticFedAvg, q-FedAvg, TERM, PropFair, AAggFF). Every field belongs to some of
them; a field set for an algorithm that does not read it is refused with the algorithms that do.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedsilo.policies.base import PolicyModel

RESPONSE_TRANSFORMS = ("weibull", "exponential", "frechet", "normal", "gumbel", "logistic")


class MixingConfig(PolicyModel):
    """Defaults follow the spec (robust-and-daisy-chain.md §3-6, thesis-methods.md §2.10).

    - `step`: DRFA/DRFLM and AFL's lambda ascent step gamma, AgnosticFedAvg's EG step.
    - `step_decay`: DRFA's step multiplied by this every round (R-FedTorch: 0.9); None: constant.
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
    - `count_window`: AgnosticFedAvg's r, the rounds of released counts averaged into N-bar.
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
    count_window: int = Field(default=5, ge=1)
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
    "count_window": frozenset({"agnostic_fedavg"}),
    "q": frozenset({"qfedavg"}),
    "tilt": frozenset({"term"}),
    "baseline": frozenset({"propfair"}),
    "transform": frozenset({"aaggff"}),
}
MIXING_ALGORITHMS = frozenset().union(*READERS.values())
