"""The base every policy section derives from: frozen, and strict about unknown keys and
numbers.

An unknown key is refused with the closest allowed name, so `lrr: 0.1` reads
"unknown field 'lrr' (did you mean 'lr'?)" instead of being silently ignored. A number is a
finite number: `.inf` and `.nan` are refused, and so is `true` where a number belongs (YAML's
booleans would otherwise read as 1 and 0), and so is a subnormal float (5e-324: noise or a
clip bound it scales underflows to 0).
"""

from __future__ import annotations

import difflib
import sys
import types
import typing
from typing import Annotated, Any, Union

from pydantic import BaseModel, ConfigDict, model_validator

NUMBER_TYPES = (int, float)


def closest(name: str, allowed: list[str]) -> str | None:
    """The allowed name closest to `name`, if any is close enough to be a likely typo."""
    matches = difflib.get_close_matches(name, allowed, n=1, cutoff=0.6)
    return matches[0] if matches else None


def unknown_key_message(key: str, allowed: list[str]) -> str:
    hint = closest(key, allowed)
    suggestion = f" (did you mean '{hint}'?)" if hint else ""
    return f"unknown field '{key}'{suggestion}; allowed: {', '.join(sorted(allowed))}"


class PolicyModel(BaseModel):
    """A policy section: immutable, every key one it declares, every number a finite number."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _refuse_unknown_keys_and_booleans_as_numbers(cls, data: Any) -> Any:
        if isinstance(data, dict):
            allowed = list(cls.model_fields)
            for key, value in data.items():
                if key not in allowed:
                    raise ValueError(unknown_key_message(str(key), allowed))
                if isinstance(value, bool) and _is_number(cls.model_fields[key].annotation):
                    raise ValueError(f"{key}: expected a number, got {str(value).lower()}")
                if isinstance(value, float) and 0 < abs(value) < sys.float_info.min:
                    raise ValueError(
                        f"{key}: {value!r} is below the smallest normal float "
                        f"({sys.float_info.min:g}): no setting means that; write 0 or a larger "
                        "value"
                    )
        return data


def _is_number(annotation: Any) -> bool:
    """Whether a field's type is a number (int or float, possibly optional or constrained)."""
    if annotation in NUMBER_TYPES:
        return True
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _is_number(typing.get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        return bool(members) and all(_is_number(a) for a in members)
    return False
