"""The README, the changelog and every page under docs/ speak to users: they name no internal
work item. A "stop" was a work session and "issue 40" a tracker entry; neither means anything to
a user. A measured number says which version measured it, and history goes to CHANGELOG.md.

The patterns flag "stop" only where it names a session ("this stop", "the fifth stop", "an
earlier stop's run", "stop 4", "six stops", "two stops ago"), never the verb ("stop the
coordinator", "the silo stops", "Ctrl-C stops", `stop_on_signals`), and flag "issue 40",
"issue #40", "PR #12" and a bare "#40"."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(
    [ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").rglob("*.md")],
    key=lambda path: str(path.relative_to(ROOT)),
)

_ORDINALS = "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth"
# words before "stop" that make it a noun: a session, not the verb
_QUALIFIERS = (
    rf"this|that|these|those|each|every|an?\s+earlier|earlier|previous|last|next|same|{_ORDINALS}"
)
_COUNTS = r"\d+|two|three|four|five|six|seven|eight|nine|ten|several|many|few|both"
# the verb takes an object: "signals that stop the silo", "that stops it"
_OBJECT = r"the|a|an|it|its|them|their|this|that|all|any|every|each|waiting|working"

WORK_ITEM = re.compile(
    "|".join(
        [
            rf"\b(?:{_QUALIFIERS})\s+stops?\b(?!\s+(?:{_OBJECT})\b)",  # this stop, the fifth stop
            r"\bthe\s+stops?(?:'s|\s+(?:before|after)\b)",  # the stop before, the stop's table
            r"\bthe\s+stop\s+(?:that|which)\s+(?:measured|wrote|built|changed|started|took)\b",
            rf"\b(?:{_COUNTS})\s+stops\b",  # six stops, two stops ago
            r"\bstops?\s+(?:ago|by\s+stop)\b",  # stops ago, stop by stop
            r"\bstop\s*#?\d+",  # stop 4, stop #4, stop6 (not _stop6 in a file's name)
            r"\bissues?(?:\s*#?|-)\d+",  # issue 40, issue #40, Issue 22's, #issue-40-fifth-stop
            r"\b(?:this|that|the)\s+issue's",  # not one of the goals
            r"\b(?:PRs?|pull\s+requests?)\s*#?\d+",  # PR #12
            r"(?<![\w&/#])#\d+\b",  # #40 (not &#123; or a URL's fragment)
        ]
    ),
    re.IGNORECASE,
)

# another project's work item, cited as a source: not one of fedsilo's
CITATIONS = ("FLamby's PR #73",)


def work_items(text: str) -> list[tuple[int, str, str]]:
    """(line number, what matched, the line) for each internal work item in `text`; a phrase may
    run over a line break."""
    for citation in CITATIONS:
        text = text.replace(citation, " " * len(citation))
    lines = text.splitlines()
    found = []
    for match in WORK_ITEM.finditer(text):
        number = text.count("\n", 0, match.start()) + 1
        found.append((number, " ".join(match.group(0).split()), lines[number - 1].strip()))
    return found


@pytest.mark.parametrize(
    "phrase",
    [
        "Issue 22's and issue 40's goals",
        "0.44 (3 repeats each, the fifth stop of issue 40)",
        "0.73 (an earlier stop's run)",
        'the stop that wrote the row. "This stop" is the stop before',
        "### Issue 40, fifth stop: the coordinator's peak at 1e8",
        "Three of the goals do not hold after six stops.",
        "Tried two stops ago and dropped",
        "How each number moved, stop by stop",
        "(the stops before: `transport_1e7.json`)",
        "on the previous stop's code",
        "9 repeats on the sixth stop",
        "measured in stop 4",
        "see issue #40",
        "fixed in #40",
        "not this issue's: see PR #12",
        "on this stop's code",
        "That stop looked for a lever",
        "what the last stop left unbuilt",
        "Tried on the\nstop before and dropped",
        "the code on this\nstop's day",
        "(one run, on the stop that measured it last)",
        "(not one of the issue's goals)",
        "[the third stop](#issue-40-third-stop-the-answer-store)",
    ],
)
def test_the_pattern_flags_a_work_item(phrase: str) -> None:
    assert work_items(phrase), phrase


@pytest.mark.parametrize(
    "phrase",
    [
        "stop the coordinator with Ctrl-C",
        "the silo stops when its job ends",
        "Ctrl-C stops every process",
        "a clean stop on signals (`stop_on_signals`)",
        "signals that stop the silo, and a signal that stops it",
        "`ray stop` on each node ends the cluster.",
        "`wait_for_members` stops waiting for gone silos",
        "towards one silo, stop training",
        "`job abort` stops a running job within a second",
        "`fedsilo consortium issue-operator-kit`",
        "the CA issues the certificates",
        "`--out transport_floor_1e5x3_stop6_runN`",
        "[performance](performance.md#where-a-rounds-time-goes)",
        "a colour of #fff and &#123;",
        "cited as FLamby's PR #73 description",
    ],
)
def test_the_pattern_leaves_ordinary_english_alone(phrase: str) -> None:
    assert not work_items(phrase), work_items(phrase)


@pytest.mark.parametrize("page", PAGES, ids=lambda path: str(path.relative_to(ROOT)))
def test_the_page_names_no_internal_work_item(page: Path) -> None:
    hits = [
        f"{page.relative_to(ROOT)}:{number}: {matched!r} in: {line}"
        for number, matched, line in work_items(page.read_text())
    ]
    assert not hits, "internal work items (say the version instead):\n" + "\n".join(hits)


FEDSILO_COMMAND = re.compile(r"^\s*(?:\$ )?(?:\S*/)?fedsilo\b", re.MULTILINE)
FENCED = re.compile(r"```[^\n]*\n(.*?)```", re.DOTALL)
ON_PATH = '--8<-- "fedsilo-on-path.md"'  # docs/snippets/fedsilo-on-path.md


@pytest.mark.parametrize(
    "page",
    [page for page in PAGES if page.is_relative_to(ROOT / "docs")],
    ids=lambda page: str(page.relative_to(ROOT)),
)
def test_a_page_that_shows_fedsilo_commands_says_how_fedsilo_gets_on_the_path(
    page: Path,
) -> None:
    commands = [
        block for block in FENCED.findall(page.read_text()) if FEDSILO_COMMAND.search(block)
    ]
    assert not commands or ON_PATH in page.read_text(), f"{page.name}: add {ON_PATH}"
