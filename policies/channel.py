"""The policy's `channel:` section: how models that move between silos travel.

`sealed_handoffs: true` seals every daisy-chain hand-off to its recipient's X25519 key, so the
coordinator relays bytes it cannot read and the recipient learns nothing of the sender
(the FedDC paper's appendix A.7). False: the coordinator forwards the model in the clear
(still over mutual TLS)."""

from __future__ import annotations

from fedsilo.policies.base import PolicyModel


class ChannelConfig(PolicyModel):
    # true: every hand-off of a model from one silo to another is sealed to its recipient's key, so
    # the coordinator relays bytes it cannot read; false (the default): forwarded in the clear over
    # mutual TLS (required true by cyclic)
    sealed_handoffs: bool = False
