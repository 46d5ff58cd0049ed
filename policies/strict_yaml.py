"""YAML for every file an operator writes (policies, consortium.yaml, silo.yaml): PyYAML's safe
loader, except that a key given twice in one mapping is an error naming the key and both lines,
instead of the last one silently winning."""

from __future__ import annotations

from typing import Any

import yaml
from yaml.nodes import MappingNode, ScalarNode

MERGE_TAG = "tag:yaml.org,2002:merge"


class DuplicateKeyError(yaml.YAMLError):
    """A mapping that sets one key twice."""


class _StrictSafeLoader(yaml.SafeLoader):
    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, ScalarNode) or key_node.tag == MERGE_TAG:
                continue
            key = self.construct_object(key_node)
            line = key_node.start_mark.line + 1
            if key in first_line:
                raise DuplicateKeyError(
                    f"duplicate key {key!r} at line {line} (first at line {first_line[key]}); "
                    "YAML would silently keep the last one"
                )
            first_line[key] = line
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str) -> Any:
    """The document in `text`; a yaml.YAMLError (DuplicateKeyError among them) if it is not one."""
    return yaml.load(text, Loader=_StrictSafeLoader)  # noqa: S506 - a SafeLoader subclass
