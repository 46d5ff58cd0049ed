"""Staggered sends: the coordinator's large tasks cross its link one at a time.

When the coordinator's link is the consortium's narrowest (a star: it carries every silo's model
down and every update up), sending S models at once shares the link S ways, every silo gets its
model at the same late moment, and nothing comes back up until then: a round takes about
2 * S model-times of the link. Sent one after the other, the first silo has its model after one
model-time and trains and answers while the next downloads, so the uplink works beside the
downlink and a round approaches its physical limit, (S + 1) model-times plus training
(docs/performance.md, "Over bandwidth-limited links").

`StaggeredSends.frames` wraps the frames of one outgoing message. A message of at least
`min_bytes` waits for the slot, and keeps it while its frames keep leaving. Smaller messages
(controls, acknowledgements, small models) never wait. A send that stalls, no frame accepted by
gRPC for `stall_s` (a silo whose own link is slow, or one that stopped reading), no longer
holds the others back: they go ahead side by side, as without staggering. A cancelled or failed
send releases the slot as its generator closes.

Off by default (`coordinator start|serve --sends staggered`): where silos' own links are
narrower than the coordinator's, one slow silo at the head would delay the rest by up to
`stall_s` a frame.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator

SEND_MODES = ("concurrent", "staggered")
MIN_STAGGERED_BYTES = 1 << 20
STALL_S = 5.0


class StaggeredSends:
    """The coordinator's one slot for large outgoing messages."""

    def __init__(self, min_bytes: int = MIN_STAGGERED_BYTES, stall_s: float = STALL_S) -> None:
        self.min_bytes = min_bytes
        self.stall_s = stall_s
        self._slot = threading.Lock()
        self._moved_at = time.monotonic()  # when the slot's holder last had a frame accepted

    def frames(self, frames: Iterable[bytes], size: int) -> Iterator[bytes]:
        """`frames`, a message of `size` payload bytes, sent when the slot is this message's
        (or the holder stalls)."""
        if size < self.min_bytes:
            yield from frames
            return
        held = self._wait()
        try:
            for frame in frames:
                yield frame
                if held:
                    self._moved_at = time.monotonic()
        finally:
            if held:
                self._slot.release()

    def _wait(self) -> bool:
        """Take the slot (True), or give up waiting once its holder has moved no frame for
        `stall_s` (False: send beside it)."""
        while not self._slot.acquire(timeout=self.stall_s / 4):
            if time.monotonic() - self._moved_at > self.stall_s:
                return False
        self._moved_at = time.monotonic()
        return True
