"""How a task config crosses the wire: a frozen dataclass whose fields are the keys of one JSON
object (the task header's `config`), checked key by key when it arrives.

A field is emitted always, unless its metadata says `omit_if` (a value, usually None, meaning
"absent": the builder leaves the key out and the handler applies its own default; that value
sent explicitly reads as absent too, and re-encodes without the key). A field marked
`flatten` is another `JsonFields` whose keys sit beside this one's (the local-training settings
every training task shares); a field marked `inner` is a whole task config, sent as
`inner_kind` and `inner_config` (the task a secure-aggregation step wraps).

Decoding refuses unknown keys, missing required keys and values of the wrong type with a
`WireError` naming the task kind and the key. A float field keeps an integer as it came, so a
config re-encodes to exactly the dict it was read from.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Mapping
from typing import Any, ClassVar, Self, Union, get_args, get_origin, get_type_hints

from fedsilo.wire.tasks.release import Release
from fedsilo.wire.tensors import WireError

FLATTEN = {"flatten": True}  # metadata: the nested fields' keys sit beside this one's
INNER = {"inner": True}  # metadata: a wrapped task, as `inner_kind` and `inner_config`
INNER_KEYS = frozenset({"inner_kind", "inner_config"})


def optional(default: Any = None) -> Any:
    """A field whose key is left out while it holds `default` (None: absent)."""
    return dataclasses.field(default=default, metadata={"omit_if": default})


def flattened() -> Any:
    return dataclasses.field(metadata=FLATTEN)


def inner() -> Any:
    return dataclasses.field(metadata=INNER)


@dataclasses.dataclass(frozen=True, kw_only=True)
class JsonFields:
    """A frozen dataclass that is one flat JSON object on the wire."""

    def to_json(self) -> dict[str, Any]:
        encoded: dict[str, Any] = {}
        for f in _layout(type(self)):
            value = getattr(self, f.name)
            if f.flatten:
                encoded |= value.to_json()
            elif f.inner:
                encoded |= {"inner_kind": value.KIND, "inner_config": value.to_json()}
            elif not f.omittable or value is not f.omit_if:
                encoded[f.name] = _to_wire(value)
        return encoded

    @classmethod
    @functools.cache
    def json_keys(cls) -> frozenset[str]:
        """Every JSON key this class reads, flattened fields' included."""
        names: set[str] = set()
        for f in _layout(cls):
            if f.flatten:
                names |= f.hint.json_keys()
            else:
                names |= INNER_KEYS if f.inner else {f.name}
        return frozenset(names)

    @classmethod
    def decode(cls, data: Any, kind: str) -> Self:
        """`data` read as this class, errors naming task `kind`."""
        if not isinstance(data, Mapping):
            raise WireError(f"{kind} task: config must be a JSON object, not {_type(data)}")
        if not cls.json_keys().issuperset(data):
            unknown = sorted(set(data) - cls.json_keys())
            raise WireError(f"{kind} task: unknown config key(s) {unknown}")
        values: dict[str, Any] = {}
        for f in _layout(cls):
            if f.flatten:
                values[f.name] = f.hint.decode(
                    {k: data[k] for k in f.hint.json_keys() if k in data}, kind
                )
            elif f.inner:
                values[f.name] = _inner_task(data, kind)
            elif f.name in data:
                values[f.name] = _from_wire(data[f.name], f.hint, kind, f.name)
            elif f.required:
                raise WireError(f"{kind} task: config key {f.name!r} is missing")
        return cls(**values)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaskConfig(JsonFields):
    """The config of one task kind (`KIND`), built by a strategy and read by its handler.
    `SENDS`: what an answer of the kind sends (wire/tasks/release.py), which decides where it
    may run and what its answer may hold; `RELEASES_COUNT`: a protocol step whose answer
    releases the training count beside its tensors (a secure sum's weights)."""

    KIND: ClassVar[str]
    SENDS: ClassVar[Release]
    RELEASES_COUNT: ClassVar[bool] = False

    @classmethod
    def from_json(cls, data: Any) -> Self:
        return cls.decode(data, cls.KIND)


