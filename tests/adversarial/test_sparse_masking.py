"""SecAgg+'s sparse graph (`secure_aggregation.neighbours`) against a deviating coordinator.

Ten unmodified silo agents under `neighbours: 4` (t = 3 of a silo's 4 neighbours; the
consistency check needs 7 of 10 signatures), driven by the deviating coordinator of
tests/adversarial/test_masking.py. On the sparse graph a silo's input is hidden only by the
masks it shares with its few neighbours, so the coordinator's levers are the neighbourhoods:

- re-roll the graph: relay other views (other subsets of the advertised keys, other rounds'
  fresh keys, as a colluding silo could grind its own) until the target's neighbours suit it;
- keep the target's honest neighbours out of its view, so that it masks with too few;
- hand the target shares from silos that are not its neighbours (colluders in place of the
  honest neighbours it should mask with);
- declare the target's neighbours dropped after they sent their masked inputs, so that their
  masking keys are rebuilt and the masks they share with the target come off, while the
  target's own self-mask seed is still revealed;
- forge the advertisement of a silo that is not the target's neighbour (whose keys the target
  never uses) to pass off a silo that never took part as a member.

Each test asserts that the attack fails: the silos refuse, or the target's self-mask seed
cannot be rebuilt from what they reveal.
"""

from __future__ import annotations

import pytest
from nacl.signing import SigningKey

from fedsilo.policies.schema import Policy
from fedsilo.privacy.masking import MaskingKeys, aggregation_label, graph_seed, neighbourhood
from fedsilo.wire.tasks.tensor_names import REVEALED_SEED, SHARE_TO
from tests.adversarial.test_masking import (
    DEPLOYMENT,
    PHASE,
    Consortium,
    DeviatingCoordinator,
    consortium,
    secure_policy,
)

SILOS = [f"silo-{i}" for i in range(10)]
TARGET = "silo-0"
K, T, CONSISTENCY = 4, 3, 7  # floor(2 * 4 / 3) + 1 and floor(2 * 10 / 3) + 1


def sparse_policy() -> Policy:
    """Four rounds: the first test re-rolls the keys in each of four rounds."""
    return secure_policy(silos=len(SILOS), rounds=4, neighbours=K)


@pytest.fixture(scope="module")
def graph() -> dict[str, frozenset[str]]:
    """The graph every silo computes (the simulation's silos pin no policy digest: job "")."""
    return neighbourhood(SILOS, K, graph_seed(DEPLOYMENT, ""))


def honest_shares(c: Consortium, round_no: int = 1) -> DeviatingCoordinator:
    """Advertise and share as the honest engine does, everyone in both steps."""
    coordinator = DeviatingCoordinator(c, round_no=round_no)
    adverts = coordinator.advertise(SILOS)
    coordinator.share(dict.fromkeys(SILOS, adverts))
    return coordinator


def honest_round(c: Consortium, round_no: int = 1) -> DeviatingCoordinator:
    """Advertise, share and mask as the honest engine does, everyone in every step."""
    coordinator = honest_shares(c, round_no)
    coordinator.mask(dict.fromkeys(SILOS, 1 / len(SILOS)))
    return coordinator


def test_no_view_the_coordinator_relays_re_rolls_the_targets_neighbours(
    graph: dict[str, frozenset[str]],
) -> None:
    """Fresh keys each round (a colluder could grind its own) and views of every size: the
    target always shares with the same k neighbours, fixed by the signed policy alone."""
    c = consortium(sparse_policy())
    others = [s for s in SILOS if s not in graph[TARGET] | {TARGET}]
    for round_no, left_out in enumerate(([], others[:1], others[:3], others), start=1):
        coordinator = DeviatingCoordinator(c, round_no=round_no)
        adverts = coordinator.advertise(SILOS)
        view = {s: a for s, a in adverts.items() if s not in left_out}
        shared = coordinator.share({TARGET: view})
        sent_to = {n.removeprefix(SHARE_TO) for n in shared[TARGET].tensors}
        assert sent_to == graph[TARGET], f"round {round_no}: shares went to {sent_to}"


def test_a_view_without_the_targets_neighbours_is_refused(
    graph: dict[str, frozenset[str]],
) -> None:
    """Keeping two of the four neighbours out leaves two, fewer than t = 3: the target refuses
    to share, so it never masks with the (possibly colluding) two that remain."""
    c = consortium(sparse_policy())
    coordinator = DeviatingCoordinator(c)
    adverts = coordinator.advertise(SILOS)
    kept_out = sorted(graph[TARGET])[:2]
    shared = coordinator.share({TARGET: {s: a for s, a in adverts.items() if s not in kept_out}})
    assert TARGET not in shared
    assert "graph neighbours" in coordinator.refusals["share"][TARGET]


def test_shares_from_silos_that_are_not_the_targets_neighbours_are_refused(
    graph: dict[str, frozenset[str]],
) -> None:
    coordinator = honest_shares(consortium(sparse_policy()))
    stranger = min(s for s in SILOS if s not in graph[TARGET] | {TARGET})
    # the stranger's share for one of its own neighbours, relayed to the target as the target's
    addressed = next(n for n in coordinator.shared[stranger].tensors if n.startswith(SHARE_TO))
    coordinator.shared[stranger].tensors[SHARE_TO + TARGET] = coordinator.shared[stranger].tensors[
        addressed
    ]
    coordinator.mask(dict.fromkeys(SILOS, 1 / len(SILOS)))
    assert TARGET not in coordinator.masked
    refusal = coordinator.refusals["mask"][TARGET]
    assert "not this silo's graph neighbours" in refusal and stranger in refusal


