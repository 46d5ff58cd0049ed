"""Import direction (docs/architecture.md, "Import layering"; the model zoo beside privacy):
wire <- policies <- {privacy, models} <- coordinator|silo <- ops."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ALLOWED = {
    "wire": {"wire"},
    "policies": {"wire", "policies"},
    "privacy": {"wire", "policies", "privacy"},
    "models": {"wire", "policies", "models"},
    "coordinator": {"wire", "policies", "privacy", "models", "coordinator"},
    "silo": {"wire", "policies", "privacy", "models", "silo"},
}


def imported_layers(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = (
            [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else ([node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
        )
        for name in names:
            parts = name.split(".")
            if parts[0] == "fedsilo" and len(parts) > 1:
                found.add(parts[1])
    return found


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_each_layer_imports_only_what_the_architecture_allows(layer: str) -> None:
    folder = ROOT / layer
    if not folder.exists():
        pytest.skip(f"{layer}/ does not exist yet")
    for path in folder.rglob("*.py"):
        forbidden = imported_layers(path) - ALLOWED[layer] - {"__init__"}
        assert not forbidden, f"{path.relative_to(ROOT)} imports {sorted(forbidden)}"


UNSAFE = re.compile(
    r"import pickle|pickle\.loads?\(|allow_pickle=True|torch\.load\((?!.*weights_only=True)"
)


def test_no_module_unpickles() -> None:
    for path in ROOT.glob("*/**/*.py"):
        relative = path.relative_to(ROOT).parts
        if relative[0].startswith(".") or "tests" in relative:
            continue
        text = path.read_text()
        assert not UNSAFE.search(text), f"{path}: {UNSAFE.search(text).group(0)}"
