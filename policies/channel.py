"""The policy's `channel:` section: how models that move between silos travel.

`sealed_handoffs: true` seals every daisy-chain hand-off to its recipient's X25519 key, so the
coordinator relays bytes it cannot read and the recipient learns nothing of the sender
(the FedDC paper's appendix A.7). False: the coordinator forwards the model in the clear
(still over mutual TLS)."""

from __future__ import annotations

from fedsilo.policies.base import PolicyModel


class ChannelConfig(PolicyModel):
    sealed_handoffs: bool = False
