"""Reading a policy file: YAML in, a validated `Policy` out, or one `PolicyError` that names
the file, each offending field, and the allowed values. Also the one place pydantic's errors
become messages for people (`describe_errors`), and the policy variants the command line
derives (another algorithm, another seed or number of silos), refused the same way.

A policy path `example:NAME` names one of the example policies that ship inside the package
(`policies/examples/NAME.yaml`, read through importlib.resources), so the examples work from an
installed wheel as well as from a checkout."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import ValidationError

from fedsilo.policies.base import closest
from fedsilo.policies.model import with_init_folder
from fedsilo.policies.schema import Policy
from fedsilo.policies.strict_yaml import load_yaml

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

MAX_SHOWN_INPUT = 60  # characters of an offending value quoted in a message
EXAMPLE_PREFIX = "example:"
EXAMPLE_SUFFIX = ".yaml"


class PolicyError(ValueError):
    """A policy that cannot be used; the message lists every problem, one per line."""


def load_policy(path: str | Path) -> Policy:
    """The policy in file `path`, or in the packaged example `path` names (`example:NAME`);
    a relative `model.init.file` is read from the policy file's folder."""
    name = example_name(path)
    if name is not None:
        text = example_file(name).read_text(encoding="utf-8")
        return parse_policy_text(text, source=f"{EXAMPLE_PREFIX}{name}")
    path = Path(path)
    policy = parse_policy_text(read_text_file(path, "policy file"), source=str(path))
    return with_init_folder(policy, path.parent)


def example_name(path: str | Path) -> str | None:
    """NAME when `path` is `example:NAME`, else None (a file path)."""
    text = str(path)
    return text.removeprefix(EXAMPLE_PREFIX) if text.startswith(EXAMPLE_PREFIX) else None


def policy_folder(path: str | Path) -> Path:
    """The folder a policy's relative data paths are read from: the policy file's own, or the
    packaged examples' folder for `example:NAME`."""
    if example_name(path) is not None:
        return Path(str(example_folder()))
    return Path(path).parent


def example_folder() -> Traversable:
    """The packaged example policies (`policies/examples/`)."""
    return files("fedsilo.policies") / "examples"


def example_names() -> list[str]:
    """Every packaged example's NAME, sorted."""
    return sorted(
        entry.name.removesuffix(EXAMPLE_SUFFIX)
        for entry in example_folder().iterdir()
        if entry.is_file() and entry.name.endswith(EXAMPLE_SUFFIX)
    )


def example_file(name: str) -> Traversable:
    """The packaged example `name`, or a PolicyError listing the closest names."""
    names = example_names()
    if name not in names:
        close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise PolicyError(
            f"{EXAMPLE_PREFIX}{name}: no such example policy{hint} "
            "(`fedsilo examples list` shows them all)"
        )
    return example_folder() / f"{name}{EXAMPLE_SUFFIX}"


def signable_policy_file(path: Path) -> Path:
    """`path` itself, or a PolicyError when it names a packaged example: something written
    beside a policy (its signature) cannot go into the installed package."""
    name = example_name(path)
    if name is not None:
        raise PolicyError(
            f"{path}: a packaged example cannot be signed in place; copy it first "
            f"(`fedsilo examples copy {name}`), then sign the copy"
        )
    return path


def read_text_file(path: Path, what: str) -> str:
    """The UTF-8 text of `path`, or a PolicyError naming it (missing, unreadable, binary)."""
    if not path.is_file():
        raise PolicyError(f"{path}: {what} not found")
    try:
        return path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise PolicyError(f"{path}: cannot read the {what}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise PolicyError(
            f"{path}: not a text {what} (byte {exc.start} is not UTF-8); a {what} is YAML text"
        ) from None


def parse_policy_text(text: str, source: str = "<policy>") -> Policy:
    return parse_policy(read_yaml(text, source), source=source)


def read_yaml(text: str, source: str) -> Any:
    """The YAML document in `text` (a key set twice is an error), or a PolicyError naming
    `source`."""
    try:
        return load_yaml(text)
    except yaml.YAMLError as exc:
        raise PolicyError(f"{source}: not valid YAML: {exc}") from None


def parse_policy(document: Any, source: str = "<policy>") -> Policy:
    if not isinstance(document, Mapping):
        raise PolicyError(
            f"{source}: a policy is a mapping of sections, got {type(document).__name__}"
        )
    try:
        return Policy.model_validate(dict(document))
    except ValidationError as exc:
        raise PolicyError(describe_errors(exc, document, source)) from None


def with_algorithm(policy: Policy, name: str) -> Policy:
    """`policy` with algorithm `name` (`Policy.with_algorithm`), or a PolicyError naming
    `--compare NAME` and the field that does not fit it."""
    try:
        return policy.with_algorithm(name)
    except ValidationError as exc:
        raise PolicyError(describe_errors(exc, policy.model_dump(), f"--compare {name}")) from None


def with_overrides(policy: Policy, seed: int | None, silos: int | None) -> Policy:
    """`policy` with the command line's `--seed` and `--silos`, or a PolicyError naming them."""
    try:
        return policy.with_overrides(seed=seed, silos=silos)
    except ValidationError as exc:
        given = " ".join(
            f"{option} {value}"
            for option, value in (("--seed", seed), ("--silos", silos))
            if value is not None
        )
        raise PolicyError(describe_errors(exc, policy.model_dump(), given)) from None
    except ValueError as exc:
        raise PolicyError(str(exc)) from None


def describe_errors(exc: ValidationError, document: Any, source: str) -> str:
    """One line per problem, each naming the field path as the user wrote it."""
    problems = [_describe(error, document) for error in exc.errors()]
    if len(problems) == 1:
        return f"{source}: {problems[0]}"
    return f"{source}: {len(problems)} problems\n  " + "\n  ".join(problems)


def _describe(error: Mapping[str, Any], document: Mapping) -> str:
    where = _field_path(error["loc"], document)
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "union_tag_invalid":
        tag = error["ctx"]["tag"]
        allowed = [t.strip(" '") for t in error["ctx"]["expected_tags"].split(",")]
        hint = closest(str(tag), allowed)
        message = f"unknown value {tag!r}" + (f" (did you mean '{hint}'?)" if hint else "")
        message += f"; allowed: {', '.join(allowed)}"
    elif error["type"] == "union_tag_not_found":
        message = f"missing '{error['ctx']['discriminator'].strip(chr(39))}'"
    elif error["type"] not in ("missing", "value_error") and "input" in error:
        message += f" (got {_shown(error['input'])})"
    return f"{where}: {message}" if where else message


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= MAX_SHOWN_INPUT else text[: MAX_SHOWN_INPUT - 3] + "..."


def _field_path(loc: tuple, document: Any) -> str:
    """The dotted path of the fields in `loc`, as the user wrote them.

    pydantic also puts the chosen member of a tagged union (the tag's value, e.g. `dirichlet`)
    and validator names in `loc`; walking the document tells those apart from real keys.
    """
    parts, node = [], document
    for part in loc:
        if isinstance(part, str) and part.startswith("function-"):
            continue
        if isinstance(node, Mapping):
            if part in node:
                node = node[part]
            elif part in {str(v) for v in node.values() if isinstance(v, str | int)}:
                continue  # the tag that chose a union member
            else:
                node = None  # a field the document lacks: still name it
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
        parts.append(str(part))
    return ".".join(parts)
