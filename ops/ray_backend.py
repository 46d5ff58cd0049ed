"""`fedsilo simulate --backend ray`: the simulation's silos in Ray actors, on this machine or a
cluster, under the same engine and strategies as the in-process backend.

- A pool of actors (`SiloHost`) holds the silos' agents, their data and their state between
  tasks; silo i of the sorted names lives on actor i mod pool size, so the assignment is
  deterministic. An actor runs one task at a time and reserves one silo's
  `compute.resources` (CPUs, GPUs, memory), so the pool is as large as the cluster has room
  for, at most one actor per silo.
- Only bytes and JSON cross to the actors: each silo's data as safetensors
  (`silo/data/transfer.py`), the policy as JSON, the keys as hex, and every task as the same
  encoded message the in-process transport hands its endpoints. A tensor block that all of a
  phase's tasks share (the broadcast model) is put into Ray's object store once per phase, not
  once per silo. Nothing arrives pickled but Ray's own framing of those bytes and strings.
- Silos compute exactly what they compute in process (a silo's randomness derives from
  (seed, round, phase, purpose, silo), not from where it runs), so a run's metrics and final
  model are bit-for-bit those of the in-process backend (tests/test_ray_backend.py). That
  needs one more thing to match: torch's number of intra-op threads, which decides how a
  matrix product splits its sums (an MLP's SuPerFed run differed in the 8th digit with 1 thread
  against 2). Each actor therefore runs torch with the driver's thread count, whatever CPUs it
  reserves; give `compute.resources.cpus` that many to keep a node from oversubscribing.
- GPU placement: `compute.device` and `compute.resources.gpus` become the actors' `num_gpus`
  (`actor_options`); Ray then makes the granted GPU the actor's only visible one, so cuda:N is
  run as cuda inside the actor.

Ray is an optional extra (`pip install 'fedsilo[ray]'`), imported only here and only when the
backend is asked for.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import tempfile
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedsilo.coordinator.transport import Delivery, Reply
from fedsilo.ops.backends import BackendError
from fedsilo.ops.openmp import WAIT_POLICY
from fedsilo.ops.sim_silos import ConsortiumKeys, build_agent, read_ledgers
from fedsilo.policies.compute import ComputeConfig
from fedsilo.policies.schema import Policy
from fedsilo.silo.agent import SiloAgent
from fedsilo.silo.data import DataError, SiloDataset
from fedsilo.silo.data.transfer import decode_dataset, encode_dataset
from fedsilo.silo.device import DeviceError, resolve_device
from fedsilo.wire.payload import AnyPayload, Payload, as_payload

INSTALL_HINT = "--backend ray needs Ray, an optional extra: pip install 'fedsilo[ray]'"
SHARED_PART_BYTES = 1 << 16  # a task part this large goes into the object store once per phase
BYTES_PER_MB = 1 << 20


def import_ray() -> Any:
    """The `ray` module, or a `BackendError` saying how to install it."""
    try:
        import ray
    except ImportError:
        raise BackendError(INSTALL_HINT) from None
    return ray


@contextmanager
def ray_session(address: str | None = None, num_cpus: int | None = None) -> Iterator[Any]:
    """Ray, connected for the duration: to the cluster at `address`, else to a fresh local
    instance with `num_cpus` (default: this machine's CPUs); shut down at the end, on errors
    too. A session already open (a notebook's) is used as it is and left open.

    Ray's tip that it may one day stop hiding GPUs from actors that reserve none is silenced:
    this backend relies on today's behaviour (a silo without a GPU share sees no GPU)."""
    ray = import_ray()
    if address:
        check_reachable(address)
    if ray.is_initialized():
        yield ray
        return
    quiet = {"include_dashboard": False, "logging_level": logging.WARNING, "log_to_driver": False}
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Tip: In future versions of Ray", FutureWarning)
            if address:
                ray.init(address=address, **quiet)
            else:
                # the workers inherit it: OpenMP threads that sleep rather than spin at barriers
                # (ops/openmp.py); spinning actors made a 50-silo round 30 times slower here
                os.environ.setdefault("OMP_WAIT_POLICY", WAIT_POLICY)
                # no metrics agent: nothing here reads it, and it logs an error when it lags
                system = {"enable_metrics_collection": False}
                cpus = num_cpus or os.cpu_count() or 1
                _start_local(ray, num_cpus=cpus, _system_config=system, **quiet)
    except (ConnectionError, RuntimeError, ValueError, LocalStartTimeout) as exc:
        ray.shutdown()
        where = f"the Ray cluster at --address {address}" if address else "a local Ray instance"
        raise BackendError(f"cannot start {where}: {exc}") from None
    try:
        yield ray
    finally:
        ray.shutdown()


# Ray's own words when a local instance's processes did not come up: the raylet's fixed 30 s
# wait ran out (a bare Exception), or the GCS did not answer; then Ray may fail while reading
# the GCS's error log that was never written (a FileNotFoundError naming gcs_server.err)
STARTUP_FAILURES = ("timed out during startup", "Failed to start GCS", "gcs_server.err")
LOCAL_START_ATTEMPTS = 3


class LocalStartTimeout(Exception):
    """A local Ray instance whose processes did not come up in time, on every attempt."""


def _start_local(ray: Any, **init: Any) -> None:
    """`ray.init(**init)` for a local instance. On a loaded machine (two cores, a test suite
    beside it) Ray's fixed waits for its GCS and raylet can run out, so a start that failed
    that way is tried again from scratch, and one that fails every time becomes
    `LocalStartTimeout`. Any other error is Ray's to report."""
    for attempt in range(1, LOCAL_START_ATTEMPTS + 1):
        try:
            ray.init(**init)
            return
        except Exception as exc:  # Ray raises the raylet's timeout as a bare Exception
            if not any(words in str(exc) for words in STARTUP_FAILURES):
                raise
            ray.shutdown()
            if attempt == LOCAL_START_ATTEMPTS:
                raise LocalStartTimeout(f"{exc} ({attempt} attempts)") from None


def check_reachable(address: str, timeout: float = 5.0) -> None:
    """A `BackendError` when nothing answers at a HOST:PORT `address` (Ray itself retries an
    unreachable head for minutes); `auto` and `ray://` addresses are left to Ray."""
    host, _, port = address.rpartition(":")
    if address == "auto" or "://" in address or not host or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as exc:
        raise BackendError(
            f"--address {address}: no Ray head answers there ({exc}); start one with "
            "`ray start --head` and give the address it prints"
        ) from None


def actor_options(compute: ComputeConfig, cluster: Mapping[str, float]) -> dict[str, float]:
    """The Ray resources one silo's actor requests: `compute.resources`, its GPUs following
    `compute.device` when not given (cpu: 0; cuda, cuda:N: 1; auto: 1 if `cluster` has a GPU)."""
    resources = compute.resources
    gpus = resources.gpus
    if gpus is None:
        wants_gpu = compute.device.startswith("cuda") or (
            compute.device == "auto" and cluster.get("GPU", 0) > 0
        )
        gpus = 1.0 if wants_gpu else 0.0
    if compute.device.startswith("cuda") and gpus == 0:
        raise BackendError(
            f"compute.resources.gpus is 0 but compute.device is {compute.device}: a Ray actor "
            "sees a GPU only if it reserves one; give gpus > 0 (a fraction shares a GPU)"
        )
    options = {"num_cpus": float(resources.cpus), "num_gpus": float(gpus)}
    if resources.memory_mb is not None:
        options["memory"] = float(resources.memory_mb * BYTES_PER_MB)
    return options


def pool_size(options: Mapping[str, float], cluster: Mapping[str, float], silos: int) -> int:
    """How many actors the cluster holds at once with `options` each, at most one per silo;
    a `BackendError` when not even one fits."""
    fits = [math.floor(cluster.get("CPU", 0) / options["num_cpus"])]
    if options["num_gpus"] > 0:
        fits.append(math.floor(cluster.get("GPU", 0) / options["num_gpus"]))
    if "memory" in options:
        fits.append(math.floor(cluster.get("memory", 0) / options["memory"]))
    size = min([silos, *fits])
    if size < 1:
        asked = ", ".join(f"{k} {v:g}" for k, v in options.items())
        have = ", ".join(f"{k} {cluster.get(k, 0):g}" for k in ("CPU", "GPU", "memory"))
        raise BackendError(
            f"compute.resources: one silo asks for {asked} but the Ray cluster has {have}"
        )
    return size


def actor_device(device: str) -> str:
    """The device a silo's actor asks torch for: Ray renumbers the GPUs it grants from 0."""
    return "cuda" if device.startswith("cuda") else device


class SiloHost:
    """One Ray actor's silos: their agents, built here from bytes, answering encoded tasks.
    An actor outlives a run: the next run in the same Ray session `load`s it afresh."""

    def __init__(self) -> None:
        self._agents: dict[str, SiloAgent] = {}
        self._ledgers: tempfile.TemporaryDirectory[str] | None = None

    def load(self, policy_json: str, keys_json: str, threads: int) -> None:
        """Forget every silo of an earlier run; build the next ones under this policy (under
        DP each with its ledger, in a temporary folder of this actor's)."""
        torch.set_num_threads(threads)  # how torch splits its sums: part of the arithmetic
        self._policy = Policy.model_validate_json(policy_json)
        self._keys = ConsortiumKeys.from_json(keys_json)
        self.unload()
        if self._policy.privacy.differentially_private:
            self._ledgers = tempfile.TemporaryDirectory(prefix="fedsilo-ledgers-")

    def add_silo(self, dataset: bytes) -> str:
        """Build the agent of the silo encoded in `dataset`; the device note of its placement."""
        data = decode_dataset(dataset)
        device, note = resolve_device(actor_device(self._policy.compute.device))
        folder = Path(self._ledgers.name) if self._ledgers is not None else None
        self._agents[data.name] = build_agent(
            self._policy, data.name, data, device, self._keys, folder
        )
        return note

    def handle(self, silo: str, *parts: bytes) -> bytes:
        """The encoded result of the encoded task `parts` (joined) for `silo`."""
        return self._agents[silo].handle_bytes(Payload(parts)).to_bytes()  # Ray ships bytes

    def ledgers(self) -> dict[str, bytes]:
        """This actor's silos' ledgers (JSONL bytes, by silo); none without DP."""
        return read_ledgers(Path(self._ledgers.name) if self._ledgers is not None else None)

    def unload(self) -> None:
        """Drop the run's silos (their data, state and ledgers)."""
        self._agents = {}
        if self._ledgers is not None:
            self._ledgers.cleanup()
            self._ledgers = None


class RayTransport:
    """The transport of `--backend ray`: each task to its silo's actor, each result yielded as
    it arrives, until all came or the deadline passed (a late result is dropped, as in process;
    its actor finishes the task before its next one)."""

    def __init__(self, ray: Any, hosts: Mapping[str, Any], actors: list[Any]) -> None:
        self._ray = ray
        self._hosts = dict(hosts)
        self._actors = actors

    def silos(self) -> list[str]:
        return list(self._hosts)

    def dispatch(self, deliveries: Iterable[Delivery], deadline: float) -> Iterator[Reply]:
        ray = self._ray
        shared: dict[tuple[int, int], tuple[object, Any]] = {}  # a large part: (buffer, ref)
        pending: dict[Any, Delivery] = {}
        unknown: list[Reply] = []
        for delivery in deliveries:
            host = self._hosts.get(delivery.silo)
            if host is None:
                unknown.append(Reply(delivery.silo, delivery.task_id, None, "unknown silo"))
                continue
            args = [self._argument(part, shared) for part in _parts(delivery.payload)]
            pending[host.handle.remote(delivery.silo, *args)] = delivery
        shared.clear()  # Ray holds what submitted tasks still need
        yield from unknown
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=remaining)
            for ref in ready:
                delivery = pending.pop(ref)
                try:
                    payload = as_payload(ray.get(ref))
                except ray.exceptions.RayError as exc:  # a silo's crash is that silo's dropout
                    yield Reply(delivery.silo, delivery.task_id, None, f"silo crashed: {exc!r}")
                    continue
                yield Reply(delivery.silo, delivery.task_id, payload)

    def _argument(self, part: memoryview, shared: dict[tuple[int, int], tuple[object, Any]]) -> Any:
        """A task part as an argument: small parts inline, a large one put once per phase (the
        shared model block is the same memory in every silo's task). Parts are told apart by
        their memory's address and length; `shared` keeps each buffer alive while the phase is
        handed over, so no other buffer can take its address meanwhile."""
        if len(part) < SHARED_PART_BYTES:
            return bytes(part)
        key = (np.frombuffer(part, dtype=np.uint8).ctypes.data, len(part))
        if key not in shared:
            shared[key] = (part.obj, self._ray.put(bytes(part)))
        return shared[key][1]

    def ledgers(self) -> dict[str, bytes]:
        """Every silo's ledger, as its actor booked it (none without DP)."""
        booked: dict[str, bytes] = {}
        for part in self._ray.get([actor.ledgers.remote() for actor in self._actors]):
            booked.update(part)
        return dict(sorted(booked.items()))

    def close(self) -> None:
        """Drop the silos from their actors; the actors stay for the session's next run."""
        self._ray.get([actor.unload.remote() for actor in self._actors])
        self._actors.clear()
        self._hosts.clear()


def _parts(payload: AnyPayload) -> tuple[memoryview, ...]:
    if isinstance(payload, Payload):
        return payload.parts
    return (memoryview(payload.to_bytes()),)


_POOLS: dict[tuple[str, str], list[Any]] = {}  # (Ray job, actor options): the actors made


def host_pool(ray: Any, options: Mapping[str, float], size: int) -> list[Any]:
    """`size` actors with `options` each, the same ones for every run of this Ray session
    (job), created when first needed: starting a worker process and importing torch there took
    ~10 s on 2 loaded cores, more than a short run itself. Their handles are kept here, as Ray
    ends an actor once no handle to it is left; the session's end ends them."""
    job = ray.get_runtime_context().get_job_id()
    for stale in [key for key in _POOLS if key[0] != job]:
        del _POOLS[stale]  # a session that ended: its actors ended with it
    tag = ",".join(f"{key}={value:g}" for key, value in sorted(options.items()))
    actors = _POOLS.setdefault((job, tag), [])
    host_class = ray.remote(SiloHost)
    actors.extend(host_class.options(**options).remote() for _ in range(size - len(actors)))
    return actors[:size]


def start_silos(
    ray: Any,
    policy: Policy,
    silos: Mapping[str, SiloDataset],
    keys: ConsortiumKeys,
) -> tuple[RayTransport, str]:
    """A pool of `SiloHost` actors holding `silos` (silo i of the sorted names on actor
    i mod pool size), the transport to them, and where the silos train (first silo's note)."""
    cluster = ray.cluster_resources()
    options = actor_options(policy.compute, cluster)
    names = sorted(silos)
    size = pool_size(options, cluster, len(names))
    actors = host_pool(ray, options, size)
    args = (policy.model_dump_json(), keys.to_json(), torch.get_num_threads())
    ray.get([actor.load.remote(*args) for actor in actors])
    hosts = {name: actors[i % size] for i, name in enumerate(names)}
    transport = RayTransport(ray, hosts, actors)
    try:
        notes = ray.get([hosts[n].add_silo.remote(encode_dataset(silos[n])) for n in names])
    except ray.exceptions.RayTaskError as exc:
        transport.close()
        cause = exc.cause
        if isinstance(cause, (DeviceError, DataError)):
            raise type(cause)(str(cause)) from None
        raise
    return transport, notes[0]
