"""Where a message's time goes: each step one message of a deployed round takes, timed alone.

A deployed round (bench/transport.py) moves a model to each silo and an answer back; every such
message is framed, hashed, signed, checked, decoded, and booked on disk on its way. This bench
times each of those steps in one process on the same model sizes, so that the round's overhead
over the bare gRPC floor (bench/grpc_floor.py) can be set against what its parts cost:

- `frame_out`: a task (its header ahead of the model) cut into serialized frames
  (wire/framing.py `to_frames`);
- `frame_in`: those frames read back: the envelope checked, the chunks reassembled and hashed,
  the signature verified (`read_message`);
- `digest`: the payload's BLAKE3-256 digest alone (wire/payload.py);
- `sign` and `verify`: one Ed25519 signature over an envelope, and its check, without the digest;
- `encode`: the safetensors message of a model (wire/tensors.py `encode_payload`: a header over
  views of the tensors);
- `decode`: a received model copied out into a tensor (`index_tensors`, `LazyTensor.load`);
- `replay_memory`: one accepted envelope remembered durably in SQLite (coordinator/replay_store.py);
- `answer_store`: a silo's answer kept, whole, before it is sent (silo/answers.py; not fsynced:
  the ledger's booking is);
- `ledger`: one release booked in the privacy ledger, fsynced (privacy/ledger.py);
- `checkpoint`: the round's model saved as a content-addressed file (coordinator/state.py);
- `thread_handoff`: a message handed from one thread to another and back through a queue.

Each step runs `--repeats` times after one warm-up; the JSON holds the median and the 10th and
90th percentiles in milliseconds per size. The process sets its C allocator as fedsilo's
services do (ops/memory.py). The disk steps are as fast as this machine's disk: they fsync where
a deployment does.

Run: `python -m bench.message_costs [--sizes 1e5,1e6] [--repeats 50] [--out message_costs]`.
"""

from __future__ import annotations

import argparse
import queue
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import matplotlib.pyplot as plt
import torch
from nacl.signing import SigningKey

from bench.common import write
from fedsilo.coordinator.replay_store import ReplayStore
from fedsilo.coordinator.state import Checkpoints
from fedsilo.ops.memory import keep_service_buffers
from fedsilo.privacy.accounting import Mechanism
from fedsilo.privacy.ledger import PrivacyLedger
from fedsilo.silo.answers import AnswerStore
from fedsilo.wire.envelope import Envelope, EnvelopeVerifier, seal
from fedsilo.wire.framing import read_message, to_frames
from fedsilo.wire.payload import Payload
from fedsilo.wire.tensors import encode_payload, index_tensors, tensor_block

STEPS = (
    "frame_out",
    "frame_in",
    "digest",
    "sign",
    "verify",
    "encode",
    "decode",
    "replay_memory",
    "answer_store",
    "ledger",
    "checkpoint",
    "thread_handoff",
)


def timed(step: Callable[[], object], repeats: int) -> dict[str, float]:
    """Median, 10th and 90th percentile of `repeats` runs of `step` (after one warm-up), in ms."""
    step()
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        runs.append(1e3 * (time.perf_counter() - start))
    deciles = statistics.quantiles(runs, n=10, method="inclusive")
    return {"ms": statistics.median(runs), "ms_p10": deciles[0], "ms_p90": deciles[-1]}


