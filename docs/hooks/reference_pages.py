"""The reference pages generated from the code each time the site builds, so a key added to the
schema or a name added to the Python API is documented without anyone writing it down.

An MkDocs hook (mkdocs.yml, `hooks:`): `on_files` adds `reference/policy.md` and
`reference/silo-yaml.md`, from the pydantic models `Policy` and `SiloConfig`: one section per
model, its docstring, then one row per field with its dotted key, type, default, bounds and
description. A field's description is its `Field(description=...)` or, as this codebase writes
them, the comment on the field's line or the comment lines right above it (in the class that
declares the field, or the nearest base class that comments it); no library reads those
comments, so `field_comments` does (a few lines with `tokenize`). A key with a fixed set of
values (a `Literal`, an `Enum`, a string checked against a list that its `Field` names as
`json_schema_extra={"enum": [...]}`, or a section whose `name`/`kind` picks a variant) lists
them in its description (`allowed_values`).

It also adds `reference/api.md`, one mkdocstrings block for each name in `fedsilo.__all__` at the
module that defines it, and `reference/cli.md`, the `fedsilo` command written out here from
click (`cli_page`): each command's help, usage and options (an option with no default shows
none, a required one "required"), and each group's index of its subcommands with their whole
first sentence, the group walked as `fedsilo` runs it so that the subcommands `main` loads only
when they run are there too. Written here rather than with mkdocs-click, which shows click's
"no default" sentinel as `Sentinel.UNSET`, indexes only a group's loaded commands and cuts
summaries at the docstring's first line.

mkdocstrings reads the code without running it (griffe), by folder: it cannot follow
setuptools' `package-dir` mapping of the top-level folders (wire/, policies/, ...) into
`fedsilo`, so `on_startup` (before mkdocstrings reads its `paths`) lays out
`build/api-tree/fedsilo/` as links to the folders the installed package imports from, and
mkdocs.yml points mkdocstrings there.
"""

from __future__ import annotations

import importlib.util
import inspect
import io
import shutil
import tokenize
import types
import typing
from dataclasses import dataclass, field
from enum import Enum
from functools import cache
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple, Union

import annotated_types
import click
from pydantic import BaseModel
from pydantic.fields import FieldInfo

PAGES = {
    "reference/policy.md": (
        "Policy keys",
        "fedsilo.policies.schema:Policy",
        "Every key a policy YAML file may hold (`fedsilo policy validate P.yaml` checks one). "
        "A section whose key selects a variant (`algorithm.name`, `model.name`, "
        "`data.partition.kind`, ...) lists each variant's own keys.",
    ),
    "reference/silo-yaml.md": (
        "silo.yaml keys",
        "fedsilo.silo.config:SiloConfig",
        "Every key of a site's silo.yaml (`fedsilo silo init` writes one; `fedsilo silo check` "
        "reads it). Its `data:` holds a policy's data keys, less those only a simulation uses, "
        "plus `select` (how-to/site-data.md).",
    ),
}
# silo.yaml's `data.source` model is written flat, under `data` (silo/config.py `SiloData`)
FLATTENED = {"reference/silo-yaml.md": "data.source"}
API_TREE = Path(__file__).resolve().parents[2] / "build" / "api-tree"
SUBPACKAGES = ("wire", "policies", "privacy", "models", "coordinator", "silo", "ops")
# comments that speak to a tool, not a reader
PRAGMAS = ("type:", "noqa", "fmt:", "pragma:", "pyright:")
BOUNDS = {
    annotated_types.Ge: ">=",
    annotated_types.Gt: ">",
    annotated_types.Le: "<=",
    annotated_types.Lt: "<",
    annotated_types.MinLen: "length >=",
    annotated_types.MaxLen: "length <=",
}


class Row(NamedTuple):
    """One key of a reference table: its cells, and the field it documents."""

    key: str
    type: str
    default: str
    bounds: str
    text: str  # what the key does: its comment or Field(description=...)
    allowed: str  # the sentence listing its values, for a key with a fixed set ("" if none)
    info: FieldInfo

    @property
    def description(self) -> str:
        return " ".join(filter(None, [self.text, self.allowed]))

    def cells(self) -> list[str]:
        return [f"`{self.key}`", *map(cell, (self.type, self.default, self.bounds))] + [
            cell(self.description)
        ]


