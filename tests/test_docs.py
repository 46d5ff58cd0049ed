"""The documentation in docs/ is complete and every reference to it holds: each algorithm that
`fedsilo algorithms` lists has its docs/algorithms/<name>.md, which names its example policy and
every key its config reads, and every docs/ path (with the section it names, if any) cited in
the code, the README and the docs themselves exists, as does every repository path the README
and the docs name. The README is a front page that links each role's guide; the reference pages
the site generates (docs/hooks/reference_pages.py) name every command, every key an example
policy uses and every site rule. `make docs` (in `make test`) builds the site strictly, which
checks the links and anchors of the generated pages too."""

from __future__ import annotations

import importlib.util
import re
import sys
import typing
from pathlib import Path
from types import ModuleType

import click
import markdown
import pytest
import yaml
from click.testing import CliRunner

import fedsilo
from fedsilo.ops.cli import main
from fedsilo.policies.algorithms import AlgorithmConfig
from fedsilo.policies.data import SIMULATION_ONLY_KEYS
from fedsilo.silo.config import SITE_KEYS, LocalRules, SiloConfig

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
# a docs/ path, optionally followed by the section it names: `docs/<file>.md, "Section"` or
# `docs/<file>.md ("Section")`
CITATION = re.compile(r'\bdocs/[\w./-]+\.md(?:(?:,\s*|\s*\(|\s+)"([^"\n]+)")?')
MARKDOWN_LINK = re.compile(r"\]\(([^)\s]+)\)")
EXAMPLE = re.compile(r"policies/examples/[\w.-]+\.yaml")
# a repository path in backticks: `silo/tasks/`, `coordinator/engine.py`
REPOSITORY_PATH = re.compile(r"`((?:[\w-]+/)+(?:[\w.-]+\.(?:py|md|yaml|json))?)`")
# a row of a generated reference table: | `key` | type | ...
REFERENCE_ROW = re.compile(r"^\| `([^`]+)` \| ([^|]+) \|", re.MULTILINE)
ROLE_GUIDES = ["operator", "hospital-it", "privacy-officer", "researcher"]


