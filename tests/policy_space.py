"""Policies drawn across every axis of the schema, for the policy-space property tests
(tests/test_policy_space.py) and the longer `make fuzz` run.

Every section but `data` is drawn from its pydantic model itself (`section`): each field of
each model (and of each member of a tagged union: every algorithm, model, partition, learning
rate schedule) is left out or given a value its type and bounds allow, so a field added to the
schema is drawn without a change here. `COST` narrows the fields that set how much work a run
does (rounds, epochs, synthetic samples, hidden widths) to a size that runs in a second or
two; `FIXED` narrows the few free strings to the names they may hold. The data section comes
from a catalogue of sources (bundled tables, scikit-learn's, the bundled molecules, a
multi-site CSV with a natural partition and a domain column, an npz file, an installed data
plug-in), each with partitions and options drawn the same way.
"""

from __future__ import annotations

import math
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import annotated_types as at
import numpy as np
import pandas as pd
from hypothesis import strategies as st
from pydantic import BaseModel

from fedsilo.policies.algorithms import AlgorithmConfig
from fedsilo.policies.channel import ChannelConfig
from fedsilo.policies.compute import ComputeConfig
from fedsilo.policies.data import (
    DirichletPartition,
    IidPartition,
    LabelNoiseConfig,
    MoleculeOptions,
    QuantitySkewPartition,
    ScaffoldPartition,
    ShardsPartition,
    SplitConfig,
)
from fedsilo.policies.model import ModelConfig, ModelInit
from fedsilo.policies.privacy import PrivacyConfig
from fedsilo.policies.schema import ParticipantsConfig
from fedsilo.policies.secure_aggregation import SecureAggregationConfig
from fedsilo.policies.training import StepPlugin, TrainingConfig

Draw = st.SearchStrategy[Any]
SITES = ("north", "south", "east")  # the multi-site CSV's sites, one silo each
PLUGIN_LOADER = "fedsilo_example_plugins.data:digits_16x16"
# The plug-in networks a drawn policy may name: the example package's residual CNN (images)
# and the test fixtures' dropout network (any input; its factory is registered by the tests).
PLUGIN_FACTORIES = (
    "fedsilo_example_plugins.models:residual_cnn",
    "tests.plugin_fixtures:dropout_net",
)

# The fields that set how much a run computes, narrowed so that a drawn run takes seconds.
small_widths = st.lists(st.integers(1, 12), min_size=1, max_size=2)
COST: dict[str, Draw] = {
    "rounds": st.integers(1, 2),
    "eval_every": st.integers(1, 2),
    "epochs": st.just(1),
    "steps": st.integers(1, 3),
    "batch_size": st.sampled_from([1, 8, 32, 64]),
    "hidden": st.integers(0, 12),  # a width (cnn, mpnn)
    "hidden[]": small_widths,  # widths, one a layer (mlp, gcn, gat)
    "channels": st.lists(st.integers(1, 6), min_size=1, max_size=2),
    "heads": st.integers(1, 2),
    "samples_per_class": st.integers(1, 3),
    "classifier_epochs": st.integers(1, 2),
    "classifier_batch_size": st.sampled_from([8, 64]),
    "client_sgld_steps": st.integers(0, 2),
    "image_every": st.integers(1, 2),
    "support_points": st.integers(1, 8),
    "barycenter_rounds": st.integers(1, 2),
    "server_epochs": st.integers(0, 1),
    "server_batch_size": st.sampled_from([8, 64]),
    "adversarial_steps": st.integers(1, 2),
    "lambda_grid": st.integers(2, 4),
    "base_learners": st.integers(1, 3),
    "radon_iterations": st.integers(1, 2),
    "count_window": st.integers(1, 3),
    "silos_per_round": st.integers(1, 6),
    "phase_timeout_s": st.sampled_from([30.0, 600.0]),
    "max_consecutive_failed_rounds": st.integers(1, 3),
    "min_silos": st.integers(1, 5),
    "min_group": st.integers(2, 5),
    "threshold": st.integers(2, 6),
    "neighbours": st.integers(2, 5),
    "min_validation": st.integers(1, 30),
    "memory_mb": st.sampled_from([256, 4096]),
}
# Free strings: the names they may hold (and one they may not).
FIXED: dict[str, Draw] = {
    "device": st.sampled_from(["auto", "cpu", "cuda", "cuda:1"]),
    "key_holder": st.sampled_from(["Cleveland", "silo_0", "north", "nobody"]),
    "decryptor": st.sampled_from(["Hungary", "silo_1", "south", "nobody"]),
    "factory": st.sampled_from(PLUGIN_FACTORIES),
    "args": st.just({}),
    "architecture": st.none(),  # pinned by `fedsilo model pin` in the test, as a user does
    # CKKS parameter sets: the default, a small one, and one too small to hold a model's sum
    "ckks": st.sampled_from(
        [
            {},
            {
                "poly_modulus_degree": 4096,
                "coeff_mod_bit_sizes": [40, 20, 40],
                "global_scale_bits": 20,
            },
            {"poly_modulus_degree": 4096, "coeff_mod_bit_sizes": [30, 30], "global_scale_bits": 20},
        ]
    ),
    # DP-SGD: one of its two noise settings (drawn whole, the section mostly gives both or none)
    "dp_sgd": st.one_of(
        st.none(),
        st.fixed_dictionaries(
            {"noise_multiplier": st.floats(0.3, 3.0)},
            optional={"max_grad_norm": st.floats(0.1, 5.0), "poisson_sampling": st.booleans()},
        ),
        st.fixed_dictionaries(
            {"training_epsilon": st.floats(0.5, 50.0)},
            optional={"max_grad_norm": st.floats(0.1, 5.0), "poisson_sampling": st.booleans()},
        ),
        # no noise setting of its own: privacy.job_epsilon (drawn with the section) sets it
        st.fixed_dictionaries(
            {}, optional={"max_grad_norm": st.floats(0.1, 5.0), "poisson_sampling": st.booleans()}
        ),
    ),
}


