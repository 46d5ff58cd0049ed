"""A silo's `SiloDataset` as safetensors bytes, and back, bit for bit.

A simulation backend that builds its silos in other processes (`ops/ray_backend.py`) sends each
silo its data this way: tensors as safetensors, the schema (name, task, classes, feature names,
input shape, domains, output width) as JSON in the safetensors header, so nothing is pickled.
"""

from __future__ import annotations

import json

from safetensors.torch import load, save

from fedsilo.silo.data.dataset import SiloDataset
from fedsilo.silo.errors import DataError

SPLITS = ("x_train", "y_train", "x_val", "y_val", "x_test", "y_test")
_DOMAIN = "domain:"  # prefix of a split's domain codes among the tensors
_SCHEMA = "fedsilo.dataset"  # the header's metadata key holding the schema


def encode_dataset(data: SiloDataset) -> bytes:
    """`data` as safetensors bytes (every split, the domain codes, the schema as metadata)."""
    tensors = {name: getattr(data, name).contiguous() for name in SPLITS}
    tensors.update({_DOMAIN + s: codes.contiguous() for s, codes in data.domain_codes.items()})
    schema = {
        "name": data.name,
        "task": data.task,
        "num_classes": data.num_classes,
        "feature_names": list(data.feature_names),
        "input_shape": list(data.input_shape),
        "domains": list(data.domains),
        "outputs": data.outputs,
    }
    return save(tensors, metadata={_SCHEMA: json.dumps(schema)})


def decode_dataset(blob: bytes) -> SiloDataset:
    """The `SiloDataset` that `encode_dataset` wrote into `blob`."""
    tensors = load(blob)
    try:
        schema = json.loads(_metadata(blob)[_SCHEMA])
    except (KeyError, ValueError) as exc:
        raise DataError(f"not an encoded silo dataset: {exc}") from exc
    return SiloDataset(
        name=schema["name"],
        **{name: tensors[name] for name in SPLITS},
        task=schema["task"],
        num_classes=schema["num_classes"],
        feature_names=tuple(schema["feature_names"]),
        input_shape=tuple(schema["input_shape"]),
        domains=tuple(schema["domains"]),
        domain_codes={
            name[len(_DOMAIN) :]: codes
            for name, codes in tensors.items()
            if name.startswith(_DOMAIN)
        },
        outputs=schema["outputs"],
    )


def _metadata(blob: bytes) -> dict[str, str]:
    """The metadata of a safetensors header (`load` returns only the tensors): the format is an
    8-byte little-endian header length, then the JSON header."""
    header_size = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + header_size])
    return header.get("__metadata__", {})
