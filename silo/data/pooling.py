"""The `central` reference's data: the union of the silos' already locally preprocessed splits."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fedsilo.silo.data.dataset import SiloDataset


def pool(silos: Sequence[SiloDataset], name: str = "pooled") -> SiloDataset:
    """The union of the silos' (already locally preprocessed) splits: what the `central`
    reference trains on."""
    if not silos:
        raise ValueError("cannot pool an empty list of silos")
    first = silos[0]
    for silo in silos[1:]:
        schema = (silo.task, silo.num_classes, silo.feature_names, silo.input_shape, silo.domains)
        if schema != (
            first.task,
            first.num_classes,
            first.feature_names,
            first.input_shape,
            first.domains,
        ):
            raise ValueError(f"silo '{silo.name}' does not share the schema of '{first.name}'")
    return SiloDataset(
        name=name,
        x_train=torch.cat([silo.x_train for silo in silos]),
        y_train=torch.cat([silo.y_train for silo in silos]),
        x_val=torch.cat([silo.x_val for silo in silos]),
        y_val=torch.cat([silo.y_val for silo in silos]),
        x_test=torch.cat([silo.x_test for silo in silos]),
        y_test=torch.cat([silo.y_test for silo in silos]),
        task=first.task,
        num_classes=first.num_classes,
        feature_names=first.feature_names,
        input_shape=first.input_shape,
        outputs=first.outputs,
        domains=first.domains,
        domain_codes={
            split: torch.cat([silo.domain_codes[split] for silo in silos])
            for split in first.domain_codes
        },
    )