# Sections never drawn (null): a warm start names the model file of an earlier run
# (tests/test_warm_start.py); a training step names an installed, pinned package
# (tests/test_research_plugins.py)
LEFT_OUT = (ModelInit, StepPlugin)


def section(model: Any, costs: dict[str, Draw] = COST) -> Draw:
    """A document for `model` (a policy model class, or a tagged union of them): each field
    left out or drawn from its annotation and bounds (`costs` and `FIXED` where they name it)."""
    members = _union_members(model)
    if members:
        return st.one_of(*(section(member, costs) for member in members))
    fields = {}
    for name, info in model.model_fields.items():
        listed = f"{name}[]" if _is_list(info.annotation) else name
        if name in FIXED:
            value = FIXED[name]
        elif listed in costs:
            value = costs[listed]
        else:
            value = _annotation(info.annotation, info.metadata, costs)
        if info.is_required():
            fields[name] = value
        else:
            fields[name] = st.one_of(st.just(_OMIT), value)
    return st.fixed_dictionaries(fields).map(
        lambda drawn: {k: v for k, v in drawn.items() if v is not _OMIT}
    )


_OMIT = object()


def _is_list(annotation: Any) -> bool:
    return get_origin(annotation) is list


def _union_members(annotation: Any) -> tuple[type[BaseModel], ...]:
    """The policy models of a (possibly annotated, possibly optional) union, else ()."""
    if get_origin(annotation) is typing.Annotated:
        annotation = get_args(annotation)[0]
    if get_origin(annotation) in (typing.Union, types.UnionType):
        return tuple(m for arg in get_args(annotation) for m in _union_members(arg) or _model(arg))
    return ()


def _model(annotation: Any) -> tuple[type[BaseModel], ...]:
    is_model = isinstance(annotation, type) and issubclass(annotation, BaseModel)
    return (annotation,) if is_model else ()


def _annotation(annotation: Any, metadata: list[Any], costs: dict[str, Draw]) -> Draw:
    origin = get_origin(annotation)
    if origin is typing.Annotated:
        inner, *more = get_args(annotation)
        return _annotation(inner, [*metadata, *more], costs)
    if origin is Literal:
        return st.sampled_from(get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*(_annotation(arg, metadata, costs) for arg in get_args(annotation)))
    if annotation is type(None):
        return st.none()
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return st.none() if annotation in LEFT_OUT else section(annotation, costs)
    if origin in (list, tuple):
        (item, *_) = get_args(annotation) or (int,)
        drawn = _annotation(item, [], costs)
        return st.lists(drawn, min_size=_min_length(metadata), max_size=2)
    if origin is dict or annotation is dict:
        return st.just({})
    if annotation is bool:
        return st.booleans()
    if annotation is int:
        low, high = _bounds(metadata)
        low = 0 if low is None else math.ceil(low)
        return st.integers(low, low + 4 if high is None else min(math.floor(high), low + 4))
    if annotation is float:
        return _floats(metadata)
    if annotation is str:
        return st.sampled_from(["x", "name"])
    return st.nothing()


