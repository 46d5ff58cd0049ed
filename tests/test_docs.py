"""The documentation in docs/ is complete and every reference to it holds: each algorithm that
`fedsilo algorithms` lists has its docs/algorithms/<name>.md, which names its example policy and
every key its config reads, and every docs/ path (with the section it names, if any) cited in
the code, the README and the docs themselves exists, as does every repository path the docs
name."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest
from click.testing import CliRunner

from fedsilo.ops.cli import main
from fedsilo.policies.algorithms import AlgorithmConfig

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
# a docs/ path, optionally followed by the section it names: `docs/<file>.md, "Section"` or
# `docs/<file>.md ("Section")`
CITATION = re.compile(r'\bdocs/[\w./-]+\.md(?:(?:,\s*|\s*\(|\s+)"([^"\n]+)")?')
MARKDOWN_LINK = re.compile(r"\]\(([^)\s]+)\)")
EXAMPLE = re.compile(r"policies/examples/[\w.-]+\.yaml")
# a repository path in backticks: `silo/tasks/`, `coordinator/engine.py`
REPOSITORY_PATH = re.compile(r"`((?:[\w-]+/)+(?:[\w.-]+\.(?:py|md|yaml|json))?)`")


def listed_algorithms() -> list[str]:
    result = CliRunner().invoke(main, ["algorithms"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return [line.split()[0] for line in result.output.splitlines() if line.strip()]


def config_fields(name: str) -> set[str]:
    """The keys algorithm `name` reads under `algorithm:` (its config class's fields)."""
    union = typing.get_args(AlgorithmConfig)[0]  # Annotated[Union[...], discriminator]
    (cls,) = [
        c
        for c in typing.get_args(union)
        if name in typing.get_args(c.model_fields["name"].annotation)
    ]
    return set(cls.model_fields) - {"name"}


def sources() -> list[Path]:
    code = [
        path
        for path in ROOT.rglob("*.py")
        if not any(part.startswith(".") or part == "build" for part in path.relative_to(ROOT).parts)
    ]
    return [*code, ROOT / "README.md", *DOCS.rglob("*.md")]


def headings(path: Path) -> set[str]:
    return {
        line.lstrip("#").strip() for line in path.read_text().splitlines() if line.startswith("#")
    }


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def test_the_docs_folder_has_the_architecture_map_and_the_walkthrough() -> None:
    assert (DOCS / "architecture.md").is_file()
    assert (DOCS / "adding-an-algorithm.md").is_file()


@pytest.mark.parametrize("name", listed_algorithms())
def test_every_listed_algorithm_has_its_page(name: str) -> None:
    page = DOCS / "algorithms" / f"{name}.md"
    assert page.is_file(), f"`fedsilo algorithms` lists {name}, but {page} is missing"
    examples = EXAMPLE.findall(page.read_text())
    assert examples, f"{page} names no example policy"
    for example in examples:
        assert (ROOT / example).is_file(), f"{page} names {example}, which does not exist"


@pytest.mark.parametrize("name", listed_algorithms())
def test_every_page_names_each_key_of_its_algorithm(name: str) -> None:
    text = (DOCS / "algorithms" / f"{name}.md").read_text()
    keys = text.partition("## Policy keys")[2]
    assert keys, f"docs/algorithms/{name}.md has no 'Policy keys' section"
    unnamed = sorted(
        f for f in config_fields(name) if f"`{f}`" not in keys and f"algorithm.{f}`" not in keys
    )
    assert not unnamed, f"docs/algorithms/{name}.md does not name {unnamed}"


def test_every_cited_docs_path_and_section_exists() -> None:
    missing = []
    for path in sources():
        for match in CITATION.finditer(path.read_text()):
            cited = match.group(0).split(".md")[0] + ".md"
            target = ROOT / cited
            if not target.is_file():
                missing.append(f"{path.relative_to(ROOT)}: {cited}")
            elif match.group(1) and match.group(1) not in headings(target):
                missing.append(
                    f"{path.relative_to(ROOT)}: {cited} has no section {match.group(1)!r}"
                )
    assert not missing, "\n".join(missing)


def test_every_repository_path_the_docs_name_exists() -> None:
    missing = [
        f"{page.relative_to(ROOT)}: {name}"
        for page in DOCS.rglob("*.md")
        for name in REPOSITORY_PATH.findall(page.read_text())
        if not (ROOT / name).exists()
    ]
    assert not missing, "\n".join(missing)


def test_every_relative_link_in_the_docs_resolves() -> None:
    broken = []
    for page in [ROOT / "README.md", *DOCS.rglob("*.md")]:
        for link in MARKDOWN_LINK.findall(page.read_text()):
            if link.startswith(("http://", "https://", "mailto:")):
                continue
            file_part, _, fragment = link.partition("#")
            target = (page.parent / file_part).resolve() if file_part else page
            if not target.exists():
                broken.append(f"{page.relative_to(ROOT)}: {link}")
            elif fragment and fragment not in {anchor(h) for h in headings(target)}:
                broken.append(f"{page.relative_to(ROOT)}: {link} (no such section)")
    assert not broken, "\n".join(broken)
