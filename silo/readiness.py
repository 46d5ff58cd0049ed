"""What a silo checks before it accepts a job, beside its data: the policy's model builds on
this silo's data (a plug-in model: installed here and exactly as the policy pins it) and, under
DP-SGD, every layer can be trained privately (a BatchNorm is refused naming the layer, never
swapped); a training step plug-in is installed here as the policy pins it and, under DP-SGD,
asks for nothing DP-SGD cannot account for (silo/training_step.py). A simulation checks the
same before its first round."""

from __future__ import annotations

from fedsilo.models.zoo import build_model
from fedsilo.policies.model import LogisticModel
from fedsilo.policies.schema import Policy
from fedsilo.silo.data import SiloDataset
from fedsilo.silo.training_step import TrainingStepError, dp_sgd_problem, load_step


def check_model_for(policy: Policy, data: SiloDataset) -> int:
    """The number of parameters of the policy's model for `data`; raise (PluginError,
    DpSgdError or ValueError, each naming what is wrong) unless that model can be trained on
    `data` under the policy's privacy section."""
    if isinstance(policy.model, LogisticModel) and (
        data.task != "classification" or data.num_classes != 2
    ):
        classes = f" of {data.num_classes} classes" if data.task == "classification" else ""
        raise ValueError(
            f"model.name: 'logistic' is for binary classification only; this data is a "
            f"{data.task} task{classes} (use 'linear')"
        )
    model = build_model(policy.model, data.input_shape, data.output_dim, policy.seed)
    if policy.privacy.dp_sgd is not None:
        from fedsilo.silo.dp_training import check_model as check_dp_model  # Opacus: seconds

        check_dp_model(model)
    if policy.training.step is not None:
        step = load_step(policy.training.step)
        problem = dp_sgd_problem(step, policy.privacy)
        if problem is not None:
            raise TrainingStepError(problem)
    return sum(p.numel() for p in model.parameters())