@dataclass
class Section:
    """One model as it appears under a dotted key: a heading and a row per field."""

    key: str
    model: type[BaseModel]
    rows: list[Row] = field(default_factory=list)


def load(path: str) -> type[BaseModel]:
    module, _, name = path.partition(":")
    return getattr(__import__(module, fromlist=[name]), name)


@cache
def field_comments(model: type[BaseModel]) -> dict[str, str]:
    """`# comment` lines right above a field in the class body, then the comment on its line
    (`name: type = default  # comment`): name -> comment."""
    try:
        source = inspect.getsource(model)
    except (OSError, TypeError):
        return {}
    comments: dict[str, str] = {}
    above: list[str] = []  # comment lines since the last statement
    line_name: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        text = token.string.lstrip("# ").strip()
        if token.type == tokenize.COMMENT and text.startswith(PRAGMAS):
            continue  # for a tool, not a reader (a type checker's or a linter's pragma)
        if token.type == tokenize.NAME and token.start[1] == 4 and token.start[0] not in line_name:
            line_name[token.start[0]] = token.string
            if above:
                comments[token.string] = " ".join(above)
            above = []
        elif token.type == tokenize.COMMENT and token.start[0] in line_name:
            name = line_name[token.start[0]]
            comments[name] = f"{comments[name]} {text}" if name in comments else text
        elif token.type == tokenize.COMMENT and token.start[1] == 4:
            above.append(text)
    return {name: text for name, text in comments.items() if name in model.model_fields}


def field_description(model: type[BaseModel], name: str) -> str:
    """A field's `Field(description=...)`, else its comment in the class that declares it or,
    failing that, in the nearest base class that comments it (an inherited `client_fraction`)."""
    info = model.model_fields[name]
    if info.description:
        return sentence(info.description)
    for owner in model.__mro__:
        if is_model(owner) and name in owner.model_fields:
            text = field_comments(owner).get(name)
            if text:
                return sentence(text)
    return ""


def sentence(text: str) -> str:
    """A comment as a table's sentence: its first letter capitalised, a full stop at its end."""
    text = " ".join(text.split())
    if not text:
        return text
    text = text[0].upper() + text[1:]
    return text if text.endswith((".", "!", "?")) else text + "."


def allowed_values(info: FieldInfo) -> list[str]:
    """The values a key may take when they are a fixed set: a Literal's or an Enum's, the
    `enum` its `Field(json_schema_extra=...)` names (a string checked against a list), or the
    `name`/`kind` values of the sections a union picks between; else []."""
    values: list[Any] = []
    extra = info.json_schema_extra
    if isinstance(extra, dict) and isinstance(extra.get("enum"), list | tuple):
        values.extend(extra["enum"])
    for option in variants(info.annotation):
        if typing.get_origin(option) in (list, tuple, set, frozenset):
            inner = [arg for arg in typing.get_args(option) if arg is not ...]
            values.extend(v for arg in inner for v in allowed_values(FieldInfo(annotation=arg)))
        elif typing.get_origin(option) is Literal:
            values.extend(typing.get_args(option))
        elif isinstance(option, type) and issubclass(option, Enum):
            values.extend(member.value for member in option)
        elif is_model(option) and discriminator(option):
            values.extend(typing.get_args(option.model_fields[discriminator(option)].annotation))
    return [str(value) for value in dict.fromkeys(values)]


def allowed_text(info: FieldInfo) -> str:
    """The sentence a row's description ends with for a key with a fixed set of values."""
    values = allowed_values(info)
    if not values:
        return ""
    listed = ", ".join(f"`{value}`" for value in values)
    sections = [v for v in variants(info.annotation) if is_model(v) and discriminator(v)]
    if sections:
        return f"Its `{discriminator(sections[0])}` is one of: {listed} (each a section below)."
    if any(
        typing.get_origin(v) in (list, tuple, set, frozenset) for v in variants(info.annotation)
    ):
        return f"Each one of: {listed}."
    if len(values) == 1:
        return f"Value for this section: {listed}."
    return f"One of: {listed}."


