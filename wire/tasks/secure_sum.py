"""The steps of pairwise-masked secure aggregation (Bonawitz et al. 2017), as the coordinator
asks them of each silo: advertise keys, share secrets, send the masked input of a wrapped task,
confirm the survivors, unmask."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from fedsilo.wire.tasks.codec import JsonFields, TaskConfig, inner, optional
from fedsilo.wire.tasks.release import Release


@dataclass(frozen=True, kw_only=True)
class SecAggAdvertise(TaskConfig):
    """`secagg_advertise`: fresh key pairs, their public halves signed (ADVERTISEMENT)."""

    KIND: ClassVar[str] = "secagg_advertise"
    SENDS: ClassVar[Release] = Release.MASKED
    RELEASES_COUNT: ClassVar[bool] = True  # the training count, as `train` releases it


@dataclass(frozen=True, kw_only=True)
class SecAggShare(TaskConfig):
    """`secagg_share`: the advertisements relayed (silo -> hex bytes); shares go back, each
    encrypted to its recipient (SHARE_TO + recipient)."""

    KIND: ClassVar[str] = "secagg_share"
    SENDS: ClassVar[Release] = Release.MASKED
    advertisements: Mapping[str, str]


@dataclass(frozen=True, kw_only=True)
class MaskedInput(TaskConfig):
    """`secagg_mask`: run `inner` and send its `tensors`' update, times the silo's share of
    `weights`, masked; `shares` holds the shares addressed to this silo (sender -> hex)."""

    KIND: ClassVar[str] = "secagg_mask"
    SENDS: ClassVar[Release] = Release.MASKED
    inner: TaskConfig = inner()
    weights: Mapping[str, float]
    shares: Mapping[str, str]
    tensors: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class SecAggConfirm(TaskConfig):
    """`secagg_confirm`: sign the consistency statement over `survivors` (CONFIRMATION)."""

    KIND: ClassVar[str] = "secagg_confirm"
    SENDS: ClassVar[Release] = Release.MASKED
    survivors: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class NextAggregation(JsonFields):
    """The masked aggregation the coordinator expects next, by its round and phase."""

    round: int
    phase: str


@dataclass(frozen=True, kw_only=True)
class SecAggUnmask(TaskConfig):
    """`secagg_unmask`: with the survivors' `signatures` (silo -> hex) over the same
    `survivors`, reveal REVEALED_SEED + survivor and REVEALED_KEY + dropped silo shares; with
    `advertise_next`, also advertise keys for that aggregation (ADVERTISEMENT, the advertise
    step folded into this answer)."""

    KIND: ClassVar[str] = "secagg_unmask"
    SENDS: ClassVar[Release] = Release.MASKED
    RELEASES_COUNT: ClassVar[bool] = True  # with keys folded in: what an advertisement releases
    survivors: tuple[str, ...]
    signatures: Mapping[str, str]
    advertise_next: NextAggregation | None = optional()
