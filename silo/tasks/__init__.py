"""Silo task handlers, shared by many strategies and looked up by the task's `kind`, and what
each kind releases (`TASK_RELEASES`), which the agent books and checks against its budget."""

from __future__ import annotations

from fedsilo.silo.tasks.base import ReleasePlan, TaskHandler
from fedsilo.silo.tasks.ckks_sum import (
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
from fedsilo.silo.tasks.init import describe, initialise, public_release
from fedsilo.silo.tasks.scaling import feature_moments, moments_releases, standardise
from fedsilo.silo.tasks.secure_sum import (
    advertise,
    advertise_releases,
    confirm_survivors,
    masked_input,
    masked_input_releases,
    share,
    unmask,
)
from fedsilo.silo.tasks.superfed import (
    superfed_evaluate,
    superfed_evaluate_releases,
    superfed_train,
    superfed_train_releases,
)
from fedsilo.silo.tasks.train import train, train_releases

TASK_HANDLERS: dict[str, TaskHandler] = {
    "init": initialise,
    "schema": describe,
    "train": train,
    "evaluate": evaluate,
    "loss": report_loss,
    "feature_moments": feature_moments,
    "standardise": standardise,
    "secagg_advertise": advertise,
    "secagg_share": share,
    "secagg_mask": masked_input,
    "secagg_confirm": confirm_survivors,
    "secagg_unmask": unmask,
    "ckks_keygen": keygen,
    "ckks_join": join,
    "ckks_encrypt": encrypted_input,
    "ckks_decrypt": decrypted_sum,
    "daisy_train": daisy_train,
    "daisy_reseal": daisy_reseal,
    "daisy_receive": daisy_receive,
    "daisy_evaluate": daisy_evaluate,
    "superfed_train": superfed_train,
    "superfed_evaluate": superfed_evaluate,
    "energy_signals": energy_signals,
}

TASK_RELEASES: dict[str, ReleasePlan] = {
    "init": public_release,
    "schema": public_release,
    "train": train_releases,
    "evaluate": evaluate_releases,
    "loss": loss_releases,
    "feature_moments": moments_releases,
    "standardise": public_release,
    "secagg_advertise": advertise_releases,
    "secagg_share": public_release,
    "secagg_mask": masked_input_releases,
    "secagg_confirm": public_release,
    "secagg_unmask": public_release,
    "ckks_keygen": public_release,
    "ckks_join": join_releases,
    "ckks_encrypt": encrypted_input_releases,
    "ckks_decrypt": public_release,
    "daisy_train": daisy_train_releases,
    "daisy_reseal": public_release,  # the model just handed off, again: post-processing
    "daisy_receive": public_release,
    "daisy_evaluate": daisy_evaluate_releases,
    "superfed_train": superfed_train_releases,
    "superfed_evaluate": superfed_evaluate_releases,
    "energy_signals": energy_signals_releases,
}
