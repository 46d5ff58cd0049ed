"""The generated command-line reference (`reference/cli.md`, docs/hooks/reference_pages.py) as a
reader sees it: no option shows a placeholder for its default (`Sentinel.UNSET`, `<object ...>`),
the command index of `fedsilo` and of each group lists every command its users can run (the ones
`main` loads only when they run included), and each entry's summary is the command's whole first
sentence, not its docstring's first line."""

from __future__ import annotations

import html
import re

import click
import markdown
import pytest

from fedsilo.ops.cli import main
from tests.test_docs import DOCS, generated_pages

# an index entry as it renders: <li><em><a href="#fedsilo-job-submit">submit</a></em>: Summary</li>
INDEX_ENTRY = re.compile(r'<li><em><a href="#([^"]+)">[^<]*</a></em>:\s*(.*?)</li>', re.DOTALL)


def rendered() -> str:
    """The generated page rendered as mkdocs.yml renders it."""
    text = generated_pages()[DOCS / "reference" / "cli.md"]
    return markdown.markdown(text, extensions=["attr_list", "tables"])


def walk(command: click.Command, path: str) -> list[tuple[str, click.Command]]:
    """Every command of `fedsilo` with its path, subcommands loaded as they run."""
    found = [(path, command)]
    if isinstance(command, click.Group):
        context = click.Context(command, info_name=path)
        for name in command.list_commands(context):
            found += walk(command.get_command(context, name), f"{path} {name}")
    return found


def index() -> dict[str, str]:
    """The command index's entries: each command's anchor and its summary, as plain text."""
    entries = {}
    for anchor, summary in INDEX_ENTRY.findall(rendered()):
        entries[anchor] = html.unescape(re.sub(r"<[^>]+>", "", summary)).strip()
    return entries


def anchor(path: str) -> str:
    return path.replace(" ", "-")


def test_no_option_shows_a_placeholder_for_its_default() -> None:
    page = rendered()
    assert "Sentinel" not in page
    assert "UNSET" not in page
    assert "<object" not in html.unescape(page)


def option_defaults(command_path: str) -> dict[str, str]:
    """The Default cell of each option row in `command_path`'s section, as plain text."""
    page = rendered()
    start = page.index(f'id="{anchor(command_path)}"')
    table = page[start:].split("</table>")[0]
    defaults = {}
    for row in re.findall(r"<tr>(.*?)</tr>", table, re.DOTALL):
        cells = [re.sub(r"<[^>]+>", "", c).strip() for c in re.findall(r"<td>(.*?)</td>", row)]
        if cells:
            defaults[cells[0]] = html.unescape(cells[-1])
    return defaults


def test_an_option_shows_required_its_default_or_nothing() -> None:
    """`fedsilo silo start`: --config is required, --poll-seconds has a default, --health-file
    none (the no-default sentinel that click 8.3 introduced must not show)."""
    defaults = option_defaults("fedsilo silo start")
    assert defaults["--config"] == "required"
    assert defaults["--poll-seconds"] == "5.0"
    assert defaults["--health-file"] == ""


@pytest.mark.parametrize("name", main.list_commands(click.Context(main, info_name="fedsilo")))
def test_the_command_index_lists_every_top_level_command(name: str) -> None:
    assert anchor(f"fedsilo {name}") in index(), f"`fedsilo {name}` is not in the command index"


def test_every_group_indexes_every_subcommand() -> None:
    entries = index()
    missing = [path for path, _ in walk(main, "fedsilo")[1:] if anchor(path) not in entries]
    assert not missing, f"not in the command index: {missing}"


def first_paragraph(help_text: str) -> str:
    """The help's first paragraph as plain text (no code backticks), whitespace collapsed."""
    return " ".join(help_text.partition("\n\n")[0].replace("`", "").split())


def test_every_summary_in_the_index_is_a_whole_sentence() -> None:
    entries = index()
    cut = []
    for path, command in walk(main, "fedsilo")[1:]:
        summary = entries.get(anchor(path))
        if summary is None:
            continue  # test_every_group_indexes_every_subcommand says so
        paragraph = first_paragraph(command.short_help or command.help or "")
        whole = paragraph.startswith(summary) and (
            summary == paragraph or summary.endswith((".", "!", "?"))
        )
        if not whole or summary.endswith("..."):
            cut.append(f"{path}: {summary!r}")
    assert not cut, "summaries cut mid-sentence:\n" + "\n".join(cut)
