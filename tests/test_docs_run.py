"""Every shell and Python snippet of the tutorials and how-to guides runs, in page order, as its
reader would run it (`tests/docs_harness.py`; each page's scene in `tests/docs_scenes.py`): the
docs cannot drift from the CLI. A command left out runs elsewhere, named, and the place is
checked to run it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from tests.docs_harness import (
    REPO,
    Command,
    Elsewhere,
    Scene,
    page_snippets,
    run_page,
    shell_commands,
)
from tests.docs_scenes import SCENES

DOCS = REPO / "docs"
RUNNABLE = re.compile(r"^```(bash|sh|python)", re.MULTILINE)
# every tutorial and how-to, and every other page with a shell or Python snippet
PAGES = sorted(
    str(page.relative_to(DOCS))
    for page in DOCS.rglob("*.md")
    if page.parent.name in ("tutorials", "how-to") or RUNNABLE.search(page.read_text())
)


def test_every_page_with_a_snippet_has_a_scene() -> None:
    assert sorted(SCENES) == PAGES


@pytest.mark.parametrize("page", PAGES)
def test_every_snippet_of_the_page_runs(page: str, tmp_path: Path) -> None:
    run_page(DOCS / page, SCENES[page](), tmp_path)


@pytest.mark.parametrize("page", PAGES)
def test_a_command_left_out_runs_where_its_scene_says(page: str) -> None:
    for command, where in SCENES[page]().elsewhere.items():
        assert where.shows in (REPO / where.file).read_text(), (command, where)


def page(folder: Path, text: str) -> Path:
    written = folder / "page.md"
    written.write_text(text)
    return written


def test_the_harness_runs_continued_lines_as_one_command_and_pastes_titled_yaml(
    tmp_path: Path,
) -> None:
    written = page(
        tmp_path,
        "Intro.\n\n"
        '```yaml title="p.yaml"\nname: a\nrounds: 3\n```\n\n'
        '```yaml title="p.yaml"\nrounds: 5\n```\n\n'
        "```bash\n# a comment line\necho one \\\n    two > out.txt   # trailing comment\n```\n",
    )
    (shell,) = [snippet for snippet in page_snippets(written) if snippet.lang == "bash"]
    assert shell_commands(shell) == [Command(14, "echo one two > out.txt   # trailing comment")]
    run_page(written, Scene(), tmp_path / "run")
    assert (tmp_path / "run/out.txt").read_text() == "one two\n"
    assert yaml.safe_load((tmp_path / "run/p.yaml").read_text()) == {"name": "a", "rounds": 5}


FAILING_PAGES = {
    "a command that fails, named by its line": (
        "```bash\ntrue\nfedsilo simulate --no-such-option\n```\n",
        Scene(),
        r"page.md:3: `fedsilo simulate --no-such-option`",
    ),
    "a serving command that exits": (
        "```bash\nfedsilo silo start --config missing.yaml\ntrue\n```\n",
        # no race: the scene waits for it to end before the page goes on
        Scene(after={"silo start": lambda session: session.serving[-1].process.wait(120)}),
        "fedsilo silo start --config missing.yaml exited",
    ),
    "a scene leaving out a command the page lacks": (
        "```bash\ntrue\n```\n",
        Scene(elsewhere={"make demo": Elsewhere("", "Makefile", "demo")}),
        "leaves out commands the page lacks",
    ),
    "an excerpt that drifted from its file": (
        '```python title="coordinator/mixing.py"\n'
        "def qfedavg_weights(losses, sizes):\n    ...\n```\n",
        Scene(),
        "no longer in coordinator/mixing.py",
    ),
}


@pytest.mark.parametrize("case", FAILING_PAGES)
def test_a_page_fails_on(case: str, tmp_path: Path) -> None:
    text, scene, message = FAILING_PAGES[case]
    with pytest.raises(AssertionError, match=message):
        run_page(page(tmp_path, text), scene, tmp_path / "run")