def costs(parameters: int, repeats: int, folder: Path) -> dict[str, dict[str, float]]:
    """Each step of `STEPS` for a model of `parameters` float32 values, on disk in `folder`."""
    key = SigningKey(bytes(range(32)))
    model = {"weights": torch.randn(parameters, generator=torch.Generator().manual_seed(0))}
    task = encode_payload(tensor_block(model), {"type": "task", "round": 1})
    envelope = _sealed(key, task)
    frames = list(to_frames(envelope, task))
    verifier = EnvelopeVerifier("bench", {"silo": key.verify_key})
    unsigned = envelope.signed_fields()
    signature = key.sign(unsigned).signature
    replays = ReplayStore(folder / "replay.db", retention_s=600)
    answers = AnswerStore(folder / "answers")
    ledger = PrivacyLedger(folder / "ledger.jsonl")
    checkpoints = Checkpoints(folder / "checkpoints")
    lazy = index_tensors(task)[0]["weights"]

    # a fresh envelope each time (the verifier refuses a replay), sealed before the clock runs
    envelopes = iter([next(to_frames(_sealed(key, task), task)) for _ in range(repeats + 1)])

    def frame_in() -> None:
        read_message([next(envelopes), *frames[1:]], verifier, 2**34)

    def checkpoint() -> None:  # a new model each round, as training makes one
        model["weights"][0] += 1.0
        checkpoints.save(model)

    handoff = _Handoff()
    steps: dict[str, Callable[[], object]] = {
        "frame_out": lambda: list(to_frames(envelope, task)),
        "frame_in": frame_in,
        "digest": lambda: Payload(task.parts).digest(),
        "sign": lambda: key.sign(unsigned),
        "verify": lambda: key.verify_key.verify(unsigned, signature),
        "encode": lambda: encode_payload(tensor_block(model), {"type": "task", "round": 1}),
        "decode": lazy.load,
        "replay_memory": lambda: replays.remember(time.time(), "silo", uuid.uuid4().hex),
        "answer_store": lambda: answers.keep("job", uuid.uuid4().hex, 1, task),
        "ledger": lambda: ledger.append(
            deployment="bench",
            round=1,
            task_id=uuid.uuid4().hex,
            mechanism=Mechanism.none(),
            payload_digest=task.digest().hex(),
            delta=None,
        ),
        "checkpoint": checkpoint,
        "thread_handoff": handoff.round_trip,
    }
    try:
        return {name: timed(steps[name], repeats) for name in STEPS}
    finally:
        handoff.close()
        replays.close()


def _sealed(key: SigningKey, payload: Payload) -> Envelope:
    task_id = uuid.uuid4().hex
    return seal(
        payload, signing_key=key, sender="silo", deployment="bench", round=1, task_id=task_id
    )


class _Handoff:
    """A worker thread that hands back whatever it is handed, as gRPC's threads hand messages
    to the engine's."""

    def __init__(self) -> None:
        self.inbox: queue.Queue[object] = queue.Queue()
        self.outbox: queue.Queue[object] = queue.Queue()
        self.worker = threading.Thread(target=self._echo, daemon=True)
        self.worker.start()

    def round_trip(self) -> object:
        self.inbox.put(self)
        return self.outbox.get()

    def close(self) -> None:
        self.inbox.put(None)
        self.worker.join()

    def _echo(self) -> None:
        while (item := self.inbox.get()) is not None:
            self.outbox.put(item)


def _figure(rows: list[dict]) -> plt.Figure:
    fig, ax = plt.subplots(figsize=(9, 5))
    height = 0.8 / len(rows)
    for index, row in enumerate(rows):
        positions = [i + index * height for i in range(len(STEPS))]
        ax.barh(
            positions,
            [row["steps"][s]["ms"] for s in STEPS],
            height=height,
            label=f"{row['parameters']:.0e} parameters",
        )
    ax.set_yticks([i + 0.4 - height / 2 for i in range(len(STEPS))], STEPS)
    ax.set_xscale("log")
    ax.set_xlabel("ms per message (median)")
    ax.invert_yaxis()
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1e5,1e6")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", default="message_costs")
    args = parser.parse_args()
    keep_service_buffers()
    rows = []
    for size in (int(float(s)) for s in args.sizes.split(",")):
        with tempfile.TemporaryDirectory(prefix="fedsilo-costs-") as tmp:
            rows.append({"parameters": size, "steps": costs(size, args.repeats, Path(tmp))})
        print({s: round(v["ms"], 3) for s, v in rows[-1]["steps"].items()}, flush=True)
    path = write(args.out, {"rows": rows, "repeats": args.repeats}, _figure(rows))
    print(f"wrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
