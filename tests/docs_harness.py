"""Runs a documentation page as its reader would: every shell and Python snippet, in page order,
in one fresh folder, so the docs cannot drift from the CLI (`tests/test_docs_run.py`).

Written by hand because no library does the part that matters here: pytest-markdown-docs runs
Python fences only, and mktestdocs runs each shell fence on its own, without the state a
tutorial builds up (files written by one command and read by the next, a coordinator and silo
agents left serving while later commands talk to them). Markdown itself is parsed by
markdown-it-py, the CommonMark parser rich already brings.

What a page's fences become:
- `bash`/`sh`: one command per logical line (a trailing backslash continues it), run by bash;
  each must exit 0. A command that serves until stopped (`fedsilo silo start`, `fedsilo
  coordinator serve`) runs in the background for the rest of the page, which fails if one
  exits on its own.
- `python`: run as a script by the session's interpreter; it must exit 0. A `python` fence with
  `title="PATH"` is an excerpt of that file of the repository instead, and must be found in it
  (`is_excerpt_of`).
- `yaml` with `title="FILE"` (Material shows the name above the block): its top-level keys are
  written into FILE, the way a reader pastes the block over that part of the file. Every other
  `yaml` fence must at least parse.
- anything else (`toml` fragments of a pyproject.toml, text): shown, not run.

A page's `Scene` (`tests/docs_scenes.py`) is what its reader has before reading (their CSV,
their kit), the values behind its placeholders (a job id, free ports for the ones printed), what
the reader does between two commands (waits for a job to end; starts the other sites the same
way) and the few commands run elsewhere, each with the reason and the line that shows where.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from markdown_it import MarkdownIt

REPO = Path(__file__).resolve().parent.parent
COMMAND_TIMEOUT_S = 300
SERVES = ("fedsilo silo start", "fedsilo coordinator serve")  # stay up until stopped

_TITLE = re.compile(r'title="([^"]+)"')


@dataclass(frozen=True)
class Snippet:
    """One fenced block of a page: its language, its optional title and its text."""

    page: Path
    line: int  # 1-based line of the fence's first content line
    lang: str
    title: str | None
    text: str

    @property
    def where(self) -> str:
        return self.at(self.line)

    def at(self, line: int) -> str:
        """`page:line`, the page relative to the repository where it is in it."""
        page = self.page.relative_to(REPO) if self.page.is_relative_to(REPO) else self.page
        return f"{page}:{line}"


@dataclass(frozen=True)
class Command:
    """One logical shell line of a snippet, with the page line it starts on."""

    line: int
    text: str


def page_snippets(page: Path) -> list[Snippet]:
    """Every fenced block of `page`, in order."""
    tokens = MarkdownIt("commonmark").parse(page.read_text())
    snippets = []
    for token in tokens:
        if token.type != "fence" or token.map is None:
            continue
        lang, _, attributes = token.info.strip().partition(" ")
        title = _TITLE.search(attributes)
        snippets.append(
            Snippet(page, token.map[0] + 2, lang, title.group(1) if title else None, token.content)
        )
    return snippets


def _code(line: str) -> str:
    """A Python line without its trailing comment (`# type: ignore` and the like)."""
    return re.sub(r"""\s+#[^"']*$""", "", line).rstrip()


def is_excerpt_of(excerpt: str, source: str) -> bool:
    """Whether `excerpt`'s lines are consecutive lines of `source`, trailing comments aside;
    a line that is only `...` stands for the rest of the definition and ends the comparison."""
    wanted = [_code(line) for line in excerpt.splitlines()]
    if "..." in (line.strip() for line in wanted):
        wanted = wanted[: [line.strip() for line in wanted].index("...")]
    lines = [_code(line) for line in source.splitlines()]
    return any(lines[i : i + len(wanted)] == wanted for i in range(len(lines)))


def shell_commands(snippet: Snippet) -> list[Command]:
    """The logical lines of a shell snippet: continuations joined, blank and comment lines
    dropped (a trailing comment stays; bash ignores it)."""
    commands: list[Command] = []
    pending: list[str] = []
    start = snippet.line
    for offset, line in enumerate(snippet.text.splitlines()):
        if not pending:
            start = snippet.line + offset
            if not line.strip() or line.lstrip().startswith("#"):
                continue
        if line.rstrip().endswith("\\"):
            pending.append(line.rstrip()[:-1])
            continue
        commands.append(Command(start, " ".join(part.strip() for part in [*pending, line])))
        pending = []
    assert not pending, f"{snippet.where}: a continued line ends the snippet"
    return commands


