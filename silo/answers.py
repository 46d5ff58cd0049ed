"""The silo's answer store: the exact bytes it sent for each task of a job, so that a task id
sent again (a retry, a restarted coordinator, or a coordinator that sends another model under a
task id already answered, to difference two releases of the same noise away) gets the same
bytes, whatever the new message carries.

Keyed by (job, task id), the job being the digest of the signed policy the silo accepted (a new
job with a new policy has a fresh namespace, and fresh noise: `SiloContext.private_seed` is
keyed the same way). On disk each answer is one file in `answers/` of the silo's state folder
for the deployment, named by the BLAKE2b of the key and the round it was sent in, written
whole (`write_atomically`) before the answer leaves and ending with the BLAKE3 digest of the
answer; without a folder the answers live in memory.

The file is not fsynced. A process that dies leaves it whole (the kernel holds it); a power loss
may lose or tear it, and an answer whose digest does not match reads as gone. That is safe
because a deployed silo books every answer in its ledger, fsynced, before the answer is kept
(silo/agent.py): a booked task whose answer is gone is refused, never run again. The answer
store is what lets a retry get the same bytes, and a power loss costs that retry at most; its
two fsyncs (the file, then the rename) were the longest step of a silo's critical path between
its training and its answer (docs/performance.md, "Where a round's time goes").

Answers from more than `KEEP_ROUNDS` rounds before the newest are emptied: the name stays as a
tombstone, so the silo still knows the task was answered and refuses it (as it does a task its
ledger holds but whose answer is gone). Only answers to tasks the silo's contract took move the
newest round: a refusal made before anything ran (a round or phase outside the policy, a task
misaddressed or unreadable) is kept under its round or the newest, whichever is earlier, so a
task for round 10**6 empties no answer of the rounds the silo is in.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from pathlib import Path

from fedsilo.wire.durable import make_private_folder, write_atomically
from fedsilo.wire.payload import DIGEST_BYTES, Payload, digest_of

KEEP_ROUNDS = 2
FOLDER = "answers"
_FILE = re.compile(r"^(?P<key>[0-9a-f]{32})\.r(?P<round>\d+)\.answer$")


class AnswerStore:
    """The answers of one deployment's tasks, on disk under `folder` or in memory (None)."""

    def __init__(self, folder: Path | None) -> None:
        self.folder = folder
        self._lock = threading.Lock()
        self._rounds: dict[str, int] = {}  # key -> round it was answered in
        self._live: set[str] = set()  # keys whose bytes are still kept
        self._memory: dict[str, Payload] = {}  # without a folder
        if folder is not None and folder.is_dir():
            for path in folder.iterdir():
                match = _FILE.match(path.name)
                if match is not None:
                    self._rounds[match["key"]] = int(match["round"])
                    if path.stat().st_size:
                        self._live.add(match["key"])

    def answer(self, job: str, task_id: str) -> Payload | None:
        """The bytes sent for `task_id` of `job`, or None (never answered, emptied, or torn)."""
        key = _key(job, task_id)
        with self._lock:
            if key not in self._live:
                return None
            if self.folder is None:
                return self._memory[key]
            kept = memoryview(self._path(key).read_bytes())
            answer, digest = kept[:-DIGEST_BYTES], bytes(kept[-DIGEST_BYTES:])
            if len(kept) <= DIGEST_BYTES or digest_of([answer]) != digest:
                self._live.discard(key)  # torn or lost by a power loss: gone
                return None
            return Payload([answer], digest)

    def answered(self, job: str, task_id: str) -> bool:
        """Whether `task_id` of `job` was answered, even if its bytes were emptied since."""
        with self._lock:
            return _key(job, task_id) in self._rounds

    def keep(
        self, job: str, task_id: str, round: int, answer: Payload, *, counts_round: bool = True
    ) -> None:
        """Store `answer` (return only then send it), and empty old rounds' answers.
        `counts_round` False: a refusal of a task no contract took, whose round is only the
        coordinator's word; it is kept under the newest round at most, moving nothing."""
        key = _key(job, task_id)
        with self._lock:
            if not counts_round:
                round = max(0, min(round, max(self._rounds.values(), default=0)))
            if self.folder is None:
                self._memory[key] = answer
            else:
                make_private_folder(self.folder)
                write_atomically(
                    self._path_for(key, round), (*answer.parts, answer.digest()), power_loss=False
                )
            self._rounds[key] = round
            self._live.add(key)
            newest = max(self._rounds[k] for k in self._live)
            for old in [k for k in self._live if self._rounds[k] < newest - KEEP_ROUNDS]:
                self._empty(old)

    def _empty(self, key: str) -> None:
        self._live.discard(key)
        if self.folder is None:
            del self._memory[key]
        else:
            os.truncate(self._path(key), 0)

    def _path(self, key: str) -> Path:
        return self._path_for(key, self._rounds[key])

    def _path_for(self, key: str, round: int) -> Path:
        assert self.folder is not None
        return self.folder / f"{key}.r{round}.answer"


def _key(job: str, task_id: str) -> str:
    return hashlib.blake2b(f"{job}\x00{task_id}".encode(), digest_size=16).hexdigest()
