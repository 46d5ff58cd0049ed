"""Reading a policy file: YAML in, a validated `Policy` out, or one `PolicyError` that names
the file, each offending field, and the allowed values."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from fedsilo.policies.base import closest
from fedsilo.policies.schema import Policy


class PolicyError(ValueError):
    """A policy that cannot be used; the message lists every problem, one per line."""


def load_policy(path: str | Path) -> Policy:
    path = Path(path)
    if not path.is_file():
        raise PolicyError(f"{path}: policy file not found")
    return parse_policy_text(path.read_text(), source=str(path))


def parse_policy_text(text: str, source: str = "<policy>") -> Policy:
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise PolicyError(f"{source}: not valid YAML: {exc}") from exc
    return parse_policy(document, source=source)


def parse_policy(document: Any, source: str = "<policy>") -> Policy:
    if not isinstance(document, Mapping):
        raise PolicyError(
            f"{source}: a policy is a mapping of sections, got {type(document).__name__}"
        )
    try:
        return Policy.model_validate(dict(document))
    except ValidationError as exc:
        raise PolicyError(describe_errors(exc, document, source)) from None


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
        message += f" (got {error['input']!r})"
    return f"{where}: {message}" if where else message


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