@dataclass(frozen=True)
class Elsewhere:
    """A command this harness does not run, with why and the line of a file showing where it
    runs instead (checked to be there)."""

    reason: str
    file: str  # relative to the repository
    shows: str  # text that file must contain


@dataclass
class Scene:
    """What a page's reader brings and does beside the page's own commands."""

    given: Callable[[Session], None] = lambda session: None
    # literal text of the page -> its value here (free ports, ids); callables are asked when a
    # command needs them, so a job id can be read once the job exists
    values: Mapping[str, str | Callable[[Session], str]] = field(default_factory=dict)
    # each command containing the key is run again with the key replaced by each value, right
    # after it ("and the same for south and east")
    repeat: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # regex on a command (after substitution) -> run before it (waits: a job has ended)
    before: Mapping[str, Callable[[Session], None]] = field(default_factory=dict)
    # regex on a command (after substitution) -> run after it succeeded
    after: Mapping[str, Callable[[Session], None]] = field(default_factory=dict)
    # a command (its text up to a trailing comment) -> where it runs instead
    elsewhere: Mapping[str, Elsewhere] = field(default_factory=dict)

    def runs_elsewhere(self, command: Command) -> str | None:
        """The key of `elsewhere` that `command` is, if any."""
        return next(
            (
                key
                for key in self.elsewhere
                if re.fullmatch(rf"{re.escape(key)}\s*(#.*)?", command.text)
            ),
            None,
        )


