"""How a simulation builds its silo agents, the same way in this process and in a Ray actor
(`ops/ray_backend.py`): each silo's agent from the policy, its data and the consortium's keys.

Simulated silos get fresh identities, known to each other: what provisioning gives a
deployment, and what secure aggregation's signed keys need. `ConsortiumKeys` travels to other
processes as JSON (hex), never pickled.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
from nacl.public import PrivateKey, PublicKey
from nacl.signing import SigningKey, VerifyKey

from fedsilo.policies.schema import Policy
from fedsilo.privacy.ledger import PrivacyLedger
from fedsilo.silo.agent import SiloAgent
from fedsilo.silo.data import SiloDataset
from fedsilo.silo.tasks.base import SiloKeys


@dataclass(frozen=True)
class ConsortiumKeys:
    """Every simulated silo's signing seed and sealing key (32 bytes each), by silo name."""

    identities: dict[str, bytes]
    sealing: dict[str, bytes]

    @classmethod
    def generate(cls, names: Iterable[str]) -> ConsortiumKeys:
        names = list(names)
        return cls(
            {n: bytes(SigningKey.generate()) for n in names},
            {n: bytes(PrivateKey.generate()) for n in names},
        )

    @cached_property
    def roster(self) -> dict[str, VerifyKey]:
        """Each silo's public signing key (derived once, shared by every agent built here)."""
        return {n: SigningKey(k).verify_key for n, k in self.identities.items()}

    @cached_property
    def sealing_roster(self) -> dict[str, PublicKey]:
        """Each silo's public sealing key: what hand-offs to it are sealed to."""
        return {n: PrivateKey(k).public_key for n, k in self.sealing.items()}

    def of(self, name: str) -> SiloKeys:
        """Silo `name`'s keys (a name without keys, the central reference's pooled silo, has
        none of its own but knows the members')."""
        identity, sealing = self.identities.get(name), self.sealing.get(name)
        return SiloKeys(
            identity=SigningKey(identity) if identity is not None else None,
            roster=self.roster,
            sealing_key=PrivateKey(sealing) if sealing is not None else None,
            sealing_roster=self.sealing_roster,
        )

    def to_json(self) -> str:
        return json.dumps(
            {
                "identities": {n: k.hex() for n, k in self.identities.items()},
                "sealing": {n: k.hex() for n, k in self.sealing.items()},
            }
        )

    @classmethod
    def from_json(cls, text: str) -> ConsortiumKeys:
        raw = json.loads(text)
        return cls(
            {n: bytes.fromhex(k) for n, k in raw["identities"].items()},
            {n: bytes.fromhex(k) for n, k in raw["sealing"].items()},
        )


def build_agent(
    policy: Policy,
    name: str,
    data: SiloDataset,
    device: torch.device,
    keys: ConsortiumKeys,
    ledgers: Path | None = None,
) -> SiloAgent:
    """The agent of silo `name`, built as a deployed silo is (`SiloAgent`, from the policy),
    booking its releases in `ledgers`/<name>.jsonl when a folder is given (a DP policy: as a
    deployed silo books them)."""
    ledger = None if ledgers is None else PrivacyLedger(ledgers / f"{name}.jsonl")
    return SiloAgent(name, data, policy, device=device, ledger=ledger, keys=keys.of(name))


def read_ledgers(folder: Path | None) -> dict[str, bytes]:
    """The ledgers booked in `folder` (each silo's JSONL bytes, by silo); none without one."""
    if folder is None:
        return {}
    return {path.stem: path.read_bytes() for path in sorted(folder.glob("*.jsonl"))}