def variants(annotation: Any) -> list[Any]:
    """The alternatives of a union (Annotated and Optional unwrapped), else [annotation]."""
    if typing.get_origin(annotation) is Annotated:
        return variants(typing.get_args(annotation)[0])
    if typing.get_origin(annotation) in (Union, types.UnionType):
        return [v for arg in typing.get_args(annotation) for v in variants(arg)]
    return [annotation]


def is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def type_name(annotation: Any) -> str:
    names = []
    for option in variants(annotation):
        origin = typing.get_origin(option)
        if option is type(None):
            names.append("null")
        elif origin is Literal:
            names.extend(repr(value) for value in typing.get_args(option))
        elif origin in (list, tuple, set, frozenset):
            inner = ", ".join(type_name(arg) for arg in typing.get_args(option) if arg is not ...)
            names.append(f"list of {inner}")
        elif origin is dict:
            key, value = typing.get_args(option)
            names.append(f"mapping {type_name(key)} to {type_name(value)}")
        elif is_model(option):
            names.append("section")
        elif isinstance(option, type) and issubclass(option, Enum):
            names.extend(repr(member.value) for member in option)
        else:
            names.append(getattr(option, "__name__", str(option)))
    return " or ".join(dict.fromkeys(names))


def default_text(info: Any) -> str:
    if info.is_required():
        return "required"
    value = info.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        tag = getattr(value, "name", None) or getattr(value, "kind", None)
        return f"{tag!r} (its defaults)" if isinstance(tag, str) else "its defaults"
    if isinstance(value, Enum):
        value = value.value
    return "null" if value is None else repr(value)


def bounds_text(info: Any) -> str:
    found = [
        f"{symbol} {getattr(item, next(iter(item.__dataclass_fields__)))}"
        for item in info.metadata
        for kind, symbol in BOUNDS.items()
        if isinstance(item, kind)
    ]
    return ", ".join(found)


def discriminator(model: type[BaseModel]) -> str | None:
    """The field whose Literal values tell this variant apart (`name`, `kind`), if any."""
    for name in ("name", "kind"):
        info = model.model_fields.get(name)
        if info is not None and typing.get_origin(info.annotation) is Literal:
            return name
    return None


def variant_text(model: type[BaseModel]) -> str | None:
    """`name: fedavg`: the discriminator and its values, for a variant's heading."""
    name = discriminator(model)
    if name is None:
        return None
    return f"{name}: {' or '.join(map(str, typing.get_args(model.model_fields[name].annotation)))}"


def sections(key: str, model: type[BaseModel], seen: tuple[type, ...] = ()) -> list[Section]:
    """The model under `key` and, depth first, every model its fields hold."""
    section = Section(key, model)
    found = [section]
    # the field that picks a variant (`name`, `kind`) first, even when a base class declares
    # other fields before it (a model's `init`, an algorithm's `robust`)
    fields = sorted(model.model_fields.items(), key=lambda item: item[0] not in ("name", "kind"))
    for name, info in fields:
        dotted = f"{key}.{name}" if key else name
        section.rows.append(
            Row(
                dotted,
                type_name(info.annotation),
                default_text(info),
                bounds_text(info),
                field_description(model, name),
                allowed_text(info),
                info,
            )
        )
        for option in variants(info.annotation):
            inner = option
            origin = typing.get_origin(option)
            if origin in (list, tuple):
                inner, suffix = typing.get_args(option)[0], "[]"
            elif origin is dict:
                inner, suffix = typing.get_args(option)[1], ".<name>"
            else:
                suffix = ""
            for nested in variants(inner):
                if is_model(nested) and nested not in seen:
                    found.extend(sections(dotted + suffix, nested, (*seen, model)))
    return found


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def flattened(found: list[Section], key: str) -> list[Section]:
    """The sections with model `key`'s keys written under its parent (silo.yaml's `data`),
    less the keys only a simulation uses."""
    from fedsilo.policies.data import SIMULATION_ONLY_KEYS

    parent = key.rpartition(".")[0]
    dropped = tuple(f"{key}.{name}" for name in SIMULATION_ONLY_KEYS)

    def moved(dotted: str) -> str:
        inside = dotted == key or dotted.startswith(key + ".")
        return parent + dotted[len(key) :] if inside else dotted

    kept = [s for s in found if not any(s.key == d or s.key.startswith(d + ".") for d in dropped)]
    own = next(s for s in kept if s.key == parent)
    out = []
    for section in kept:
        if section is own:
            continue
        rows = [r._replace(key=moved(r.key)) for r in section.rows if not r.key.startswith(dropped)]
        if section.key == key:
            rows += [r for r in own.rows if r.key != key]
        out.append(Section(moved(section.key), section.model, rows))
    return out


