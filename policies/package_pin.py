"""The pin of a plug-in package whose code a policy makes every party run (a strategy plug-in,
a training step): the installed distribution's version and the digest of its code, which the
policy's signature covers. A site whose installed package differs in either refuses the job.

The digest is BLAKE2b-256 (hex) of the package's source files: every `.py` file under the
folder of the entry point's top-level package, in sorted order of their paths relative to it,
each as its path, a NUL, its length, a NUL and its bytes. It is the same for a wheel and an
editable install of the same code, and changes with any change of its code; compiled caches
(`__pycache__`) and data files do not count.
"""

from __future__ import annotations

import hashlib
import importlib.util
from importlib.metadata import EntryPoint
from pathlib import Path

from pydantic import Field

from fedsilo.policies.base import PolicyModel

PIN_COMMAND = "fedsilo plugin pin"


class PackagePin(PolicyModel):
    """What a plug-in's package must be at every site: its version and code digest."""

    # the version of the distribution the plug-in belongs to, as `pip show` prints it (e.g.
    # 0.1.0); `fedsilo plugin pin` prints it
    version: str = Field(min_length=1)
    # the BLAKE2b-256 digest (64 hex digits) of the package's Python files, which `fedsilo plugin
    # pin` prints; a site whose installed code differs refuses the job
    digest: str = Field(pattern=r"^[0-9a-f]{64}$")


def package_folder(module: str) -> Path | None:
    """The folder of `module`'s top-level package (None: not installed, or a lone module)."""
    top = module.partition(".")[0]
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def code_digest(folder: Path) -> str:
    """BLAKE2b-256 of the `.py` files under `folder` (see the module's docstring)."""
    digest = hashlib.blake2b(digest_size=32)
    files = sorted(
        path
        for path in folder.rglob("*.py")
        if path.is_file() and "__pycache__" not in path.relative_to(folder).parts
    )
    for path in files:
        data = path.read_bytes()
        name = path.relative_to(folder).as_posix().encode()
        digest.update(name + b"\0" + str(len(data)).encode() + b"\0" + data)
    return digest.hexdigest()


def installed_pin(entry_point: EntryPoint) -> PackagePin | None:
    """The pin of the package `entry_point` belongs to, as installed here (None: it has no
    distribution or no package folder, so it cannot be pinned)."""
    folder = package_folder(entry_point.module)
    if entry_point.dist is None or folder is None:
        return None
    return PackagePin(version=entry_point.dist.version, digest=code_digest(folder))


def pin_problem(entry_point: EntryPoint, pinned: PackagePin, key: str) -> str | None:
    """Why the installed package of `entry_point` is not the one `pinned` (None: it is); `key`
    names the policy's pin."""
    installed = installed_pin(entry_point)
    where = f"{entry_point.value} (entry point {entry_point.name!r} of {entry_point.group})"
    if installed is None:
        return (
            f"{key}: {where} is not in an installed package, so its code cannot be pinned; "
            "install it as a package (pip install)"
        )
    distribution = entry_point.dist.name if entry_point.dist else "?"
    if installed.version != pinned.version:
        return (
            f"{key}.version: the policy pins {pinned.version}, this site has {distribution} "
            f"{installed.version} installed; install the pinned version or pin this one "
            f"(`{PIN_COMMAND} {entry_point.value}`)"
        )
    if installed.digest != pinned.digest:
        return (
            f"{key}.digest: the code of {distribution} {installed.version} installed here has "
            f"digest {installed.digest}, the policy pins {pinned.digest}: the same version with "
            f"other code; install the pinned code or pin this one (`{PIN_COMMAND} "
            f"{entry_point.value}`)"
        )
    return None