def _floats(metadata: list[Any]) -> Draw:
    low, high = _bounds(metadata)
    open_low = any(isinstance(m, at.Gt) for m in metadata)
    open_high = any(isinstance(m, at.Lt) for m in metadata)
    low = 0.0 if low is None else float(low)
    high = low + 3.0 if high is None else float(high)
    plain = st.floats(low, high, exclude_min=open_low, exclude_max=open_high, allow_subnormal=False)
    ends = [v for v, open_ in ((low, open_low), (high, open_high)) if not open_]
    return st.one_of(plain, st.sampled_from(ends)) if ends else plain


def _bounds(metadata: list[Any]) -> tuple[float | None, float | None]:
    low = high = None
    for m in metadata:
        if isinstance(m, at.Ge | at.Gt):
            low = m.ge if isinstance(m, at.Ge) else m.gt
        if isinstance(m, at.Le | at.Lt):
            high = m.le if isinstance(m, at.Le) else m.lt
    return low, high


def _min_length(metadata: list[Any]) -> int:
    return max([m.min_length for m in metadata if isinstance(m, at.MinLen)] or [0])


# -- the data section ---------------------------------------------------------------------------


def partitions(*kinds: type[BaseModel], silos: int = 6) -> Draw:
    """None (the source's own), or one of `kinds` drawn as the schema allows (at most `silos`)."""
    narrowed = {**COST, "silos": st.integers(1, silos), "n_min": st.integers(1, 20)}
    return st.one_of(st.none(), *(section(kind, narrowed) for kind in kinds))


LABEL_SKEW = (IidPartition, DirichletPartition, ShardsPartition, QuantitySkewPartition)
options: dict[str, Draw] = {
    "split": st.one_of(st.just(_OMIT), st.just({"train": 0.6, "val": 0.2, "test": 0.2})),
    "scaling": st.one_of(st.just(_OMIT), st.sampled_from(["local", "federated", "none"])),
    "label_noise": st.one_of(st.just(_OMIT), section(LabelNoiseConfig)),
}


def data_sections(folder: Path) -> Draw:
    """A data section from the catalogue; files it reads are written into `folder`."""
    csv_path, npz_path, molecules_path = write_site_files(folder)
    catalogue = [
        _data({"source": "heart", "domain": st.one_of(st.just(_OMIT), st.just("sex"))},
              partition=partitions(*LABEL_SKEW)),
        _data({"source": "tcga_brca"}, partition=partitions(IidPartition), split=False),
        _data({"source": st.sampled_from(
            ["sklearn:breast_cancer", "sklearn:diabetes", "sklearn:wine", "sklearn:digits"])},
            partition=partitions(*LABEL_SKEW)),
        _data({"source": "molecules:esol",
               "molecules": st.one_of(st.just(_OMIT), section(MoleculeOptions).map(
                   lambda m: {k: v for k, v in m.items() if k != "smiles"}))},
              partition=partitions(ScaffoldPartition, IidPartition)),
        _data({"source": "molecules:csv", "path": str(molecules_path), "target": "solubility"},
              partition=partitions(ScaffoldPartition, IidPartition, silos=3)),
        _data({"source": "csv", "path": str(csv_path), "target": "outcome",
               "categorical": st.just({"sex": ["F", "M"], "site": list(SITES)}),
               "missing": st.sampled_from(["impute", "drop", "error"]),
               "domain": st.one_of(st.just(_OMIT), st.just("sex"))},
              partition=st.one_of(st.just({"kind": "natural", "column": "site"}),
                                  partitions(*LABEL_SKEW, silos=4))),
        _data({"source": "npz", "path": str(npz_path)}, partition=partitions(*LABEL_SKEW)),
        _data({"source": "plugin", "loader": PLUGIN_LOADER, "args": st.just({"rows": 240})},
              partition=partitions(IidPartition, DirichletPartition)),
    ]  # fmt: skip
    return st.one_of(*catalogue)