def page(title: str, root: str, intro: str, flatten: str | None = None) -> str:
    """The reference page of the model at `root` ("module:Class"), with the model at key
    `flatten` written under its parent."""
    lines = [
        f"# {title}",
        "",
        f"{intro} Generated from `{root.split(':')[1]}` in `{root.split(':')[0]}` when the site "
        "builds (`docs/hooks/reference_pages.py`).",
    ]
    for section in page_sections(root, flatten):
        variant = variant_text(section.model)
        heading = f"`{section.key}`" if section.key else "Top level"
        if variant and section.key:
            heading += f" ({variant})"
        lines += ["", f"## {heading}", ""]
        doc = section.model.__dict__.get("__doc__")  # its own, not PolicyModel's
        if doc:
            lines += [inspect.cleandoc(doc), ""]
        lines += ["| key | type | default | bounds | description |", "|---|---|---|---|---|"]
        lines += ["| " + " | ".join(row.cells()) + " |" for row in section.rows]
    return "\n".join(lines) + "\n"


def page_sections(root: str, flatten: str | None = None) -> list[Section]:
    """The sections of the reference page of the model at `root`, as `page` writes them."""
    found = sections("", load(root))
    return flattened(found, flatten) if flatten else found


def api_page() -> str:
    """Each name of the Python API (`fedsilo.__all__`) from its docstring and signature."""
    import fedsilo

    lines = [
        "# Python API reference",
        "",
        "Every name in `fedsilo.__all__`, from its docstring and signature (generated when the "
        "site builds); [python-api.md](../python-api.md) says what each is for, with an example.",
    ]
    for name, module in fedsilo._API.items():
        lines += ["", f"::: {module}.{name}", "    options:", "      heading_level: 2"]
    return "\n".join(lines) + "\n"


# what an option's default shows when it is a value a reader can type (an Enum member shows its
# value); anything else shows nothing rather than its repr: click's "no default" sentinel (itself
# an Enum member, `Sentinel.UNSET`, whose value is an `object()`), a callable, an object
SHOWN_DEFAULTS = (str, int, float, bool, Path)


def first_sentence(help_text: str) -> str:
    """The first sentence of a command's help, whole, as `--help`'s command list would give it
    with room enough: the first paragraph, whitespace collapsed, up to the first period that
    ends the text or is followed by a word not in lowercase (so "e.g." does not end it)."""
    words = help_text.split("\f")[0].partition("\n\n")[0].split()
    if words and words[0] == "\b":
        words = words[1:]
    for i, word in enumerate(words):
        if word.endswith(".") and (i == len(words) - 1 or not words[i + 1][0].islower()):
            return " ".join(words[: i + 1])
    return " ".join(words)


def command_summary(command: click.Command) -> str:
    return command.short_help or first_sentence(command.help or "") or "(no description)"


def shown_default(option: click.Option, context: click.Context) -> str:
    """An option's default as its reference row shows it: "required", the value, or nothing."""
    if option.required:
        return "required"
    if isinstance(option.show_default, str):
        return option.show_default
    value = option.get_default(context, call=False)
    if option.is_flag and not option.secondary_opts and value is False:
        return ""  # a flag is off unless given (--help, --overwrite)
    values = list(value) if isinstance(value, (tuple, list)) else [value]
    values = [item.value if isinstance(item, Enum) else item for item in values]
    if not values or not all(isinstance(item, SHOWN_DEFAULTS) for item in values):
        return ""
    return ", ".join(f"`{item}`" for item in values)


