"""The policy's `model:` section: which network each silo trains, chosen by `name`.

`linear` is logistic regression for classification and linear regression for regression;
`logistic` is binary logistic regression as one logit (FLamby's Fed-Heart-Disease baseline),
trained with binary cross-entropy on the logit;
`mlp` is a fully connected network; `cnn` is a small convolutional network for images;
`gcn`, `gat` and `mpnn` are graph neural networks for molecular graphs (a `molecules:` data
source; models/graphs.py): message passing, a readout g(x) over the atoms, and a linear head;
`plugin` is a network a site's installed package builds (the entry point group
`fedsilo.models`), pinned by its `architecture`: every parameter's name, shape and dtype, and
their digest, which the policy's signature covers.

Every model may start from a given one instead of the seeded network (`init`, declared once in
`ModelSection`): a model file the coordinator reads, pinned by the digest of its tensors, which
each silo holds the first model it is sent to (models/warm_start.py).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    Field,
    JsonValue,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from fedsilo.policies.base import PolicyModel

if TYPE_CHECKING:
    from fedsilo.policies.schema import Policy

FACTORY_PATTERN = r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$"  # an entry point's value, module:attr
TENSOR_LINE = re.compile(r"^\S+ \[(\d+(,\d+)*)?\] \w+$")  # name [a,b,...] dtype
PINNING = "pinning"  # validation context: read a plugin model that has no architecture yet
PIN_COMMAND = "fedsilo model pin POLICY --input-shape C,H,W --output-dim K"


def architecture_digest(lines: list[str]) -> str:
    """BLAKE2b-256 (hex) of the architecture's tensor lines joined by newlines."""
    return hashlib.blake2b("\n".join(lines).encode(), digest_size=32).hexdigest()


class ModelInit(PolicyModel):
    """A warm start: the job starts from the model in `file` instead of the one built from the
    seed. Only the coordinator (or `fedsilo simulate`) reads the file; `digest` pins its
    tensors, and every silo refuses a first model whose digest differs where it derives the
    job's models itself (model lineage, docs/secure-aggregation.md)."""

    # the model file the job starts from: a final_model.safetensors as `fedsilo simulate --out` or
    # `fedsilo job results` writes it; a relative path is read from the policy file's folder; only
    # the coordinator (or simulate) reads it
    file: str = Field(min_length=1)
    # the BLAKE2b-256 digest (64 hex digits) of the model's tensors (each one's name, shape, dtype
    # and bytes, in name order; not the file's bytes), printed by `fedsilo model digest FILE`
    digest: str = Field(pattern=r"^[0-9a-f]{64}$")

    def anchored(self, folder: Path) -> ModelInit:
        """This warm start with a relative `file` read from `folder` (the policy file's), by
        its absolute path."""
        path = Path(self.file)
        if path.is_absolute():
            return self
        return self.model_copy(update={"file": str((folder / path).absolute())})


