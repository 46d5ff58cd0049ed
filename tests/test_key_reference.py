"""The generated key references (`reference/policy.md`, `reference/silo-yaml.md`, from
docs/hooks/reference_pages.py) as a reader sees them: every key says what it does, every key
with a fixed set of values lists them, and no page names the code's internals (a Python
constant such as `MAX_SEED`, a private `_name`) where it should say what they mean."""

from __future__ import annotations

import re
import types
import typing
from enum import Enum
from typing import Literal

import pytest
from pydantic import BaseModel

from tests.test_docs import DOCS, generated_pages, reference_pages

PAGES = ["reference/policy.md", "reference/silo-yaml.md"]
# a Python constant (two or more capitalised words joined by "_") or a private name in code
INTERNAL_NAME = re.compile(r"\b[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+\b|`_[a-z]\w*`")


def rows(path: str) -> list:
    """Every row the hook writes on the page at `path`, in its order."""
    hook = reference_pages()
    _, root, _ = hook.PAGES[path]
    return [
        row
        for section in hook.page_sections(root, hook.FLATTENED.get(path))
        for row in section.rows
    ]


def options(annotation: typing.Any) -> list[typing.Any]:
    """A field type's alternatives, Annotated and Optional unwrapped."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return options(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [inner for arg in typing.get_args(annotation) for inner in options(arg)]
    return [annotation]


def fixed_values(row: typing.Any) -> list[str]:
    """The values a key may take, read from its field (not from the hook): a Literal's, an
    Enum's, a `json_schema_extra` enum's, or the `name`/`kind` of each section of a union (of a
    list's items too)."""
    extra = row.info.json_schema_extra
    values = list(extra.get("enum", ())) if isinstance(extra, dict) else []
    return [str(value) for value in values] + annotation_values(row.info.annotation)


def annotation_values(annotation: typing.Any) -> list[str]:
    values: list[typing.Any] = []
    for option in options(annotation):
        if typing.get_origin(option) in (list, tuple, set, frozenset):
            values += [v for arg in typing.get_args(option) for v in annotation_values(arg)]
        elif typing.get_origin(option) is Literal:
            values += typing.get_args(option)
        elif isinstance(option, type) and issubclass(option, Enum):
            values += [member.value for member in option]
        elif isinstance(option, type) and issubclass(option, BaseModel):
            for tag in ("name", "kind"):
                field = option.model_fields.get(tag)
                if field is not None and typing.get_origin(field.annotation) is Literal:
                    values += typing.get_args(field.annotation)
                    break
    return [str(value) for value in values]


@pytest.mark.parametrize("path", PAGES)
def test_every_key_has_a_description(path: str) -> None:
    blank = [row.key for row in rows(path) if not row.text.strip()]
    assert not blank, f"{len(blank)} keys of {path} have no description:\n" + "\n".join(blank)


@pytest.mark.parametrize("path", PAGES)
def test_every_key_with_a_fixed_set_of_values_lists_them(path: str) -> None:
    unlisted = []
    for row in rows(path):
        missing = [value for value in fixed_values(row) if f"`{value}`" not in row.description]
        if missing:
            unlisted.append(f"{row.key}: {missing}")
    assert not unlisted, f"{path}: keys that do not list their values:\n" + "\n".join(unlisted)


def test_the_data_source_lists_every_source() -> None:
    from fedsilo.policies.data import SOURCES

    (row,) = [row for row in rows("reference/policy.md") if row.key == "data.source"]
    assert all(f"`{source}`" in row.description for source in SOURCES), row.description


@pytest.mark.parametrize("path", PAGES)
def test_no_page_names_an_internal_python_name(path: str) -> None:
    text = generated_pages()[DOCS / path]
    found = sorted(set(INTERNAL_NAME.findall(text)))
    assert not found, f"{path} names code internals: {found}"
