"""SecAgg+'s sparse graph (`secure_aggregation.neighbours: k`, Bell et al. 2020): the graph is
the Harary graph H(k, n) over the roster in an order fixed by the deployment and the signed
policy; masks with a dropped silo's surviving neighbours come off exactly; a deployment with
dropouts still gets the survivors' sum, each silo sharing with its k neighbours only; and the
policy refuses settings the graph cannot run with, naming the field. The attacks of a
deviating coordinator are in tests/adversarial/test_sparse_masking.py."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from fedsilo.policies.loading import PolicyError
from fedsilo.policies.schema import Policy
from fedsilo.privacy.masking import (
    FixedPoint,
    MaskingError,
    MaskingKeys,
    add_streams,
    graph_seed,
    mask_streams,
    neighbourhood,
    new_seed,
    unmask_terms,
)
from fedsilo.wire.messages import TaskMessage, TaskResult
from fedsilo.wire.tasks.tensor_names import SHARE_TO
from tests.test_secure_aggregation import Endpoint, failing, run
from tests.test_secure_aggregation import policy as secure_policy

SILOS = 10


def policy(secure: object, **algorithm: object) -> Policy:
    """test_secure_aggregation's consortium with ten silos, and these algorithm settings."""
    return secure_policy(secure, silos=SILOS, algorithm={"name": "fedavg", **algorithm})


def test_the_graph_is_a_ring_with_each_silo_joined_to_the_k_over_2_nearest_on_either_side() -> None:
    silos = [f"s{i}" for i in range(7)]
    seed = graph_seed("consortium", "ab" * 32)
    graph = neighbourhood(silos, 4, seed)
    assert all(len(graph[s]) == 4 and s not in graph[s] for s in silos)
    assert all(s in graph[n] for s in silos for n in graph[s])  # undirected
    ring = neighbourhood(silos, 2, seed)  # k = 2: one cycle through all seven
    walk, previous = [silos[0]], None
    while len(walk) < len(silos):
        step = min(n for n in ring[walk[-1]] if n != previous)
        previous = walk[-1]
        walk.append(step)
    assert len(set(walk)) == len(silos) and walk[0] in ring[walk[-1]]
    # with k = 4, a silo's neighbours are the ring's two nearest on either side
    for i, silo in enumerate(walk):
        assert graph[silo] == {walk[(i + d) % 7] for d in (-2, -1, 1, 2)}
    # the same roster in any order gives the same graph; another signed policy, another order
    assert neighbourhood(reversed(silos), 4, seed) == graph
    others = [neighbourhood(silos, 4, graph_seed("consortium", j)) for j in ("cd" * 32, "")]
    assert any(g != graph for g in others)


@pytest.mark.parametrize(("silos", "degree"), [(5, 3), (5, 4), (3, 2), (6, 0)])
def test_a_graph_that_is_not_sparse_and_regular_is_refused(silos: int, degree: int) -> None:
    with pytest.raises(MaskingError, match="even degree below"):
        neighbourhood([f"s{i}" for i in range(silos)], degree, b"seed")


def test_masks_with_a_dropped_silos_neighbours_come_off_exactly() -> None:
    """Eight silos on H(4, 8); silo s3 shares and drops before its masked input: its four
    neighbours masked with it, nobody else did, and the sum comes back bit for bit."""
    silos = [f"s{i}" for i in range(8)]
    graph = neighbourhood(silos, 4, graph_seed("consortium", ""))
    rng = np.random.default_rng(0)
    encoded = {s: rng.integers(0, 2**32, 1000, dtype=np.uint32) for s in silos}
    keys = {s: MaskingKeys.generate() for s in silos}
    seeds = {s: new_seed() for s in silos}
    label, dropped = b"consortium/r1/train", "s3"
    survivors = [s for s in silos if s != dropped]
    masked_sum = np.zeros(1000, dtype=np.uint32)
    for s in survivors:
        peers = {p: keys[p].masking.public_key for p in graph[s]}
        masked_sum += encoded[s] + mask_streams(1000, s, seeds[s], keys[s].masking, peers, label)
    self_seeds = [seeds[s] for s in survivors]
    dropped_key = {dropped: keys[dropped].masking}
    publics = {s: keys[s].masking.public_key for s in survivors}
    total = masked_sum.copy()
    add_streams(
        total, unmask_terms(self_seeds, dropped_key, publics, {dropped: graph[dropped]}), label
    )
    expected = np.zeros(1000, dtype=np.uint32)
    for s in survivors:
        expected += encoded[s]
    assert np.array_equal(total, expected)
    # the complete graph's removal (every survivor) would leave the non-neighbours' streams in
    wrong = masked_sum.copy()
    add_streams(wrong, unmask_terms(self_seeds, dropped_key, publics), label)
    assert not np.array_equal(wrong, expected)


def counting_shares(counts: Counter[str], inner: Endpoint, name: str) -> Endpoint:
    def answer(payload: bytes) -> bytes:
        reply = inner(payload)
        if TaskMessage.decode(payload).kind == "secagg_share":
            result = TaskResult.decode(reply)
            counts[name] = sum(n.startswith(SHARE_TO) for n in result.tensors)
        return reply

    return answer


@pytest.mark.parametrize("step", ["secagg_mask", "secagg_unmask"])
def test_a_silo_that_drops_on_the_sparse_graph_leaves_the_survivors_sum(step: str) -> None:
    counts: Counter[str] = Counter()
    sparse = policy({"method": "masking", "neighbours": 4})
    dropping = failing("silo-2", step)
    masked = run(sparse, lambda n, e: counting_shares(counts, dropping(n, e), n))
    # dropping at the mask step: its input is not in the sum; at unmask: its input is
    plain = run(policy("none"), failing("silo-2", "train" if step == "secagg_mask" else "none"))
    assert masked.records[0].status == "completed", masked.records[0].error
    precision = FixedPoint.for_silos(64.0, SILOS).precision
    difference = (plain.state.model - masked.state.model).abs().max().item()
    assert difference <= SILOS * precision / 2 + 1e-7
    assert "silo-2" in masked.records[0].phases["train"]["dropped"]
    assert counts == dict.fromkeys((f"silo-{i}" for i in range(SILOS)), 4)  # k shares each


@pytest.mark.parametrize(
    ("section", "algorithm", "message"),
    [
        ({"neighbours": 3}, {}, "neighbours must be even"),
        ({"neighbours": 10}, {}, "neighbours 10 of 10 silos is the complete graph"),
        ({"neighbours": 4, "threshold": 2}, {}, "threshold 2 of 4 neighbours"),
        ({"neighbours": 4, "threshold": 5}, {}, "threshold 5 exceeds the 4 neighbours"),
        ({"neighbours": 4}, {"client_fraction": 0.5}, "every silo must take part"),
        ({"method": "ckks", "neighbours": 4}, {}, "only masking has a graph"),
    ],
)
def test_sparse_settings_the_graph_cannot_run_with_are_refused_naming_the_field(
    section: dict, algorithm: dict, message: str
) -> None:
    with pytest.raises(PolicyError, match=message) as refused:
        policy({"method": "masking", **section}, **algorithm)
    assert "neighbours" in str(refused.value) or "threshold" in str(refused.value)
