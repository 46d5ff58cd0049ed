"""A silo's check of the consortium's signed roster (privacy/roster.py), which its coordinator
hands it with each job's policy: the coordinator is never trusted with membership.

The roster must be signed by the operator (the silo's kit pins operator_verify_key), be of the
silo's consortium, be no older than the newest roster this silo has seen (kept in its state
folder as `roster.json`, so across restarts too; another roster with the same version is
refused as well), and list this silo as a member exactly as its kit knows itself (certificate
fingerprint, verify key, sealing public key). A coordinator that sends no roster once this silo
has seen one is refused too (it would roll membership back to the kit's `peers`); before any,
a silo works with its kit's `peers` (kits provisioned before rosters were signed).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from nacl.signing import VerifyKey

from fedsilo.privacy.roster import (
    RosterEntry,
    RosterError,
    SignedRoster,
    not_older,
    read_roster_file,
    verify_roster,
    write_roster_file,
)
from fedsilo.wire.durable import make_private_folder


@dataclass
class RosterGate:
    """Admits the signed roster of a job, or says why not (RosterError)."""

    name: str
    consortium: str
    operator_key: VerifyKey
    own: Callable[[], RosterEntry]  # this silo as its kit knows itself now
    folder: Path | None = None  # where the newest roster seen is kept; None: in memory
    _newest: SignedRoster | None = field(default=None, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def __post_init__(self) -> None:
        if self.folder is not None:
            self._newest = read_roster_file(self.folder, self.operator_key, self.consortium)

    @property
    def newest(self) -> SignedRoster | None:
        return self._newest

    def admit(self, text: object, signature: object) -> SignedRoster | None:
        """The roster (`text`, `signature`) as the coordinator sent it, checked; None when it
        sent none and this silo has never seen one (the kit's peers are used)."""
        with self._lock:
            if text is None and signature is None:
                if self._newest is not None:
                    raise RosterError(
                        "the coordinator sent no roster, but this silo has seen roster version "
                        f"{self._newest.version}"
                    )
                return None
            if not isinstance(text, str) or not isinstance(signature, str):
                raise RosterError("the coordinator's roster or its signature is not text")
            roster = verify_roster(text, signature, self.operator_key, self.consortium)
            not_older(roster, self._newest)
            if self._newest is None or roster.version > self._newest.version:
                self._keep(roster)
            self._check_own_entry(roster)
            return roster

    def _keep(self, roster: SignedRoster) -> None:
        if self.folder is not None:
            make_private_folder(self.folder)
            write_roster_file(self.folder, roster)
        self._newest = roster

    def _check_own_entry(self, roster: SignedRoster) -> None:
        document = roster.document
        if self.name in document.revoked:
            raise RosterError(
                f"roster version {roster.version} revokes this silo: {document.revoked[self.name]}"
            )
        entry = document.silos.get(self.name)
        if entry is None:
            raise RosterError(f"roster version {roster.version} does not list this silo")
        differing = [
            key for key, value in self.own().model_dump().items() if getattr(entry, key) != value
        ]
        if differing:
            raise RosterError(
                f"roster version {roster.version} lists this silo with another "
                f"{', '.join(differing)} than its kit's"
            )
