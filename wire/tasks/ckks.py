"""The steps of CKKS secure aggregation, as the coordinator asks them of each silo: make the
keys (the key holder), join the context, send the encrypted input of a wrapped task, confirm
the contributors, decrypt the sum."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from fedsilo.wire.tasks.codec import TaskConfig, inner
from fedsilo.wire.tasks.release import Release


@dataclass(frozen=True, kw_only=True)
class CkksKeygen(TaskConfig):
    """`ckks_keygen`: the key holder's PUBLIC_CONTEXT and the secret context sealed to each of
    `recipients` (SEALED_CONTEXT + "/" + silo)."""

    KIND: ClassVar[str] = "ckks_keygen"
    SENDS: ClassVar[Release] = Release.ENCRYPTED
    recipients: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class CkksJoin(TaskConfig):
    """`ckks_join`: open the context `key_holder` sealed (sent as SEALED_CONTEXT unless the
    silo holds it) and check its digest is `context_digest`."""

    KIND: ClassVar[str] = "ckks_join"
    SENDS: ClassVar[Release] = Release.ENCRYPTED
    RELEASES_COUNT: ClassVar[bool] = True  # the training count, as `train` releases it
    key_holder: str
    context_digest: str


@dataclass(frozen=True, kw_only=True)
class EncryptedInput(TaskConfig):
    """`ckks_encrypt`: run `inner` and send its `tensors`' update, times the silo's share of
    `weights`, encrypted (CHUNK + index) and signed (CONTRIBUTION)."""

    KIND: ClassVar[str] = "ckks_encrypt"
    SENDS: ClassVar[Release] = Release.ENCRYPTED
    inner: TaskConfig = inner()
    weights: Mapping[str, float]
    tensors: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class CkksConfirm(TaskConfig):
    """`ckks_confirm`: sign the `contributors` (the silos whose encrypted inputs the sum holds,
    this one among them) with its own input's aggregation, context, weights and task
    (CONFIRMATION): one set per aggregation, so no sum of another set is ever decrypted."""

    KIND: ClassVar[str] = "ckks_confirm"
    SENDS: ClassVar[Release] = Release.ENCRYPTED
    contributors: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class CkksDecrypt(TaskConfig):
    """`ckks_decrypt`: check each of `contributors`' signed input and its confirmation of
    exactly these contributors (sent under "<silo>/"), and return the decrypted sum's first
    `length` values (SUM)."""

    KIND: ClassVar[str] = "ckks_decrypt"
    SENDS: ClassVar[Release] = Release.ENCRYPTED
    length: int
    weights: Mapping[str, float]
    contributors: tuple[str, ...]
