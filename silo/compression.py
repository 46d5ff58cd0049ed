"""A `train` answer's update quantized as the task says (`TrainTask.compression`, which the
silo's contract gate holds to the silo's own policy's `compression:` section): the last step
before the answer leaves, after DP-SGD's noise (in training) and client-level DP's clipping
(silo/client_dp.py), so it is post-processing of what the silo releases and books no
epsilon of its own. The rounding draws from the silo's secret and the task
(`SiloContext.private_seed`): a run repeats bit for bit, and the coordinator, which knows the
model it sent, cannot predict the draws and narrow down the update from them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fedsilo.wire.messages import TaskMessage
from fedsilo.wire.quantized import quantize
from fedsilo.wire.tasks import Quantization
from fedsilo.wire.tasks.tensor_names import MODEL, SCALES
from fedsilo.wire.tensors import ParameterSpec

if TYPE_CHECKING:  # the task context imports every handler, which import this module
    from fedsilo.silo.tasks.base import SiloContext


def compressed_model(
    message: TaskMessage,
    ctx: SiloContext,
    quantization: Quantization,
    received: torch.Tensor,
    trained: torch.Tensor,
    spec: ParameterSpec,
) -> dict[str, torch.Tensor]:
    """MODEL's update (trained - received) quantized, and its scales; under client-level DP
    the decoded update's norm stays within the clip (the rounding alone could exceed it)."""
    client_dp = ctx.privacy.client_dp
    q, scales = quantize(
        received,
        trained,
        quantization,
        [entry.numel for entry in spec.entries],
        ctx.noise_generator(message.task_id, "quantize"),
        norm_bound=None if client_dp is None else client_dp.clip,
    )
    return {MODEL: q, SCALES + MODEL: scales}