class ModelSection(PolicyModel):
    """What every model of the `model:` section has, zoo and plugin alike: its warm start,
    left out of the model's dump when there is none (a card or results.json of a seeded
    start reads as before warm starts existed)."""

    # the model the job starts from instead of the one built from the seed: `file` and the `digest`
    # of its tensors (null: the seeded model)
    init: ModelInit | None = None

    @model_serializer(mode="wrap")
    def _without_a_seeded_start(self, dump: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = dump(self)
        if data.get("init") is None:
            data.pop("init", None)
        return data


def with_init_folder(policy: Policy, folder: Path | None) -> Policy:
    """`policy` with its model's relative `init.file` read from `folder`, the folder of the
    policy file (unchanged without a warm start or a folder)."""
    init = policy.model.init
    if init is None or folder is None:
        return policy
    model = policy.model.model_copy(update={"init": init.anchored(folder)})
    return policy.model_copy(update={"model": model})


class LinearModel(ModelSection):
    """One linear layer on the flattened input."""

    # selects one linear layer on the flattened input: logistic regression for classification,
    # linear regression for regression
    name: Literal["linear"]


class LogisticModel(ModelSection):
    """One linear layer to one logit, for binary classification only: P(class 1) is the
    sigmoid of the logit (the `linear` model's two-logit softmax has twice the weights)."""

    # selects binary logistic regression as one logit (binary classification only)
    name: Literal["logistic"]


class MlpModel(ModelSection):
    """Fully connected layers of the given widths, each followed by `activation`."""

    # selects a fully connected network
    name: Literal["mlp"]
    # the width of each hidden layer, in order (two layers of 64 units by default)
    hidden: list[Annotated[int, Field(ge=1)]] = Field(default=[64, 64], min_length=1)
    # the function after each hidden layer: relu (the default) or tanh
    activation: Literal["relu", "tanh"] = "relu"


class CnnModel(ModelSection):
    """1 to 3 conv3x3 + activation (+ GroupNorm) + max-pool blocks, then one hidden dense layer
    (`hidden: 0`: none, the last layer reads the flattened features). `norm: group` normalises
    each block with GroupNorm (8 groups, or as many as divide its channels), which DP-SGD
    supports and BatchNorm it would not."""

    # selects a small convolutional network for images
    name: Literal["cnn"]
    # the output channels of each conv3x3 block, in order: 1 to 3 blocks (16 then 32 by default)
    channels: list[Annotated[int, Field(ge=1)]] = Field(
        default=[16, 32], min_length=1, max_length=3
    )
    # the width of the dense layer after the blocks (64 by default); 0: none, the last layer reads
    # the flattened features
    hidden: int = Field(default=64, ge=0)
    # the function after each convolution and the dense layer: relu (the default) or silu
    activation: Literal["relu", "silu"] = "relu"
    # none (the default), or group: GroupNorm in each block, which DP-SGD supports
    norm: Literal["none", "group"] = "none"


class GcnModel(ModelSection):
    """Graph convolutions (Kipf & Welling) of the given widths, then the readout."""

    # selects a graph convolutional network for molecular graphs (a molecules: data source)
    name: Literal["gcn"]
    # the width of each graph convolution, in order (three of 64 by default)
    hidden: list[Annotated[int, Field(ge=1)]] = Field(default=[64, 64, 64], min_length=1)
    # how a graph's atom embeddings become one vector for the head: sum (the default) or mean over
    # its atoms
    readout: Literal["sum", "mean"] = "sum"


class GatModel(ModelSection):
    """Graph attention layers (Velickovic et al.) of `heads` heads of the given widths each
    (concatenated), then the readout."""

    # selects a graph attention network for molecular graphs (a molecules: data source)
    name: Literal["gat"]
    # the width of each head of each attention layer, in order; a layer's heads are concatenated
    # (two layers of 32 by default)
    hidden: list[Annotated[int, Field(ge=1)]] = Field(default=[32, 32], min_length=1)
    # the attention heads of each layer (2 by default, at most 8)
    heads: int = Field(default=2, ge=1, le=8)
    # how a graph's atom embeddings become one vector for the head: sum (the default) or mean over
    # its atoms
    readout: Literal["sum", "mean"] = "sum"


class MpnnModel(ModelSection):
    """A message-passing network (Gilmer et al.'s edge network) of `steps` steps at width
    `hidden`, then the readout."""

    # selects a message-passing network (an edge network) for molecular graphs (a molecules: data
    # source)
    name: Literal["mpnn"]
    # the width of the atom states (64 by default)
    hidden: int = Field(default=64, ge=1)
    # how many message-passing steps run (3 by default, at most 8)
    steps: int = Field(default=3, ge=1, le=8)
    # how a graph's atom embeddings become one vector for the head: sum (the default) or mean over
    # its atoms
    readout: Literal["sum", "mean"] = "sum"


GRAPH_MODELS = ("gcn", "gat", "mpnn")


class ModelArchitecture(PolicyModel):
    """The network a plugin model must be: `tensors` lists every parameter, in
    `named_parameters()` order, as `<name> [<shape>] <dtype>` (e.g. `fc.weight [10,64] float32`),
    and `digest` is their BLAKE2b-256 digest (hex, the lines joined by newlines). `input_shape`
    and `output_dim` are the data schema it was pinned for (`fedsilo model pin` writes them),
    with which a final model is rebuilt on its own."""

    # the BLAKE2b-256 digest (64 hex digits) of the tensor lines; `fedsilo model pin` prints it, and
    # a policy whose digest does not match its tensors is refused
    digest: str = Field(pattern=r"^[0-9a-f]{64}$")
    # every parameter the network must have, in order, as `<name> [<shape>] <dtype>` (e.g.
    # `fc.weight [10,64] float32`)
    tensors: list[str] = Field(min_length=1)
    # the input shape the network was pinned for (e.g. [1, 8, 8]), with which a final model is
    # rebuilt on its own; null: not recorded
    input_shape: list[Annotated[int, Field(ge=1)]] | None = Field(default=None, min_length=1)
    # the number of outputs the network was pinned for; null: not recorded
    output_dim: int | None = Field(default=None, ge=1)

    @field_validator("tensors")
    @classmethod
    def _tensor_lines(cls, tensors: list[str]) -> list[str]:
        for index, line in enumerate(tensors):
            if not TENSOR_LINE.match(line):
                raise ValueError(
                    f"tensor {index} {line!r} is not '<name> [<shape>] <dtype>' "
                    "(e.g. 'fc.weight [10,64] float32')"
                )
        return tensors

    @model_validator(mode="after")
    def _digest_matches(self) -> ModelArchitecture:
        expected = architecture_digest(self.tensors)
        if self.digest != expected:
            raise ValueError(
                f"digest {self.digest} is not the digest of the tensors listed ({expected}); "
                f"print the block again with `{PIN_COMMAND}`"
            )
        return self


class PluginModel(ModelSection):
    """A network from a package installed at each site: `factory` is the value (`module:attr`)
    of an entry point in the group `fedsilo.models`, called as
    `factory(input_shape, output_dim, **args)`; `architecture` pins what it must build.
    No code travels with the policy: a site without the package refuses the job."""

    # selects a network built by a package installed at each site (an entry point of group
    # fedsilo.models)
    name: Literal["plugin"]
    # the entry point's value, `module:attr`, called as factory(input_shape, output_dim, **args) to
    # build the network
    factory: str = Field(pattern=FACTORY_PATTERN)
    # keyword arguments passed to the factory (none by default)
    args: dict[str, JsonValue] = Field(default_factory=dict)
    # what the factory must build: every parameter's name, shape and dtype and their digest, printed
    # by `fedsilo model pin`; required (a site whose network differs refuses the job)
    architecture: ModelArchitecture | None = None

    @model_validator(mode="after")
    def _pinned(self, info: ValidationInfo) -> PluginModel:
        pinning = bool(info.context and info.context.get(PINNING))
        if self.architecture is None and not pinning:
            raise ValueError(
                f"architecture is required for a plugin model: it pins the network every "
                f"silo must build; print it with `{PIN_COMMAND}` and paste it under model:"
            )
        return self


ModelConfig = Annotated[
    LinearModel
    | LogisticModel
    | MlpModel
    | CnnModel
    | GcnModel
    | GatModel
    | MpnnModel
    | PluginModel,
    Field(discriminator="name"),
]