@dataclasses.dataclass(frozen=True)
class _Field:
    """One field of a `JsonFields` class as the codec reads it: read once per class (a task is
    encoded and decoded on every message, and `dataclasses.fields` and the type hints cost more
    than the rest of the work)."""

    name: str
    hint: Any  # the field's resolved type
    flatten: bool  # another JsonFields whose keys sit beside this one's
    inner: bool  # a wrapped task config
    required: bool  # no default: a missing key is refused
    omittable: bool  # left out while it holds `omit_if`
    omit_if: Any


@functools.cache
def _layout(cls: type) -> tuple[_Field, ...]:
    hints = get_type_hints(cls)
    return tuple(
        _Field(
            name=f.name,
            hint=hints[f.name],
            flatten=bool(f.metadata.get("flatten")),
            inner=bool(f.metadata.get("inner")),
            required=f.default is dataclasses.MISSING,
            omittable="omit_if" in f.metadata,
            omit_if=f.metadata.get("omit_if"),
        )
        for f in dataclasses.fields(cls)
    )


def _inner_task(data: Mapping[str, Any], kind: str) -> TaskConfig:
    from fedsilo.wire.tasks.registry import decode_task_config  # the registry imports us

    missing = sorted(INNER_KEYS - set(data))
    if missing:
        raise WireError(f"{kind} task: config key {missing[0]!r} is missing")
    inner_kind = data["inner_kind"]
    if not isinstance(inner_kind, str):
        raise WireError(
            f"{kind} task: config key 'inner_kind' must be str, not {_type(inner_kind)}"
        )
    try:
        return decode_task_config(inner_kind, data["inner_config"])
    except WireError as exc:
        raise WireError(f"{kind} task wraps a bad task: {exc}") from exc


def _to_wire(value: Any) -> Any:
    if isinstance(value, JsonFields):
        return value.to_json()
    if isinstance(value, tuple):
        return [_to_wire(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _to_wire(v) for k, v in value.items()}
    return value


def _from_wire(value: Any, hint: Any, kind: str, key: str) -> Any:
    """`value` as the field typed `hint` holds it (a list as a tuple, an object as a dict or a
    nested config), or a WireError."""
    origin, args = _origin_and_args(hint)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (member,) = [a for a in args if a is not type(None)]
        return _from_wire(value, member, kind, key)
    if isinstance(hint, type) and issubclass(hint, JsonFields):
        return hint.decode(value, kind)
    if origin is tuple and isinstance(value, list | tuple):
        return tuple(_from_wire(v, args[0], kind, f"{key}[{i}]") for i, v in enumerate(value))
    if origin is Mapping and isinstance(value, Mapping):
        for k in value:
            if not isinstance(k, str):
                raise WireError(f"{kind} task: config key {key!r} has a non-string key {k!r}")
        return {k: _from_wire(v, args[1], kind, f"{key}.{k}") for k, v in value.items()}
    if origin is None and _scalar_fits(value, hint):
        return value
    raise WireError(
        f"{kind} task: config key {key!r} must be {_name(hint)}, not {_type(value)} ({value!r})"
    )


@functools.cache
def _origin_and_args(hint: Any) -> tuple[Any, tuple[Any, ...]]:
    return get_origin(hint), get_args(hint)


def _scalar_fits(value: Any, hint: type) -> bool:
    if hint is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if hint is float:  # an integer stays one: it re-encodes as it came
        return isinstance(value, int | float)
    return isinstance(value, hint)


def _name(hint: Any) -> str:
    origin = get_origin(hint)
    if origin is tuple:
        return "a list"
    if origin is Mapping:
        return "an object"
    return getattr(hint, "__name__", str(hint))


def _type(value: Any) -> str:
    return "null" if value is None else type(value).__name__