def _data(fields: dict[str, Any], partition: Draw, split: bool = True) -> Draw:
    drawn = {k: v if isinstance(v, st.SearchStrategy) else st.just(v) for k, v in fields.items()}
    drawn["partition"] = partition
    drawn.update({k: v for k, v in options.items() if split or k != "split"})
    if "split" in drawn:
        drawn["split"] = st.one_of(st.just(_OMIT), _splits(), _splits(), section(SplitConfig))
    return st.fixed_dictionaries(drawn).map(
        lambda d: {k: v for k, v in d.items() if v is not _OMIT and v is not None}
    )


@st.composite
def _splits(draw: st.DrawFn) -> dict[str, float]:
    """Fractions that sum to one (the drawn section's rarely do)."""
    train = draw(st.floats(0.05, 0.95))
    val = draw(st.floats(0.0, 0.95 - train))
    return {"train": train, "val": val, "test": 1.0 - train - val}


def write_site_files(folder: Path) -> tuple[Path, Path, Path]:
    """The catalogue's files: a three-site CSV (a `site` column, a categorical `sex` that is
    also a domain, two numeric columns with a few gaps, a binary `outcome`), an npz image set
    and a CSV of molecules; the same bytes every time."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    n = 180
    age = rng.normal(55, 10, n).round(1)
    pressure = rng.normal(130, 15, n).round(0)
    age[rng.choice(n, 6, replace=False)] = np.nan
    sex = rng.choice(["F", "M"], n)
    risk = 0.08 * (age - 55) + 0.05 * (pressure - 130) + (sex == "M") * 0.7
    frame = pd.DataFrame(
        {
            "site": np.repeat(SITES, n // len(SITES)),
            "sex": sex,
            "age": age,
            "pressure": pressure,
            "outcome": (np.nan_to_num(risk) + rng.normal(0, 1, n) > 0).astype(int),
        }
    )
    csv_path = folder / "sites.csv"
    frame.to_csv(csv_path, index=False)
    npz_path = folder / "images.npz"
    x = rng.random((160, 1, 6, 6)).astype(np.float32)
    np.savez(npz_path, x=x, y=(x.mean(axis=(1, 2, 3)) > 0.5).astype(np.int64))
    molecules = pd.DataFrame(
        {
            "smiles": ["CCO", "CCCO", "CCCCO", "c1ccccc1", "c1ccccc1O", "CC(=O)O", "CCN",
                       "CCCN", "c1ccncc1", "C1CCCCC1", "CC(C)O", "OCCO"] * 4,
            "solubility": rng.normal(0, 1, 48).round(3),
        }
    )  # fmt: skip
    molecules_path = folder / "molecules.csv"
    molecules.to_csv(molecules_path, index=False)
    return csv_path, npz_path, molecules_path


# -- a whole policy -----------------------------------------------------------------------------


def policies(folder: Path) -> Draw:
    """A policy document across every axis: each section drawn from its model (`section`),
    the data from the catalogue (`data_sections`)."""
    sections: dict[str, Draw] = {
        "algorithm": section(AlgorithmConfig),
        "model": section(ModelConfig),
        "training": section(TrainingConfig),
        "participants": section(ParticipantsConfig),
        "compute": section(ComputeConfig),
        "privacy": _privacy(),
        "secure_aggregation": _secure_aggregation(),
        "channel": section(ChannelConfig),
    }
    optional = {
        name: st.one_of(st.just(_OMIT), drawn, drawn, drawn) for name, drawn in sections.items()
    }
    return st.fixed_dictionaries(
        {
            "version": st.just(1),
            "seed": st.integers(0, 2**32 - 1),
            "rounds": COST["rounds"],
            "eval_every": st.one_of(st.just(_OMIT), COST["eval_every"]),
            "data": data_sections(folder),
            **optional,
        }
    ).map(lambda d: {k: v for k, v in d.items() if v is not _OMIT})


def _privacy() -> Draw:
    """DP-SGD, client DP and noised reports each on or off, with their settings drawn."""
    return st.one_of(st.just({}), section(PrivacyConfig))


def _secure_aggregation() -> Draw:
    """Mostly one of the two methods on (a bare method, or the section drawn)."""
    methods = st.sampled_from(["none", "masking", "ckks"])
    return st.one_of(methods, section(SecureAggregationConfig))


def plugin_factory(document: dict[str, Any]) -> str | None:
    """The factory of a drawn plugin model, or None."""
    model = document.get("model") or {}
    return model.get("factory") if model.get("name") == "plugin" else None
