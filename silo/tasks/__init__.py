"""Every task kind a silo runs, registered once (`TASK_KINDS`): its handler and what it
releases (which the agent books and checks against its budget). What it sends, which the
release gate checks against the policy's secure aggregation, is its kind's on the wire (the
config's `SENDS`, wire/tasks/release.py). A kind missing here is refused."""

from __future__ import annotations

from fedsilo.silo.tasks.base import TaskKind
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
    "init": TaskKind(initialise, public_release),
    "schema": TaskKind(describe, public_release),
    "train": TaskKind(train, train_releases),
    # metrics (noisy reports under DP)
    "evaluate": TaskKind(evaluate, evaluate_releases),
    "loss": TaskKind(report_loss, loss_releases),
    # exact sums of the silo's features
    "feature_moments": TaskKind(feature_moments, moments_releases),
    "standardise": TaskKind(standardise, public_release),
    "secagg_advertise": TaskKind(advertise, advertise_releases),
    "secagg_share": TaskKind(share, public_release),
    "secagg_mask": TaskKind(masked_input, masked_input_releases),
    "secagg_confirm": TaskKind(confirm_survivors, public_release),
    "secagg_unmask": TaskKind(unmask, unmask_releases),
    "ckks_keygen": TaskKind(keygen, public_release),
    "ckks_join": TaskKind(join, join_releases),
    "ckks_encrypt": TaskKind(encrypted_input, encrypted_input_releases),
    "ckks_confirm": TaskKind(confirm_contributors, public_release),
    "ckks_decrypt": TaskKind(decrypted_sum, public_release),
    "daisy_train": TaskKind(daisy_train, daisy_train_releases),
    "daisy_receive": TaskKind(daisy_receive, public_release),
    "daisy_evaluate": TaskKind(daisy_evaluate, daisy_evaluate_releases),
    "superfed_train": TaskKind(superfed_train, superfed_train_releases, leaves=superfed_trained),
    "superfed_evaluate": TaskKind(superfed_evaluate, superfed_evaluate_releases),
    # s * g per synthetic point: a gradient
    "energy_signals": TaskKind(energy_signals, energy_signals_releases),
    "scaffold_train": TaskKind(scaffold_train, scaffold_train_releases),
    # point clouds built from the silo's records: data, opted into by the policy, never a model
    "feddro_support": TaskKind(feddro_support, feddro_support_releases),
    "feddro_train": TaskKind(feddro_train, feddro_train_releases),
    # MultiBoost's loss and edge sums, or held-out metrics (noisy reports under DP)
    "boost_probe": TaskKind(boost_probe, boost_probe_releases),
}
