"""The pages render as written: Python-Markdown (what MkDocs builds the site with, stricter than
CommonMark about lists) turns every list marker of a page into a list item and keeps every
indented code block inside its item; and every silo.yaml or policy YAML block of the example
plug-in package's README is one that the real models accept, in the current shape."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path

import markdown
import pytest
import yaml

from fedsilo.policies.loading import parse_policy
from fedsilo.silo.config import parse_silo_config

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_README = ROOT / "examples" / "fedsilo-example-plugins" / "README.md"
PAGES = sorted([*(ROOT / "docs").rglob("*.md"), ROOT / "README.md", EXAMPLE_README])
EXTENSIONS = ["admonition", "attr_list", "tables", "toc", "pymdownx.superfences"]  # mkdocs.yml
MARKER = re.compile(r"^ *(\d+\.|[-*+]) +\S")
FENCE = re.compile(r"^( *)(```|~~~)")
YAML_FENCE = re.compile(r"^( *)```ya?ml[^\n]*\n(.*?)^\1```", re.S | re.M)


def source_lists(text: str) -> tuple[int, int]:
    """The page's list markers and its code fences indented into a list item, outside fences."""
    markers = indented = 0
    fence: str | None = None
    for line in text.splitlines():
        found = FENCE.match(line)
        if fence is not None:
            fence = None if found and found.group(2) == fence else fence
            continue
        if found:
            fence, indented = found.group(2), indented + bool(found.group(1))
        elif MARKER.match(line):
            markers += 1
    return markers, indented


class ListItems(HTMLParser):
    """Counts the rendered list items and the code blocks inside one."""

    def __init__(self) -> None:
        super().__init__()
        self.items = self.depth = self.code_in_items = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "li":
            self.items, self.depth = self.items + 1, self.depth + 1
        elif tag == "pre" and self.depth:
            self.code_in_items += 1

    def handle_endtag(self, tag: str) -> None:
        if tag == "li":
            self.depth -= 1


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_list_and_its_code_blocks_render_as_written(page: Path) -> None:
    text = "\n".join(
        "" if line.startswith("--8<--") else line for line in page.read_text().splitlines()
    )  # a shared snippet is a block of its own
    rendered = ListItems()
    rendered.feed(markdown.markdown(text, extensions=EXTENSIONS))
    markers, indented = source_lists(text)
    assert rendered.items == markers, (
        f"{markers} list markers render as {rendered.items} items: a list right after a "
        "paragraph needs a blank line before it, a nested list four spaces"
    )
    assert rendered.code_in_items == indented, (
        f"{indented} code blocks indented into list items, {rendered.code_in_items} render "
        "inside one: indent a list item's code block by four spaces"
    )


def readme_yaml_blocks() -> list[dict]:
    blocks = [yaml.safe_load(m.group(2)) for m in YAML_FENCE.finditer(EXAMPLE_README.read_text())]
    assert blocks, "the example README shows no YAML block"
    return blocks


def test_the_example_readmes_yaml_blocks_are_valid_in_the_current_shape() -> None:
    for block in readme_yaml_blocks():
        if "algorithm" in block:
            parse_policy(block)
            continue
        assert {"kit", "data"} <= set(block), f"not a whole silo.yaml: {sorted(block)}"
        config = parse_silo_config(block, str(EXAMPLE_README))
        assert config.data.shape_note() is None, config.data.shape_note()
        assert config.data.section_key == "data"