def reference_pages() -> ModuleType:
    """docs/hooks/reference_pages.py, the MkDocs hook that generates the reference pages."""
    spec = importlib.util.spec_from_file_location(
        "reference_pages", DOCS / "hooks" / "reference_pages.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def generated_pages() -> dict[Path, str]:
    """The pages the site generates, by the path they have in the site's docs/."""
    hook = reference_pages()
    pages = {
        DOCS / path: hook.page(*args, hook.FLATTENED.get(path)) for path, args in hook.PAGES.items()
    }
    pages[DOCS / "reference" / "api.md"] = hook.api_page()
    pages[DOCS / "reference" / "cli.md"] = hook.cli_page()
    pages[DOCS / "reference" / "metrics.md"] = metrics_page_hook().metrics_page()
    return pages


def metrics_page_hook() -> ModuleType:
    """docs/hooks/metrics_page.py, the MkDocs hook that generates the metrics reference."""
    spec = importlib.util.spec_from_file_location(
        "metrics_page", DOCS / "hooks" / "metrics_page.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reference_rows(path: str) -> dict[str, str]:
    """A generated reference page's keys and their types."""
    text = generated_pages()[DOCS / path]
    return {key: kind.strip() for key, kind in REFERENCE_ROW.findall(text)}


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


def headings(path: Path, text: str | None = None) -> set[str]:
    text = path.read_text() if text is None else text
    return {line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#")}


def anchor(heading: str) -> str:
    """GitHub's (and the site's) anchor for a heading: lower case, punctuation dropped, spaces
    to hyphens."""
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


def test_every_repository_path_the_readme_and_the_docs_name_exists() -> None:
    missing = [
        f"{page.relative_to(ROOT)}: {name}"
        for page in [ROOT / "README.md", *DOCS.rglob("*.md")]
        for name in REPOSITORY_PATH.findall(page.read_text())
        if not (ROOT / name).exists()
    ]
    assert not missing, "\n".join(missing)


def test_every_relative_link_in_the_docs_resolves() -> None:
    """Also a link to a page the site generates, and to a section of it."""
    generated = generated_pages()
    broken = []
    for page in [ROOT / "README.md", *DOCS.rglob("*.md")]:
        for link in MARKDOWN_LINK.findall(page.read_text()):
            if link.startswith(("http://", "https://", "mailto:")):
                continue
            file_part, _, fragment = link.partition("#")
            target = (page.parent / file_part).resolve() if file_part else page
            if not target.exists() and target not in generated:
                broken.append(f"{page.relative_to(ROOT)}: {link}")
            elif fragment and fragment not in {
                anchor(h) for h in headings(target, generated.get(target))
            }:
                broken.append(f"{page.relative_to(ROOT)}: {link} (no such section)")
    assert not broken, "\n".join(broken)


def test_the_readme_is_a_front_page_with_the_two_commands_and_a_link_to_each_role_guide() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < 250
    quick_start = text.partition("## Quick start")[2].partition("```bash")[2].partition("```")[0]
    commands = [line.split("#")[0].strip() for line in quick_start.strip().splitlines()]
    assert commands == ["make demo", "make test"]
    for role in ROLE_GUIDES:
        assert f"(docs/how-to/{role}.md)" in text, f"the README does not link {role}'s guide"
    assert "(docs/performance.md)" in text and "## License" in text


def test_make_test_builds_the_docs_strictly() -> None:
    makefile = (ROOT / "Makefile").read_text()
    test_recipe = makefile.partition("\ntest:")[2].partition("\n\n")[0]
    docs_recipe = makefile.partition("\ndocs:")[2].partition("\n\n")[0]
    assert "$(MAKE) docs" in test_recipe
    assert "mkdocs build --strict" in docs_recipe


def all_commands(command: click.Command, path: str) -> list[str]:
    """`fedsilo`'s commands as its users reach them, subcommands loaded as they run."""
    found = [path]
    if isinstance(command, click.Group):
        context = click.Context(command, info_name=path)
        for name in command.list_commands(context):
            found += all_commands(command.get_command(context, name), f"{path} {name}")
    return found


def test_the_command_line_reference_shows_every_command() -> None:
    text = generated_pages()[DOCS / "reference" / "cli.md"]
    html = markdown.markdown(text, extensions=["attr_list", "tables"])  # as mkdocs.yml
    shown = {re.sub(r"<[^>]+>", "", h).strip() for h in re.findall(r"<h\d[^>]*>(.*?)</h\d>", html)}
    missing = [c for c in all_commands(main, "fedsilo") if c not in shown]
    assert not missing, f"not in the generated CLI reference: {missing}"


def policy_keys(document: dict, rows: dict[str, str], prefix: str = "") -> list[str]:
    """The dotted keys of a policy document, into sections only (a mapping-typed key such as
    `data.categorical` holds the user's names, not keys)."""
    keys = []
    for key, value in document.items():
        dotted = f"{prefix}{key}"
        keys.append(dotted)
        if isinstance(value, dict) and "section" in rows.get(dotted, ""):
            keys += policy_keys(value, rows, f"{dotted}.")
    return keys


def test_the_policy_reference_names_every_key_the_example_policies_use() -> None:
    rows = reference_rows("reference/policy.md")
    examples = sorted((ROOT / "policies" / "examples").glob("*.yaml"))
    assert examples
    missing = sorted(
        {
            f"{example.name}: {key}"
            for example in examples
            for key in policy_keys(yaml.safe_load(example.read_text()), rows)
            if key not in rows
        }
    )
    assert not missing, "\n".join(missing)


def test_the_silo_yaml_reference_names_every_key_and_every_site_rule() -> None:
    rows = reference_rows("reference/silo-yaml.md")
    expected = [
        *SiloConfig.model_fields,
        *(f"rules.{rule}" for rule in LocalRules.model_fields),
        *(f"data.{key}" for key in SITE_KEYS),  # a policy's data keys, written flat
    ]
    assert not [key for key in expected if key not in rows]
    assert not [key for key in rows if key.startswith("data.source.")]  # the old nested shape
    assert not [key for key in SIMULATION_ONLY_KEYS if f"data.{key}" in rows]


def test_the_python_api_reference_documents_every_name_of_fedsilo_all() -> None:
    text = generated_pages()[DOCS / "reference" / "api.md"]
    documented = set(re.findall(r"^::: [\w.]+\.(\w+)$", text, re.MULTILINE))
    assert documented == set(fedsilo.__all__) - {"__version__"}
