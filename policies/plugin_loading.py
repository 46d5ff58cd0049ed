"""Loading a site's plug-ins (model factories, data loaders, tasks: any entry point group), and
reading them afresh when a job starts, so a long-running silo agent uses a package installed
while it runs from its next job on.

The entry points themselves are read from the installed distributions at every call
(`importlib.metadata` keeps nothing across calls that would hide a new one); what a running
interpreter does keep is its import system's state, which `read_afresh` brings up to date: the
finders' caches (`importlib.invalidate_caches`: a folder on `sys.path` made after start-up, as
`pip install --target` makes one, is otherwise never looked into) and the site folders' `.pth`
files, which the interpreter reads only at start-up (an editable install, `pip install -e`, is
importable only through its `.pth` file). A site folder with a `.pth` file not read before is
read again with `site.addsitedir`, as start-up reads it (which runs the folder's `.pth` import
lines again: those of pip's editable installs and setuptools install their finder only once);
the `.pth` files present when this module is first imported count as read (the silo service
imports it as it starts).

Python cannot load a module again once imported (`importlib.reload` leaves every object made
from the old code, and other modules' references to it, as they were): a plug-in whose package
changed on disk since this process loaded it (a module file's modification time, or its
distribution's version) is refused from the next `read_afresh` on with `PluginChanged`, which
says the agent must restart.
"""

from __future__ import annotations

import importlib
import os
import site
import sys
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, PackageNotFoundError, version
from pathlib import Path
from typing import Any

SHOWN_MODULES = 3


class PluginChanged(Exception):
    """A plug-in whose code changed on disk after this process loaded it; its text completes
    "plug-in 'module:attr' ...", and says that the agent must restart."""


def site_folders() -> list[str]:
    """The folders whose `.pth` files start-up reads: site-packages (the virtual environment's,
    in one) and, where enabled, the user's."""
    folders = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        folders.append(site.getusersitepackages())
    return [folder for folder in folders if os.path.isdir(folder)]


def path_files() -> set[tuple[Path, int]]:
    """The site folders' `.pth` files, each with its modification time."""
    found = (
        (path, _mtime(path)) for folder in site_folders() for path in Path(folder).glob("*.pth")
    )
    return {(path, when) for path, when in found if when is not None}  # gone since: not there


@dataclass
class LoadedPackage:
    """A plug-in's top-level package as this process loaded it: its distribution and version
    (None for an entry point made by hand, without one), and its modules' files, each with its
    modification time when first seen loaded."""

    distribution: str | None
    version: str | None
    files: dict[str, tuple[Path, int | None]] = field(default_factory=dict)

    def changes(self) -> str:
        """What changed on disk since: the distribution's version, modified module files."""
        changes = []
        if self.distribution is not None:
            try:
                now = version(self.distribution)
            except PackageNotFoundError:
                now = "uninstalled"
            if now != self.version:
                changes.append(f"{self.distribution} {self.version} -> {now}")
        modified = sorted(name for name, (path, when) in self.files.items() if _mtime(path) != when)
        if modified:
            more = len(modified) - SHOWN_MODULES
            listed = ", ".join(modified[:SHOWN_MODULES]) + (f" and {more} more" if more > 0 else "")
            changes.append(f"{'module' if len(modified) == 1 else 'modules'} {listed} modified")
        return ", ".join(changes)


class Plugins:
    """The plug-in packages this process loaded, and the import system's view of what is
    installed (see the module's docstring)."""

    def __init__(self) -> None:
        self.packages: dict[str, LoadedPackage] = {}
        self.changed: dict[str, str] = {}  # package -> what changed, as of the last read_afresh
        self.read_path_files = path_files()

    def load(self, entry_point: EntryPoint) -> Any:
        """The object `entry_point` names; `PluginChanged` when its package changed on disk
        since this process loaded it (as of the last `read_afresh`)."""
        package = entry_point.module.partition(".")[0]
        if package in self.changed:
            raise PluginChanged(
                f"changed since this agent loaded it ({self.changed[package]}): restart the silo "
                "agent to use it"
            )
        loaded = entry_point.load()
        dist = entry_point.dist
        record = self.packages.setdefault(
            package, LoadedPackage(dist.name if dist else None, dist.version if dist else None)
        )
        for name, module in list(sys.modules.items()):
            file = getattr(module, "__file__", None)
            if file and name not in record.files and name.partition(".")[0] == package:
                record.files[name] = (Path(file), _mtime(Path(file)))
        return loaded

    def read_afresh(self) -> dict[str, str]:
        """Bring the import system up to date with what is installed now (new folders, new
        `.pth` files), and mark the loaded plug-in packages that changed on disk since; returns
        those, each with what changed."""
        importlib.invalidate_caches()
        now = path_files()
        unread = {str(path.parent) for path, _ in now - self.read_path_files}
        on_path = {os.path.abspath(entry) for entry in sys.path if entry}
        for folder in site_folders():
            if folder in unread or os.path.abspath(folder) not in on_path:
                site.addsitedir(folder)
        self.read_path_files = now
        for package, record in self.packages.items():
            changes = record.changes()
            if changes:
                self.changed[package] = changes
        return dict(self.changed)


def _mtime(path: Path) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except OSError:  # removed, or not a file of its own (a module in a zip file)
        return None


PLUGINS = Plugins()  # this process's


def load_plugin(entry_point: EntryPoint) -> Any:
    """`Plugins.load` for this process."""
    return PLUGINS.load(entry_point)


def load_or_refuse(entry_point: EntryPoint, error: type[Exception], plugin: str) -> Any:
    """`load_plugin`, or `error` with one message that starts with `plugin` (how the caller
    names it: "model factory 'm:f'") and says why: changed on disk since this process loaded
    it, or broken (its exception, never a traceback)."""
    try:
        return load_plugin(entry_point)
    except PluginChanged as changed:
        raise error(f"{plugin} {changed}") from None
    except Exception as broken:  # the package is broken: say so, never a traceback
        raise error(f"{plugin} cannot be loaded: {type(broken).__name__}: {broken}") from None


def read_afresh() -> dict[str, str]:
    """`Plugins.read_afresh` for this process."""
    return PLUGINS.read_afresh()
