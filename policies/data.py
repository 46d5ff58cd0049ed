"""The policy's `data:` section: where the rows come from, how they become silos, how each silo
splits them, and which silos get noisy labels.

Sources:
  heart                  the bundled UCI heart-disease table, four hospitals (natural silos)
  tcga_brca              the bundled TCGA-BRCA clinical survival table (FLamby's Fed-TCGA-BRCA):
                         1,088 patients in six regions (natural silos), each with its static
                         train/test split (column `split`)
  molecules:esol, molecules:freesolv, molecules:lipophilicity
                         the bundled MoleculeNet regression sets, each SMILES featurised with
                         RDKit into a molecular graph (silo/data/molecules.py; `molecules:`
                         options), for the graph models (gcn, gat, mpnn)
  sklearn:breast_cancer, sklearn:diabetes, sklearn:digits, sklearn:wine
                         scikit-learn's bundled datasets (no download)
  molecules:csv          a site's own CSV file of molecules at `path`: a SMILES column
                         (`molecules.smiles`, default "smiles") featurised as the bundled sets,
                         and the regression target in column `target`
  csv                    a CSV file at `path`, with the label in column `target`
  npz                    a NumPy .npz file at `path` holding arrays named "x" (features, 2-D or
                         image-shaped) and "y" (labels)
  plugin                 what an installed data plug-in returns: `loader` is the value of an
                         entry point of group `fedsilo.datasets` ("module:attr"), called with
                         `args` (silo/data/plugins.py); only a registered loader is ever loaded

Tasks: classification, regression, survival (targets (time, event), Cox partial likelihood,
concordance index; silo/data/survival.py), or a task plug-in named by the value of its entry
point of group `fedsilo.tasks` ("module:attr", silo/data/plugins.py `TaskPlugin`).

Splits: fractions of each silo's rows drawn at random (`split: {train, val, test}`), or each
row's split read from a column of the source (`split: {column: NAME}`, values train/val/test).
Missing values: refused (`error`), imputed locally at each silo (`impute`), or the rows holding
one dropped (`drop`, after `drop_columns` are dropped).

Everything here is a fact agreed by the consortium before any row is read (the data dictionary:
category lists, missing-value markers); no statistic of the data appears in a policy.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from fedsilo.policies.base import PolicyModel, closest

SKLEARN_SOURCES = (
    "sklearn:breast_cancer",
    "sklearn:diabetes",
    "sklearn:digits",
    "sklearn:wine",
)
FILE_SOURCES = ("csv", "npz")
# Each bundled molecular set: its file (silo/datasets/molecules/), SMILES column, target column.
MOLECULE_SOURCES: dict[str, tuple[str, str, str]] = {
    "molecules:esol": ("esol", "smiles", "measured log solubility in mols per litre"),
    "molecules:freesolv": ("freesolv", "smiles", "expt"),
    "molecules:lipophilicity": ("lipophilicity", "smiles", "lipo"),
}
# A site's own molecules: a CSV file with a SMILES column and a target column.
MOLECULE_CSV = "molecules:csv"
# Every source whose rows are molecules (featurised into graphs, scaffold partitions allowed).
MOLECULAR_SOURCES = (*MOLECULE_SOURCES, MOLECULE_CSV)
# The sources that read a file at `path`, and those that name their label column `target`.
PATH_SOURCES = (*FILE_SOURCES, MOLECULE_CSV)
TARGET_SOURCES = ("csv", MOLECULE_CSV)
PLUGIN_SOURCE = "plugin"
BUNDLED_SOURCES = ("heart", "tcga_brca")
SOURCES = (
    *BUNDLED_SOURCES,
    *SKLEARN_SOURCES,
    *MOLECULAR_SOURCES,
    *FILE_SOURCES,
    PLUGIN_SOURCE,
)
# The sources a site reads as its own data: one silo unless the section partitions them.
SITE_SOURCES = (*PATH_SOURCES, PLUGIN_SOURCE)
SURVIVAL = "survival"
BUILTIN_TASKS = ("classification", "regression", SURVIVAL)

# The task each built-in source is; csv and npz infer theirs from the target unless told.
KNOWN_TASKS: dict[str, str] = {
    "heart": "classification",
    "tcga_brca": SURVIVAL,
    "sklearn:breast_cancer": "classification",
    "sklearn:diabetes": "regression",
    "sklearn:digits": "classification",
    "sklearn:wine": "classification",
    **dict.fromkeys(MOLECULAR_SOURCES, "regression"),
}
DEFAULT_SILOS = 4
HEART_SILO_COLUMN = "dataset"
TCGA_SILO_COLUMN = "region"
TCGA_SPLIT_COLUMN = "split"
# A split column's values, and which split each names.
SPLIT_VALUES = ("train", "val", "test")


class NaturalPartition(PolicyModel):
    """One silo per distinct value of `column` (e.g. the hospital a record comes from)."""

    # natural: one silo per distinct value of a column of the source (e.g. the hospital a record
    # comes from)
    kind: Literal["natural"]
    # the column whose values name the silos (e.g. dataset for the bundled heart table, region for
    # tcga_brca)
    column: str


class IidPartition(PolicyModel):
    """Rows shuffled and dealt into `silos` near-equal silos."""

    # iid: rows shuffled and dealt into near-equal silos
    kind: Literal["iid"]
    # how many silos the rows are dealt into
    silos: int = Field(ge=1)


class DirichletPartition(PolicyModel):
    """Label skew: each class's rows shared across silos by Dir(alpha); small alpha, more skew.

    A draw leaving some silo with fewer than `min_size` rows is redrawn (a bounded number of
    times, then an error).
    """

    # dirichlet: label skew, each class's rows shared across silos by a Dirichlet draw
    kind: Literal["dirichlet"]
    # how many silos the rows are dealt into
    silos: int = Field(ge=1)
    # the Dirichlet concentration: small values (e.g. 0.1) give each silo few classes, large ones
    # (e.g. 100) near-even shares (required)
    alpha: float = Field(gt=0)
    # the fewest rows any silo may get; a draw that leaves a silo fewer is redrawn, a bounded number
    # of times, then refused (2 by default)
    min_size: int = Field(default=2, ge=1)


class ShardsPartition(PolicyModel):
    """Pathological label skew (McMahan et al.): rows sorted by label cut into equal shards,
    `shards_per_silo` per silo at random, so each silo holds about that many labels (2 by
    default; a shard that straddles two labels gives its silo one more)."""

    # shards: pathological label skew, label-sorted rows cut into equal shards dealt at random
    kind: Literal["shards"]
    # how many silos the rows are dealt into
    silos: int = Field(ge=1)
    # how many shards each silo gets, so about how many labels it holds (2 by default)
    shards_per_silo: int = Field(default=2, ge=1)


class QuantitySkewPartition(PolicyModel):
    """FedDC "realistic sizes": a `small_fraction` of the silos get `n_min` rows, the rest
    linearly increasing sizes. `total`: use only that many rows of the source, drawn at random
    (default: all)."""

    # quantity_skew: FedDC's realistic sizes, a few small silos and the rest of linearly increasing
    # sizes
    kind: Literal["quantity_skew"]
    # how many silos the rows are dealt into (at least 2)
    silos: int = Field(ge=2)
    # the share of the silos that get only n_min rows, from 0 up to (not including) 1
    small_fraction: float = Field(ge=0, lt=1)
    # the rows each small silo gets
    n_min: int = Field(ge=1)
    # use only this many rows of the source, drawn at random; null (the default): every row
    total: int | None = Field(default=None, ge=1)


class ScaffoldPartition(PolicyModel):
    """Molecules grouped by Bemis-Murcko scaffold, no scaffold in two silos (a `molecules:`
    source only): the groups, largest first (equal sizes in a seeded random order), each to the
    silo holding the fewest molecules so far."""

    # scaffold: molecules grouped by Bemis-Murcko scaffold, no scaffold in two silos (a molecules:
    # source only)
    kind: Literal["scaffold"]
    # how many silos the rows are dealt into
    silos: int = Field(ge=1)


Partition = Annotated[
    NaturalPartition
    | IidPartition
    | DirichletPartition
    | ShardsPartition
    | QuantitySkewPartition
    | ScaffoldPartition,
    Field(discriminator="kind"),
]


class SplitConfig(PolicyModel):
    """The fractions of each silo's rows used for training, validation and test; or, with
    `column`, the column of the source whose value (train, val or test) is each row's split
    (a predefined split, e.g. a benchmark's; the column is not a feature)."""

    # the share of each silo's rows used for training (0.8 by default); train, val and test sum to 1
    train: float = Field(default=0.8, gt=0, le=1)
    # the share used for validation (0.1 by default; 0: none)
    val: float = Field(default=0.1, ge=0, le=1)
    # the share held out for the test metrics (0.1 by default)
    test: float = Field(default=0.1, gt=0, le=1)
    # a column of the source whose value (train, val or test) is each row's split, instead of the
    # fractions (a predefined split; the column is not a feature); null (the default): split at
    # random
    column: str | None = Field(default=None, min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _column_or_fractions(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("column") is not None:
            given = [name for name in ("train", "val", "test") if name in data]
            if given:
                raise ValueError(
                    f"column '{data['column']}' gives each row's split; drop the fractions "
                    f"({', '.join(given)}), or drop column to split at random"
                )
        return data

    @model_serializer(mode="wrap")
    def _as_written(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Either the column or the fractions, as a policy writes them (so a dump reloads)."""
        dumped = handler(self)
        if self.column is None:
            dumped.pop("column", None)
            return dumped
        return {"column": self.column}

    @model_validator(mode="after")
    def _fractions_sum_to_one(self) -> SplitConfig:
        total = self.train + self.val + self.test
        if not math.isclose(total, 1.0, rel_tol=0, abs_tol=1e-9):
            raise ValueError(
                f"train + val + test must sum to 1, got {self.train} + {self.val} + "
                f"{self.test} = {total:g}"
            )
        return self


class LabelNoiseConfig(PolicyModel):
    """Noisy labels at a `silo_fraction` of the silos (training rows only): each label flipped
    to another class with `probability` (classification), or given N(0, std^2) noise with
    `probability` (regression; `std` in target units)."""

    # the share of the silos whose training labels get noise (above 0, at most 1)
    silo_fraction: float = Field(gt=0, le=1)
    # the chance each training label of those silos is made noisy: flipped to another class
    # (classification) or given Gaussian noise (regression)
    probability: float = Field(ge=0, le=1)
    # the standard deviation of a regression label's noise, in target units (1 by default)
    std: float = Field(default=1.0, gt=0)


class MoleculeOptions(PolicyModel):
    """How a `molecules:` source's SMILES become graphs: at most `max_atoms` heavy atoms per
    molecule (the padded graph's size); a SMILES that does not parse, or a larger molecule,
    refused with its row named (`error`) or dropped and counted (`drop`). `smiles`: the column
    of a `molecules:csv` file that holds the SMILES (None: `smiles`; the bundled sets name
    their own)."""

    # the most heavy atoms per molecule, the size of the padded graph (64 by default, at most 256)
    max_atoms: int = Field(default=64, ge=1, le=256)
    # what happens to a SMILES that does not parse or a larger molecule: error (the default) refuses
    # it with its row named, drop skips and counts it
    invalid: Literal["error", "drop"] = "error"
    # the column of a molecules:csv file that holds the SMILES; null (the default): smiles (the
    # bundled sets name their own)
    smiles: str | None = Field(default=None, min_length=1)

    def smiles_column(self) -> str:
        """The column of a `molecules:csv` file that holds the SMILES."""
        return self.smiles or "smiles"


# The keys of a data section that only a simulation uses (one dataset dealt into many silos),
# and what each does: a site's data section in silo.yaml is a policy's without them.
SIMULATION_ONLY_KEYS: dict[str, str] = {
    "partition": "it deals one dataset into many silos",
    "label_noise": "it makes a share of a simulation's silos' labels noisy",
}
# The silo.yaml key a site's data section adds: which silo of a multi-silo source it is.
SITE_SELECT_KEY = "select"
SHAPE_GUIDE = "docs/how-to/site-data.md"


class DataConfig(PolicyModel):
    """The `data:` section of a policy (and of silo.yaml, less the keys only a simulation uses:
    `partition` and `label_noise`)."""

    # where the rows come from: a bundled data set, a site's own file at path (csv, npz,
    # molecules:csv), or an installed data plug-in (plugin); heart by default
    source: str = Field(default="heart", json_schema_extra={"enum": list(SOURCES)})
    # the file a csv, npz or molecules:csv source reads (in silo.yaml, relative to its folder);
    # null for every other source
    path: str | None = None
    # the label column of a csv or molecules:csv source (required for those, null for the others)
    target: str | None = None
    # what the model learns: classification, regression, survival, or a task plug-in's entry
    # point value ("module:attr"); null (the default): the bundled source's own task, or for csv
    # and npz the one the target's values suggest
    task: str | None = None
    # source plugin: the entry point value ("module:attr") of an installed data loader of group
    # fedsilo.datasets; null (the default) for every other source
    loader: str | None = None
    # keyword arguments passed to a plugin source's loader (none by default)
    args: dict[str, Any] = Field(default_factory=dict)
    # text columns of a csv source and each one's agreed categories, in order (e.g. smoker: [no,
    # yes]); every silo encodes them the same way (none by default)
    categorical: dict[str, list[str]] = Field(default_factory=dict)
    # what happens to missing values: error refuses them, impute fills them in at each silo from its
    # own rows, drop drops the rows holding one; error by default (impute for the bundled heart
    # table)
    missing: Literal["error", "impute", "drop"] = "error"
    # values per column that mean "not measured" and are treated as missing (e.g. chol: [0]); none
    # by default
    missing_values: dict[str, list[float]] = Field(default_factory=dict)
    # columns that are not features (e.g. a patient id), dropped before anything else (none by
    # default)
    drop_columns: list[str] = Field(default_factory=list)
    # how one data set is dealt into many silos (a simulation); null (the default): heart one silo
    # per hospital, tcga_brca one per region, any other source iid into 4 silos (at a site, its
    # own file is one silo)
    partition: Partition | None = None
    # how each silo's rows are split into training, validation and test rows (0.8, 0.1, 0.1 at
    # random by default)
    split: SplitConfig = Field(default_factory=SplitConfig)
    # noisy labels at a share of the silos, for studying robustness (a simulation only); null (the
    # default): none
    label_noise: LabelNoiseConfig | None = None
    # A `molecules:` source's featurisation options (silo/data/molecules.py).
    molecules: MoleculeOptions | None = None
    # A categorical column whose value is each row's domain (e.g. sex, or the scanner), for the
    # algorithms that weight domains (agnostic_fedavg with domains: data, approx_fedavg).
    # Its declared categories are the domain names every silo agrees on; it stays a feature.
    domain: str | None = None
    # local: each silo standardises with its own training statistics (nothing crosses silos).
    # federated: each silo imputes locally; the features are then standardised with the
    # consortium's mean and variance, aggregated from per-silo moments before training. Under
    # label skew, local statistics erase the class signal (a mostly-positive silo centres on
    # the positive class); federated scaling keeps one feature space for every silo.
    # none: features as the source gives them (after local imputation), e.g. pixels in [0, 1]
    # for FedEvg, whose synthetic images live in [0, 1].
    scaling: Literal["local", "federated", "none"] = "local"

    @model_validator(mode="before")
    @classmethod
    def _not_a_silo_select(cls, data: Any) -> Any:
        """silo.yaml's `select` pasted into a policy: refused naming the file it belongs in."""
        if isinstance(data, dict) and SITE_SELECT_KEY in data:
            raise ValueError(
                f"field '{SITE_SELECT_KEY}' belongs in silo.yaml (which silo of the data a site "
                f"is); a policy's data section describes every silo: drop it ({SHAPE_GUIDE})"
            )
        return data

    @model_validator(mode="before")
    @classmethod
    def _heart_imputes_by_default(cls, data: Any) -> Any:
        """The bundled heart table is known to have gaps at every hospital: impute unless told."""
        if isinstance(data, dict) and data.get("source", "heart") == "heart":
            return {"missing": "impute", **data}
        return data

    @model_validator(mode="before")
    @classmethod
    def _tcga_splits_as_published(cls, data: Any) -> Any:
        """The bundled TCGA-BRCA table comes with its static train/test split: used unless
        told."""
        if isinstance(data, dict) and data.get("source") == "tcga_brca":
            return {"split": {"column": TCGA_SPLIT_COLUMN}, **data}
        return data

    @field_validator("source", mode="before")
    @classmethod
    def _not_silo_yamls_nested_shape(cls, source: Any) -> Any:
        """silo.yaml's old nested section pasted into a policy: refused naming both shapes."""
        if isinstance(source, dict):
            raise ValueError(
                "a mapping here is silo.yaml's old nested shape (data: {source: {source: csv, "
                "path: ...}}); a data section names its source directly, its keys beside it "
                f"(data: {{source: csv, path: ...}}; {SHAPE_GUIDE})"
            )
        return source

    @field_validator("source")
    @classmethod
    def _known_source(cls, source: str) -> str:
        if source not in SOURCES:
            hint = closest(source, list(SOURCES))
            suggestion = f" (did you mean '{hint}'?)" if hint else ""
            raise ValueError(
                f"unknown source '{source}'{suggestion}; allowed: {', '.join(SOURCES)}"
            )
        return source

    @field_validator("task")
    @classmethod
    def _known_task(cls, task: str | None) -> str | None:
        if task is not None and task not in BUILTIN_TASKS and not is_entry_point_value(task):
            raise ValueError(
                f"unknown task '{task}'; allowed: {', '.join(BUILTIN_TASKS)}, or a task "
                "plug-in's entry point value 'module:attr'"
            )
        return task

    @field_validator("loader")
    @classmethod
    def _loader_names_an_entry_point(cls, loader: str | None) -> str | None:
        if loader is not None and not is_entry_point_value(loader):
            raise ValueError(
                f"loader '{loader}' is not an entry point value 'module:attr' (the value of an "
                "installed data plug-in of group fedsilo.datasets)"
            )
        return loader

    @field_validator("categorical")
    @classmethod
    def _category_lists_are_sets(cls, categorical: dict[str, list[str]]) -> dict[str, list[str]]:
        for column, categories in categorical.items():
            if not categories:
                raise ValueError(f"column '{column}' declares no categories")
            if len(set(categories)) != len(categories):
                raise ValueError(f"column '{column}' lists a category twice: {categories}")
        return categorical

    @model_validator(mode="after")
    def _fields_fit_the_source(self) -> DataConfig:
        source = self.source
        if source in PATH_SOURCES and self.path is None:
            raise ValueError(f"source '{source}' needs a path to the file")
        if source not in PATH_SOURCES and self.path is not None:
            raise ValueError(
                f"path applies to csv, npz and molecules:csv sources only, not '{source}'"
            )
        if source == PLUGIN_SOURCE and self.loader is None:
            raise ValueError("source 'plugin' needs a loader: an installed data plug-in")
        if source != PLUGIN_SOURCE and (self.loader is not None or self.args):
            raise ValueError(f"loader and args apply to plugin sources only, not '{source}'")
        if source in TARGET_SOURCES and self.target is None:
            raise ValueError(f"source '{source}' needs target: the name of the label column")
        if source not in TARGET_SOURCES and self.target is not None:
            raise ValueError(
                f"target applies to csv and molecules:csv sources only, not '{source}' "
                "(npz files hold arrays named 'x' and 'y')"
            )
        if source != "csv" and self.categorical:
            raise ValueError(f"categorical applies to csv sources only, not '{source}'")
        if self.task == SURVIVAL and source not in ("tcga_brca", PLUGIN_SOURCE):
            raise ValueError(
                f"task survival reads (time, event) targets from the tcga_brca source or a data "
                f"plug-in, not from '{source}'"
            )
        if self.domain is not None and source not in ("heart", "csv"):
            raise ValueError(
                f"domain names a categorical column of a heart or csv source, not of '{source}'"
            )
        if source == "csv" and self.domain is not None and self.domain not in self.categorical:
            raise ValueError(
                f"domain: column '{self.domain}' must be declared in categorical (its categories "
                "are the domain names every silo agrees on)"
            )
        if self.molecules is not None and source not in MOLECULAR_SOURCES:
            raise ValueError(f"molecules applies to molecules: sources only, not '{source}'")
        if source in MOLECULE_SOURCES and self.molecule_options().smiles is not None:
            raise ValueError(
                f"molecules.smiles names the SMILES column of a molecules:csv file; the bundled "
                f"'{source}' has its own"
            )
        if isinstance(self.partition, ScaffoldPartition) and source not in MOLECULAR_SOURCES:
            raise ValueError(
                f"a scaffold partition groups molecules by scaffold: it needs a molecules: "
                f"source, not '{source}'"
            )
        known = KNOWN_TASKS.get(source)
        if known is not None and self.task not in (None, known):
            raise ValueError(f"source '{source}' is a {known} task, not {self.task}")
        return self

    def molecule_options(self) -> MoleculeOptions:
        """The `molecules:` options in force (the defaults when not given)."""
        return self.molecules or MoleculeOptions()

    def resolved_partition(self) -> Partition:
        """The partition in force: the one given, else the source's natural default (heart: one
        silo per hospital; tcga_brca: one per region; any other source: iid into DEFAULT_SILOS
        silos)."""
        if self.partition is not None:
            return self.partition
        if self.source == "heart":
            return NaturalPartition(kind="natural", column=HEART_SILO_COLUMN)
        if self.source == "tcga_brca":
            return NaturalPartition(kind="natural", column=TCGA_SILO_COLUMN)
        return IidPartition(kind="iid", silos=DEFAULT_SILOS)

    def known_silos(self) -> int | None:
        """How many silos the partition in force makes, when the policy alone says: None for
        a natural partition (one silo per value the data holds, known once it is read), and
        for a site's own data without a partition (in a deployment each site reads its own;
        a simulation deals it into DEFAULT_SILOS, checked once it is read)."""
        if self.partition is None and self.source in SITE_SOURCES:
            return None
        partition = self.resolved_partition()
        return None if isinstance(partition, NaturalPartition) else partition.silos

    def with_silos(self, n: int) -> DataConfig:
        """A copy whose partition (the default one resolved first) has `n` silos."""
        partition = self.resolved_partition()
        if isinstance(partition, NaturalPartition):
            raise ValueError(
                "--silos does not apply to a natural partition "
                f"(one silo per value of column '{partition.column}')"
            )
        resized = type(partition).model_validate({**partition.model_dump(), "silos": n})
        return self.model_copy(update={"partition": resized})


def is_entry_point_value(name: str) -> bool:
    """Whether `name` reads as an entry point's value, "module:attr" (dotted on both sides)."""
    module, colon, attr = name.partition(":")
    return bool(colon) and all(
        part.isidentifier() for part in (*module.split("."), *attr.split("."))
    )