def test_too_few_neighbours_shares_at_the_mask_step_are_refused(
    graph: dict[str, frozenset[str]],
) -> None:
    """The coordinator relays only one neighbour's share: the target would mask with one."""
    coordinator = honest_shares(consortium(sparse_policy()))
    for neighbour in sorted(graph[TARGET])[1:]:
        del coordinator.shared[neighbour].tensors[SHARE_TO + TARGET]
    coordinator.mask(dict.fromkeys(SILOS, 1 / len(SILOS)))
    assert TARGET not in coordinator.masked
    assert "only 1 of this silo's graph neighbours" in coordinator.refusals["mask"][TARGET]


def test_declaring_the_targets_neighbours_dropped_reveals_no_seed_of_the_target(
    graph: dict[str, frozenset[str]],
) -> None:
    """Two of the target's four neighbours sent masked inputs but are declared dropped: eight
    survivors pass the consistency check (7), the two neighbours' masking keys would be rebuilt
    and the masks they share with the target removed. The target refuses to sign or reveal with
    only two of its neighbours surviving, and the two that survive hold fewer than t = 3 shares
    of its self-mask seed, so its masked input stays masked."""
    c = consortium(sparse_policy())
    coordinator = honest_round(c)
    assert sorted(coordinator.masked) == SILOS, coordinator.refusals
    declared_dropped = set(sorted(graph[TARGET])[:2])
    survivors = [s for s in SILOS if s not in declared_dropped]
    revealed = coordinator.unmask(dict.fromkeys(survivors, survivors))
    assert TARGET not in revealed
    assert "graph neighbours this silo masked with" in coordinator.refusals["unmask"][TARGET]
    assert "graph neighbours this silo masked with" in coordinator.refusals["confirm"][TARGET]
    holders = {s for s, r in revealed.items() if REVEALED_SEED + TARGET in r.tensors}
    assert holders <= graph[TARGET] and len(holders) < T
    assert coordinator.rebuild(revealed, REVEALED_SEED + TARGET, T) is None


def test_the_honest_round_reveals_each_seed_to_its_neighbours_only(
    graph: dict[str, frozenset[str]],
) -> None:
    """With everyone surviving, each seed share comes from the silo itself or one of its k
    neighbours, never from anyone else: asking a non-neighbour yields nothing of the target."""
    c = consortium(sparse_policy())
    coordinator = honest_round(c)
    revealed = coordinator.unmask(dict.fromkeys(SILOS, SILOS))
    assert sorted(revealed) == SILOS, coordinator.refusals
    for silo in SILOS:
        holders = {s for s, r in revealed.items() if REVEALED_SEED + silo in r.tensors}
        assert holders == graph[silo] | {silo}
        assert coordinator.rebuild(revealed, REVEALED_SEED + silo, T) is not None


def test_two_survivor_sets_do_not_pass_the_consistency_check() -> None:
    """Neighbourhood thresholds are small (t = 3), but what a silo reveals still waits for 7 of
    10 signatures over its own statement: half the silos told the target survived (to get its
    seed shares), half told it dropped (to get its key shares), each set signed by five."""
    c = consortium(sparse_policy())
    coordinator = honest_round(c)
    alive, dropped = SILOS[:-1], SILOS[1:]  # the target in one, not the other
    views = {s: alive for s in SILOS[:5]} | {s: dropped for s in SILOS[5:]}
    revealed = coordinator.unmask(views)
    assert revealed == {}
    assert all("consistency" in r for r in coordinator.refusals["unmask"].values())
    assert sparse_policy().secure_aggregation.consistency_threshold(len(SILOS)) == CONSISTENCY


def test_a_forged_advertisement_of_a_silo_that_is_not_a_neighbour_is_refused(
    graph: dict[str, frozenset[str]],
) -> None:
    """The target masks and shares with its neighbours only, yet it checks every advertisement:
    every advertised silo counts towards the group and may be declared a survivor carrying
    weight. A member the coordinator invented (keys it made for a silo that never took part)
    would let the weight rule pass with only the target carrying real weight, and with
    n - k >= t enough silos that never check that member's advertisement could sign the
    survivor set. So the invented member is refused, and the target shares nothing."""
    c = consortium(sparse_policy())
    coordinator = DeviatingCoordinator(c)
    adverts = coordinator.advertise(SILOS)
    stranger = min(s for s in SILOS if s not in graph[TARGET] | {TARGET})
    label = aggregation_label(DEPLOYMENT, coordinator.round, PHASE)
    forged = MaskingKeys.generate().advertise(stranger, SigningKey.generate(), label)
    shared = coordinator.share({TARGET: {**adverts, stranger: forged.to_bytes().hex()}})
    assert TARGET not in shared
    refusal = coordinator.refusals["share"][TARGET]
    assert stranger in refusal and "not signed by" in refusal
