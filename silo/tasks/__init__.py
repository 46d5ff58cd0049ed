"""Every task kind a silo runs, registered once (`TASK_KINDS`): its handler, what it releases
(which the agent books and checks against its budget) and what it sends (which the release
gate checks against the policy's secure aggregation). A kind missing here is refused."""

from __future__ import annotations

from fedsilo.silo.tasks.base import Release, TaskKind
from fedsilo.silo.tasks.ckks_sum import (
    confirm_contributors,
    decrypted_sum,
    encrypted_input,
    encrypted_input_releases,
    join,
    join_releases,
    keygen,
)
from fedsilo.silo.tasks.daisy import (
    daisy_evaluate,
    daisy_evaluate_releases,
    daisy_receive,
    daisy_reseal,
    daisy_train,
    daisy_train_releases,
)
from fedsilo.silo.tasks.energy import energy_signals, energy_signals_releases
from fedsilo.silo.tasks.evaluate import evaluate, evaluate_releases, loss_releases, report_loss
from fedsilo.silo.tasks.feddro import (
    feddro_support,
    feddro_support_releases,
    feddro_train,
    feddro_train_releases,
)
from fedsilo.silo.tasks.init import describe, initialise, public_release
from fedsilo.silo.tasks.multiboost import boost_probe, boost_probe_releases
from fedsilo.silo.tasks.scaffold import scaffold_train, scaffold_train_releases
from fedsilo.silo.tasks.scaling import feature_moments, moments_releases, standardise
from fedsilo.silo.tasks.secure_sum import (
    advertise,
    advertise_releases,
    confirm_survivors,
    masked_input,
    masked_input_releases,
    share,
    unmask,
    unmask_releases,
)
from fedsilo.silo.tasks.superfed import (
    superfed_evaluate,
    superfed_evaluate_releases,
    superfed_train,
    superfed_train_releases,
    superfed_trained,
)
from fedsilo.silo.tasks.train import train, train_releases

TASK_KINDS: dict[str, TaskKind] = {
    # the seed's model, independent of the data
    "init": TaskKind(initialise, public_release, Release.NOTHING_PRIVATE),
    "schema": TaskKind(describe, public_release, Release.NOTHING_PRIVATE),
    "train": TaskKind(train, train_releases, Release.IN_THE_CLEAR),
    # metrics (noisy reports under DP)
    "evaluate": TaskKind(evaluate, evaluate_releases, Release.NOTHING_PRIVATE),
    "loss": TaskKind(report_loss, loss_releases, Release.NOTHING_PRIVATE),
    # exact sums of the silo's features
    "feature_moments": TaskKind(feature_moments, moments_releases, Release.IN_THE_CLEAR),
    "standardise": TaskKind(standardise, public_release, Release.NOTHING_PRIVATE),
    "secagg_advertise": TaskKind(advertise, advertise_releases, Release.MASKED),
    "secagg_share": TaskKind(share, public_release, Release.MASKED),
    "secagg_mask": TaskKind(masked_input, masked_input_releases, Release.MASKED),
    "secagg_confirm": TaskKind(confirm_survivors, public_release, Release.MASKED),
    "secagg_unmask": TaskKind(unmask, unmask_releases, Release.MASKED),
    "ckks_keygen": TaskKind(keygen, public_release, Release.ENCRYPTED),
    "ckks_join": TaskKind(join, join_releases, Release.ENCRYPTED),
    "ckks_encrypt": TaskKind(encrypted_input, encrypted_input_releases, Release.ENCRYPTED),
    "ckks_confirm": TaskKind(confirm_contributors, public_release, Release.ENCRYPTED),
    "ckks_decrypt": TaskKind(decrypted_sum, public_release, Release.ENCRYPTED),
    "daisy_train": TaskKind(daisy_train, daisy_train_releases, Release.SEALED_HANDOFF),
    # the model just handed off, again: post-processing
    "daisy_reseal": TaskKind(daisy_reseal, public_release, Release.SEALED_HANDOFF),
    "daisy_receive": TaskKind(daisy_receive, public_release, Release.NOTHING_PRIVATE),
    "daisy_evaluate": TaskKind(daisy_evaluate, daisy_evaluate_releases, Release.NOTHING_PRIVATE),
    "superfed_train": TaskKind(
        superfed_train, superfed_train_releases, Release.IN_THE_CLEAR, superfed_trained
    ),
    "superfed_evaluate": TaskKind(
        superfed_evaluate, superfed_evaluate_releases, Release.NOTHING_PRIVATE
    ),
    # s * g per synthetic point: a gradient
    "energy_signals": TaskKind(energy_signals, energy_signals_releases, Release.IN_THE_CLEAR),
    "scaffold_train": TaskKind(scaffold_train, scaffold_train_releases, Release.IN_THE_CLEAR),
    # point clouds built from the silo's records: data, opted into by the policy, never a model
    "feddro_support": TaskKind(feddro_support, feddro_support_releases, Release.DATA),
    "feddro_train": TaskKind(feddro_train, feddro_train_releases, Release.IN_THE_CLEAR),
    # MultiBoost's loss and edge sums, or held-out metrics (noisy reports under DP)
    "boost_probe": TaskKind(boost_probe, boost_probe_releases, Release.NOTHING_PRIVATE),
}