def wait_for_port(port: int, server: subprocess.Popen, timeout_s: float = 120) -> None:
    """Until something accepts connections on 127.0.0.1:`port`; fails if `server` exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert server.poll() is None, f"exited with {server.returncode} before listening"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"nothing listens on port {port} after {timeout_s} s")


@dataclass
class Served:
    """A command left serving in the background, and the log its output goes to."""

    name: str  # where the command comes from, and the command
    process: subprocess.Popen
    log: Path
    ended: bool = False  # it exited on its own, as the page says it does

    def check(self, logs: str) -> None:
        assert self.ended or self.process.poll() is None, (
            f"{self.name} exited with {self.process.returncode}\n{logs}"
        )


class Session:
    """One page's run: its folder, its environment and the processes it left serving."""

    def __init__(self, folder: Path, scene: Scene, bin_dir: Path | None = None) -> None:
        self.folder = folder
        self.scene = scene
        self.env = {**os.environ, "COLUMNS": "200"}
        self.use_bin(bin_dir or Path(sys.executable).parent)
        self.serving: list[Served] = []
        self._resolved: dict[str, str] = {}

    def use_bin(self, bin_dir: Path) -> None:
        """Commands find `fedsilo`, `python` and `pip` in `bin_dir` first (a virtual
        environment's scripts)."""
        self.bin = bin_dir
        self.env["PATH"] = os.pathsep.join([str(bin_dir), os.environ.get("PATH", "")])

    @property
    def python(self) -> Path:
        return self.bin / "python"

    def value(self, key: str) -> str:
        """The value behind a page's literal `key` (asked once, then kept)."""
        if key not in self._resolved:
            value = self.scene.values[key]
            self._resolved[key] = value(self) if callable(value) else value
        return self._resolved[key]

    def substitute(self, text: str) -> str:
        for key in sorted(self.scene.values, key=len, reverse=True):
            if key in text:
                text = text.replace(key, self.value(key))
        return text

    def run(self, command: str, where: str = "scene") -> str:
        """`command` by bash in the session folder; it must exit 0. Returns its output."""
        self.check_serving()
        done = subprocess.run(
            ["bash", "-c", command],
            cwd=self.folder,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_S,
            check=False,
        )
        assert done.returncode == 0, (
            f"{where}: `{command}` exited {done.returncode}\n{done.stdout}\n{done.stderr}"
            f"\n{self.serving_logs()}"
        )
        return done.stdout

    def serve(self, command: str, where: str = "scene") -> subprocess.Popen:
        """`command` in the background until the session ends; its output goes to a log."""
        log = self.folder / f".serving-{len(self.serving)}.log"
        with log.open("w") as sink:
            process = subprocess.Popen(
                ["bash", "-c", f"exec {command}"],
                cwd=self.folder,
                env=self.env,
                stdout=sink,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.serving.append(Served(f"{where}: {command}", process, log))
        return process

    def check_serving(self) -> None:
        for served in self.serving:
            served.check(self.serving_logs())

    def ends(self, command: str, saying: str, timeout_s: float = 60) -> None:
        """The serving `command` exits on its own within `timeout_s`, having printed `saying`
        (as a revoked silo's agent does); it is no longer expected to serve."""
        served = next(served for served in self.serving if served.name.endswith(command))
        served.process.wait(timeout=timeout_s)
        assert saying in served.log.read_text(), f"{command} ended without saying {saying!r}"
        served.ended = True

    def serving_logs(self) -> str:
        return "\n".join(
            f"--- {served.name}\n{served.log.read_text()[-3000:]}" for served in self.serving
        )

    def stop(self) -> None:
        running = [served.process for served in self.serving if served.process.poll() is None]
        for process in running:
            os.killpg(process.pid, 15)
        for process in running:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, 9)
                process.wait()

    def substitute_file(self, name: str) -> None:
        """The page's literals replaced by their values in a file a command wrote, as the
        reader edits in their own address and ports."""
        path = self.folder / name
        path.write_text(self.substitute(path.read_text()))

    def write_titled(self, snippet: Snippet) -> None:
        """A titled YAML block pasted over the keys it names in its file."""
        assert snippet.title is not None
        path = self.folder / snippet.title
        block = yaml.safe_load(self.substitute(snippet.text))
        assert isinstance(block, dict), f"{snippet.where}: a titled block is a mapping"
        document = yaml.safe_load(path.read_text()) if path.exists() else {}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump({**(document or {}), **block}, sort_keys=False))

    def run_command(self, command: Command, snippet: Snippet) -> None:
        where = snippet.at(command.line)
        variants = [command.text]
        for key, others in self.scene.repeat.items():
            if key in command.text:
                variants += [command.text.replace(key, other) for other in others]
        for text in variants:
            text = self.substitute(text)
            for pattern, hook in self.scene.before.items():
                if re.search(pattern, text):
                    hook(self)
            if text.startswith(SERVES):
                self.serve(text, where)
            else:
                self.run(text, where)
            for pattern, hook in self.scene.after.items():
                if re.search(pattern, text):
                    hook(self)

    def run_snippet(self, snippet: Snippet) -> list[str]:
        """Runs one snippet; returns the commands it left to other places (by their text)."""
        if snippet.lang in ("bash", "sh"):
            skipped = []
            for command in shell_commands(snippet):
                if (key := self.scene.runs_elsewhere(command)) is not None:
                    skipped.append(key)
                else:
                    self.run_command(command, snippet)
            return skipped
        if snippet.lang == "python" and snippet.title:
            source = (REPO / snippet.title).read_text()
            assert is_excerpt_of(snippet.text, source), (
                f"{snippet.where}: this excerpt is no longer in {snippet.title}"
            )
        elif snippet.lang == "python":
            script = self.folder / f".snippet-{snippet.line}.py"
            script.write_text(self.substitute(snippet.text))
            self.run(f"{shlex.quote(str(self.python))} {script.name}", snippet.where)
        elif snippet.lang == "yaml" and snippet.title:
            self.write_titled(snippet)
        elif snippet.lang == "yaml":
            yaml.safe_load(snippet.text)
        return []


def run_page(page: Path, scene: Scene, folder: Path) -> Session:
    """Every snippet of `page` in order, in `folder`, with `scene` around them."""
    folder.mkdir(parents=True, exist_ok=True)
    session = Session(folder, scene)
    try:
        scene.given(session)
        skipped: list[str] = []
        for snippet in page_snippets(page):
            skipped += session.run_snippet(snippet)
        session.check_serving()
        unused = set(scene.elsewhere) - set(skipped)
        assert not unused, f"{page.name}: the scene leaves out commands the page lacks: {unused}"
    finally:
        session.stop()
    return session
