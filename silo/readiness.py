"""What a silo checks before it accepts a job, beside its data: the policy's model builds on
this silo's data (a plug-in model: installed here and exactly as the policy pins it) and, under
DP-SGD, every layer can be trained privately (a BatchNorm is refused naming the layer, never
swapped). A simulation checks the same before its first round."""

from __future__ import annotations

from fedsilo.models.zoo import build_model
from fedsilo.policies.model import LogisticModel
from fedsilo.policies.schema import Policy
from fedsilo.silo.data import SiloDataset


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
    return sum(p.numel() for p in model.parameters())