def option_type(option: click.Option) -> str:
    if option.is_flag and option.is_bool_flag:
        return "boolean"
    kind = option.type
    if isinstance(kind, click.Choice):
        return "choice (" + " \\| ".join(f"`{choice}`" for choice in kind.choices) + ")"
    name = kind.name
    low, high = getattr(kind, "min", None), getattr(kind, "max", None)
    if low is not None and high is not None:
        return f"{name} (`{low}` to `{high}`)"
    if low is not None:
        return f"{name} (`{low}` and above)"
    if high is not None:
        return f"{name} (`{high}` and below)"
    return name


def table_cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def command_lines(context: click.Context, level: int) -> list[str]:
    """One command's section: heading, help, usage, options, then its subcommands' index and
    sections; a group's subcommands as its users reach them (`list_commands`/`get_command`, so
    a `LazyGroup`'s lazily loaded ones too)."""
    command = context.command
    path = context.command_path
    lines = [
        f"{'#' * min(level, 6)} {path} {{ #{path.replace(' ', '-')} "
        f"data-toc-label='{context.info_name}' }}",
        "",
    ]
    if command.help:
        lines += [inspect.cleandoc(command.help.split("\f")[0]).replace("\b\n", ""), ""]
    formatter = context.make_formatter()
    command.format_usage(context, formatter)
    usage = formatter.getvalue().strip().removeprefix("Usage:").strip()
    lines += ["**Usage:**", "", "```text", inspect.cleandoc(usage), "```", ""]
    options = [
        param
        for param in command.get_params(context)
        if isinstance(param, click.Option) and not param.hidden
    ]
    if options:
        lines += [
            "**Options:**",
            "",
            "| Name | Type | Description | Default |",
            "|---|---|---|---|",
        ]
        for option in options:
            names = ", ".join(f"`{name}`" for name in option.opts)
            if option.secondary_opts:
                names += " / " + ", ".join(f"`{name}`" for name in option.secondary_opts)
            cells = [names, option_type(option), table_cell(option.help or "")]
            lines.append("| " + " | ".join([*cells, shown_default(option, context)]) + " |")
        lines.append("")
    if isinstance(command, click.Group):
        subcommands = []
        for name in command.list_commands(context):
            subcommand = command.get_command(context, name)
            if subcommand is not None and not subcommand.hidden:
                subcommands.append(click.Context(subcommand, info_name=name, parent=context))
        lines += ["**Subcommands**", ""]
        lines += [
            f"- *[{sub.info_name}](#{sub.command_path.replace(' ', '-')})*: "
            f"{command_summary(sub.command)}"
            for sub in subcommands
        ]
        lines.append("")
        for sub in subcommands:
            lines += command_lines(sub, level + 1)
    return lines


def cli_page() -> str:
    """Every `fedsilo` command and option, from the click definitions: the group walked as its
    users reach it, so a subcommand `main` loads only when it runs is there too."""
    from fedsilo.ops.cli import main

    lines = [
        "# Command line",
        "",
        "Every `fedsilo` command and option, generated from the click definitions (`ops/cli.py` "
        "and the modules it loads) when the site builds; `fedsilo COMMAND --help` prints the "
        "same.",
        "",
    ]
    lines += command_lines(click.Context(main, info_name="fedsilo"), 2)
    return "\n".join(lines) + "\n"


def on_startup(command: str, dirty: bool) -> None:
    """`build/api-tree/fedsilo/`: the package as it is installed: a copy of its `__init__.py`
    (griffe takes a linked one's real folder for the package's) and a link to each sub-package."""
    package = API_TREE / "fedsilo"
    package.mkdir(parents=True, exist_ok=True)
    init = package / "__init__.py"
    init.unlink(missing_ok=True)
    shutil.copyfile(importlib.util.find_spec("fedsilo").origin, init)
    links = {}
    for name in SUBPACKAGES:
        links[name] = Path(importlib.util.find_spec(f"fedsilo.{name}").origin).parent
    for name, target in links.items():
        link = package / name
        if link.is_symlink() and link.resolve() == target.resolve():
            continue
        link.unlink(missing_ok=True)
        link.symlink_to(target)


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    for path, (title, root, intro) in PAGES.items():
        content = page(title, root, intro, FLATTENED.get(path))
        files.append(File.generated(config, path, content=content))
    files.append(File.generated(config, "reference/api.md", content=api_page()))
    files.append(File.generated(config, "reference/cli.md", content=cli_page()))
    return files
