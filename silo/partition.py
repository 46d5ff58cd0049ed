"""Simulation partitioners and label-noise injection: pure numpy functions.

A partitioner turns "n rows" (or their labels, or a column) into silos: one array of row
indices per silo, disjoint, together covering every row they were given. The noise functions
corrupt labels the way the federated-learning literature does, to simulate unreliable silos.

Every function is deterministic given its `numpy.random.Generator`, returns new arrays and
never mutates its inputs. Indices inside a silo are sorted ascending.
"""

from __future__ import annotations

import numpy as np

MAX_DIRICHLET_ATTEMPTS = 1000


SHARD_DRAWS = 1000  # deals of shards tried before one with repeated labels is accepted


def _round_half_up(value: float) -> int:
    return int(np.floor(value + 0.5))


def _split_at(order: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    """Cut `order` into consecutive parts of the given sizes, each sorted."""
    cuts = np.cumsum(sizes)[:-1]
    return [np.sort(part) for part in np.split(order, cuts)]


def iid(n: int, silos: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffle the `n` row indices and cut them into `silos` near-equal parts (sizes differ by
    at most one)."""
    if silos < 1:
        raise ValueError(f"silos must be at least 1, got {silos}")
    return [np.sort(part) for part in np.array_split(rng.permutation(n), silos)]


def _dirichlet_attempt(
    labels: np.ndarray, silos: int, alpha: float, rng: np.random.Generator
) -> list[np.ndarray]:
    parts: list[list[np.ndarray]] = [[] for _ in range(silos)]
    for label in np.unique(labels):
        rows = rng.permutation(np.flatnonzero(labels == label))
        proportions = rng.dirichlet(np.full(silos, alpha))
        cuts = (np.cumsum(proportions)[:-1] * len(rows)).astype(int)
        for part, chunk in zip(parts, np.split(rows, cuts), strict=True):
            part.append(chunk)
    return [np.sort(np.concatenate(part)).astype(np.int64) for part in parts]


def dirichlet_label_skew(
    labels: np.ndarray,
    silos: int,
    alpha: float,
    rng: np.random.Generator,
    min_size: int = 2,
) -> list[np.ndarray]:
    """Label-skewed silos (Hsu et al., 2019): for each class, the shares of its rows across
    the silos are drawn from Dir(alpha). Small alpha: each silo sees few classes; large alpha:
    every silo looks like the whole.

    A draw where some silo gets fewer than `min_size` rows is redrawn, at most
    MAX_DIRICHLET_ATTEMPTS times; then ValueError.
    """
    if silos < 1:
        raise ValueError(f"silos must be at least 1, got {silos}")
    if alpha <= 0:
        raise ValueError(f"alpha must be positive, got {alpha}")
    if len(labels) < silos * min_size:
        raise ValueError(
            f"{len(labels)} rows cannot give each of {silos} silos at least {min_size} rows"
        )
    for _ in range(MAX_DIRICHLET_ATTEMPTS):
        parts = _dirichlet_attempt(np.asarray(labels), silos, alpha, rng)
        if min(len(part) for part in parts) >= min_size:
            return parts
    raise ValueError(
        f"a Dirichlet partition with alpha={alpha} left some of the {silos} silos with fewer "
        f"than {min_size} rows in {MAX_DIRICHLET_ATTEMPTS} draws; raise alpha, or lower the "
        "number of silos or min_size"
    )


def label_shards(
    labels: np.ndarray, silos: int, shards_per_silo: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """The pathological split of McMahan et al. (SuPerFed's experiments): rows ordered by label
    (at random within a label) are cut into silos * shards_per_silo equal shards, and each silo
    gets `shards_per_silo` of them at random, redrawn until no silo holds two shards of one
    label where the labels allow it (a shard that straddles two labels counts as its first).
    """
    shards = silos * shards_per_silo
    if shards > len(labels):
        raise ValueError(f"{shards} shards need at least {shards} rows, the data has {len(labels)}")
    order = np.lexsort((rng.random(len(labels)), labels))
    pieces = np.array_split(order, shards)
    first_label = np.array([labels[piece[0]] for piece in pieces])
    for _ in range(SHARD_DRAWS):
        dealt = rng.permutation(shards).reshape(silos, shards_per_silo)
        if all(len(set(first_label[row])) == shards_per_silo for row in dealt):
            break
    return [np.sort(np.concatenate([pieces[i] for i in row])) for row in dealt]


def quantity_skew_sizes(n: int, silos: int, small_fraction: float, n_min: int) -> list[int]:
    """Silo sizes of the FedDC "realistic sizes" scheme, with the formula corrected to sum to n.

    floor(small_fraction * silos) small silos get `n_min` rows; the other M' silos get
    n_min + a' * i rows for i = 0..M'-1, with a' = 2 (n - silos * n_min) / (M' (M' - 1)),
    floored; the rounding remainder goes to the largest silo. With M' = 1 that silo gets
    every row the small ones do not.
    """
    if silos < 1:
        raise ValueError(f"silos must be at least 1, got {silos}")
    if not 0 <= small_fraction < 1:
        raise ValueError(f"small_fraction must be in [0, 1), got {small_fraction}")
    if n < silos * n_min:
        raise ValueError(
            f"{n} rows are too few for {silos} silos of at least n_min={n_min} rows each"
        )
    small = int(np.floor(small_fraction * silos))
    large = silos - small
    spare = n - silos * n_min
    if large == 1:
        growth = [spare]
    else:
        # floor(a' * i) in exact integer arithmetic: a' * i = 2 * spare * i / (M' (M' - 1)).
        growth = [2 * spare * i // (large * (large - 1)) for i in range(large)]
    sizes = [n_min] * small + [n_min + extra for extra in growth]
    sizes[-1] += n - sum(sizes)
    return sizes


def quantity_skew(
    n: int, silos: int, small_fraction: float, n_min: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Shuffled row indices cut into the sizes of `quantity_skew_sizes` (small silos first,
    then increasing)."""
    sizes = quantity_skew_sizes(n, silos, small_fraction, n_min)
    return _split_at(rng.permutation(n), sizes)


def by_column(values: np.ndarray) -> dict[str, np.ndarray]:
    """One silo per distinct value, named by the value as a string, in order of first
    appearance."""
    keys = np.asarray(values).astype(str)
    distinct, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    return {
        str(distinct[code]): np.flatnonzero(inverse == code).astype(np.int64)
        for code in np.argsort(first)
    }


def by_group(groups: np.ndarray, silos: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Whole groups (e.g. molecular scaffolds) dealt to `silos` silos, no group in two: the
    groups largest first (equal sizes in random order), each to the silo with the fewest rows
    so far (the lowest index among equals). Fewer groups than silos is an error."""
    keys = np.asarray(groups).astype(str)
    distinct, inverse = np.unique(keys, return_inverse=True)
    if len(distinct) < silos:
        raise ValueError(f"{len(distinct)} groups cannot fill {silos} silos")
    sizes = np.bincount(inverse, minlength=len(distinct))
    shuffled = rng.permutation(len(distinct))
    order = shuffled[np.argsort(-sizes[shuffled], kind="stable")]
    members: list[list[int]] = [[] for _ in range(silos)]
    held = np.zeros(silos, dtype=np.int64)
    for group in order:
        silo = int(np.argmin(held))
        members[silo].append(int(group))
        held[silo] += sizes[group]
    return [np.flatnonzero(np.isin(inverse, chosen)).astype(np.int64) for chosen in members]


def flip_labels(
    y: np.ndarray, num_classes: int, probability: float, rng: np.random.Generator
) -> np.ndarray:
    """Each label, with the given probability, replaced by a uniformly random different class."""
    if num_classes < 2:
        raise ValueError(f"flipping labels needs at least 2 classes, got {num_classes}")
    y = np.asarray(y)
    flip = rng.random(y.shape) < probability
    offset = rng.integers(1, num_classes, size=y.shape)
    return np.where(flip, (y + offset) % num_classes, y).astype(y.dtype)


def add_label_noise(
    y: np.ndarray, probability: float, std: float, rng: np.random.Generator
) -> np.ndarray:
    """Regression targets, each with N(0, std^2) added with the given probability (as in the
    DRFLM experiments). Returns floats."""
    y = np.asarray(y, dtype=np.float64)
    noisy = rng.random(y.shape) < probability
    noise = rng.normal(0.0, std, size=y.shape)
    return y + np.where(noisy, noise, 0.0)


def noisy_silos(silos: int, fraction: float, rng: np.random.Generator) -> np.ndarray:
    """Sorted indices of the round(fraction * silos) silos (half up, at least 1) chosen at
    random to receive label noise."""
    count = min(silos, max(1, _round_half_up(fraction * silos)))
    return np.sort(rng.choice(silos, size=count, replace=False))
