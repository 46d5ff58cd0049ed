"""What a silo keeps in memory between the tasks of a deployment (`SiloContext.store`), lost
with the process; what must outlive it is in its state folder (silo/state.py, the aggregation
log, the answer store)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fedsilo.silo.model_skeleton import ModelSkeleton

if TYPE_CHECKING:
    import tenseal as ts
    from torch import Tensor

    from fedsilo.silo.aggregation_log import AggregationLog


@dataclass
class HostedModel:
    """FedDC and cyclic: the model this silo hosts, and FedProx's anchor for it (the model of
    the last exchange); both None until the first model arrives. `delivered`: the (round,
    phase) of the hand-off it hosts (None: it adopted the model, or trained its own since).
    `root`: the digest of the model its lineage was adopted from (by this silo, or by the
    silo that handed it on). `holders`: the members this silo knows held the model, or a copy
    of it, since it was adopted, latest first, as many as FedDC's `no_return_window`: the
    member that handed it on and those its hand-off named, and those this silo sealed it to
    while it kept hosting it."""

    model: Tensor | None = None
    anchor: Tensor | None = None
    delivered: tuple[int, str] | None = None
    root: bytes | None = None
    holders: tuple[str, ...] = ()


@dataclass
class SiloMemory:
    """`released_counts`: the splits whose sample count has left the silo (silo/reports.py).
    `features`: every split standardised with the consortium's scaler, once it arrived.
    `hosted`: the daisy chain's model. `sessions`: per secure-aggregation protocol, the one
    aggregation under way, by session id, its steps' values. `ckks_contexts`: the CKKS secret
    context by digest (one at a time). `aggregation_log`: the silo's log of the protocol steps
    it took, read from its state folder when first needed. `advertised`: masking's
    advertisements (public keys and the released sample count) by session id, with their
    round, and `ckks_made`: the CKKS keys this silo made as key holder (its answer's tensors and
    their recipients): a coordinator restarted in the middle of an aggregation asks for them
    again and gets the same ones, which are public or sealed, so it finishes the aggregation
    the silos began. `skeleton`: the network a task's
    model is loaded into (silo/model_skeleton.py). `background`: one worker thread for what a
    task computes while it trains (masking's streams), started on first use and kept, since
    starting a thread per task cost a quarter of a millisecond. `lineage`: the server states
    this silo derived (silo/lineage.py), by the digest of the evidence they derive from."""

    released_counts: set[str] = field(default_factory=set)
    features: dict[str, Tensor] | None = None
    hosted: HostedModel = field(default_factory=HostedModel)
    sessions: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    ckks_contexts: dict[str, ts.Context] = field(default_factory=dict)
    advertised: dict[str, tuple[int, bytes, int]] = field(default_factory=dict)
    ckks_made: tuple[tuple[str, ...], dict[str, Tensor]] | None = None
    aggregation_log: AggregationLog | None = None
    skeleton: ModelSkeleton = field(default_factory=ModelSkeleton)
    lineage: dict[bytes, dict[str, Tensor]] = field(default_factory=dict)
    background: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="silo-bg")
    )
