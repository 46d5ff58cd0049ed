"""bench/secagg.py's and bench/flower_secagg_peer.py's "trained" workload: real local training
(256 samples per silo, one epoch), beside the default one-step workload. Nothing here times
anything."""

from __future__ import annotations

import numpy as np

from bench.flower_secagg_peer import minibatches
from bench.secagg import SAMPLES, WORKLOADS, bench_policy, silo_data


def test_the_trained_workload_gives_silos_256_samples_and_one_epoch() -> None:
    trained = WORKLOADS["trained"]
    data = silo_data("s00", 0, trained.samples)
    assert data.x_train.shape[0] == data.y_train.shape[0] == 256
    training = bench_policy("masking", [8], 3, 2, "trained").training
    assert (training.epochs, training.steps, training.batch_size) == (1, None, 64)


def test_the_default_workload_stays_one_step_of_8_out_of_32() -> None:
    assert silo_data("s00", 0).x_train.shape[0] == SAMPLES == 32
    training = bench_policy("masking", [8], 3, 2).training
    assert (training.epochs, training.steps, training.batch_size) == (None, 1, 8)


def test_flowers_trained_clients_pass_once_over_their_256_samples_in_batches_of_64() -> None:
    batches = minibatches(client=3, fits=1, workload="trained")
    assert [len(b) for b in batches] == [64, 64, 64, 64]
    assert np.array_equal(np.sort(np.concatenate(batches)), np.arange(256))
    step = minibatches(client=3, fits=1, workload="step")
    assert len(step) == 1 and len(step[0]) == 8
