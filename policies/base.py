"""The base every policy section derives from: frozen, and strict about unknown keys.

An unknown key is refused with the closest allowed name, so `lrr: 0.1` reads
"unknown field 'lrr' (did you mean 'lr'?)" instead of being silently ignored.
"""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator


def closest(name: str, allowed: list[str]) -> str | None:
    """The allowed name closest to `name`, if any is close enough to be a likely typo."""
    matches = difflib.get_close_matches(name, allowed, n=1, cutoff=0.6)
    return matches[0] if matches else None


def unknown_key_message(key: str, allowed: list[str]) -> str:
    hint = closest(key, allowed)
    suggestion = f" (did you mean '{hint}'?)" if hint else ""
    return f"unknown field '{key}'{suggestion}; allowed: {', '.join(sorted(allowed))}"


class PolicyModel(BaseModel):
    """A policy section: immutable, and every key must be one it declares."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _refuse_unknown_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            allowed = list(cls.model_fields)
            for key in data:
                if key not in allowed:
                    raise ValueError(unknown_key_message(str(key), allowed))
        return data
