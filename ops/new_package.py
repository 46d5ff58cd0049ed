"""`fedsilo new NAME`: a plug-in package to start from, as `flwr new` makes a Flower app.

It writes, from the Jinja templates in `ops/templates/new_package/` (package data), a package
that runs as it is: a pyproject.toml registering its entry points (groups `fedsilo.models`,
`fedsilo.datasets` and, with `--task`, `fedsilo.tasks`; with `--strategy`,
`fedsilo.algorithms`; with `--step`, `fedsilo.steps`), a model factory, a data loader that
draws its rows in place (never a download), optionally a task plug-in, a strategy plug-in
(FedBN, written against the public API only) and training steps, a policy that uses them with
the model's architecture already pinned, a README and the package's own tests. The
architecture pin is what `fedsilo model pin` would print once the package is installed: the
generated factory is built here, from the file just rendered, for the loader's input shape
and outputs; the package pin (a strategy's or a step's) is what `fedsilo plugin pin` would
print: version 0.1.0 and the digest of the rendered package's code.

NAME is the distribution's name and the folder's; the import package is NAME in lower case
with '-' and '.' as '_'. The output folder must be new or empty: the package is rendered into
a temporary folder first and moved into place once complete, so nothing of the user's is ever
replaced and a failure leaves nothing behind.
"""

from __future__ import annotations

import importlib.util
import keyword
import re
import shlex
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import click
from jinja2 import Environment, PackageLoader, StrictUndefined

from fedsilo.models import architecture
from fedsilo.policies.package_pin import code_digest

# PEP 508's distribution name: letters, digits, '.', '-', '_', a letter or digit at each end
DISTRIBUTION_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$")
FEATURES = 12  # the generated loader's features
CLASSES = 3  # its classes; under --task the model has one output, a log-rate
HIDDEN = 32  # the factory's hidden units, as the policy's model.args.hidden
POLICY = "policy.yaml"  # rendered last: it holds the pins of the rendered code
VERSION = "0.1.0"  # the package's, as pyproject.toml.j2 sets it
TEMPLATES = Environment(
    loader=PackageLoader("fedsilo.ops", "templates/new_package"),
    undefined=StrictUndefined,
    keep_trailing_newline=True,
    trim_blocks=True,
    lstrip_blocks=True,
    autoescape=False,  # Python, TOML, YAML and Markdown, not HTML
)


@dataclass(frozen=True)
class Package:
    """What the templates fill in: the distribution's NAME, its import package, and whether it
    has a task plug-in, a strategy plug-in and training steps."""

    name: str
    package: str
    task: bool
    strategy: bool = False
    step: bool = False

    def files(self) -> dict[str, str]:
        """The path in the output folder of each file rendered from a template, by its
        template; the policy, which holds the pin of the rendered models.py, comes after."""
        files = {
            "pyproject.toml.j2": "pyproject.toml",
            "README.md.j2": "README.md",
            "package/__init__.py.j2": f"{self.package}/__init__.py",
            "package/models.py.j2": f"{self.package}/models.py",
            "package/data.py.j2": f"{self.package}/data.py",
            "tests/test_package.py.j2": f"tests/test_{self.package}.py",
        }
        if self.task:
            files["package/task.py.j2"] = f"{self.package}/task.py"
        if self.strategy:
            files["package/strategy.py.j2"] = f"{self.package}/strategy.py"
        if self.step:
            files["package/steps.py.j2"] = f"{self.package}/steps.py"
        return files


@click.command("new")
@click.argument("name")
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    help="The package's folder, new or empty (default: NAME, in this folder).",
)
@click.option(
    "--task",
    is_flag=True,
    help="Add a task plug-in (counts as a Poisson rate: its own loss and metric) that the "
    "loader's rows and the policy use.",
)
@click.option(
    "--strategy",
    is_flag=True,
    help="Add a strategy plug-in (FedBN: FedAvg whose silos keep their normalisation layers "
    "local) that the policy selects, with its silo contract and its contract test.",
)
@click.option(
    "--step",
    is_flag=True,
    help="Add training steps (feature jitter; with early stopping on the validation split) "
    "that the policy's training.step uses.",
)
def new_command(name: str, out: Path | None, task: bool, strategy: bool, step: bool) -> None:
    """Write a plug-in package NAME: a model factory, a data loader, optionally a task, a
    strategy and training steps, their entry points, a policy using them pinned, and tests."""
    package = Package(name, import_package(name), task, strategy, step)
    out = out or Path(name)
    check_new_folder(out)
    try:
        write_package(package, out)
    except OSError as exc:
        raise click.ClickException(
            f"--out {out}: cannot write the package there: {exc.strerror}"
        ) from None
    shown = shlex.quote(str(out))
    click.echo(f"Created the plug-in package {name} in {out}/ (import package {package.package}).")
    click.echo("Install it and run its policy:")
    click.echo(f"  pip install -e {shown}")
    click.echo(f"  fedsilo simulate --policy {shlex.quote(str(out / 'policy.yaml'))}")
    click.echo(f"Its own tests: cd {shown} && pytest")


def import_package(name: str) -> str:
    """The import package of distribution NAME; a ClickException naming NAME when NAME is not a
    distribution name, makes no Python identifier, or would shadow a module importable here."""
    if not DISTRIBUTION_NAME.match(name):
        raise click.ClickException(
            f"NAME {name!r}: not a valid package name; use letters, digits, '-', '_' and '.', "
            "starting and ending with a letter or digit (e.g. mymodel)"
        )
    package = re.sub(r"[-_.]+", "_", name).lower()
    if not package.isidentifier() or keyword.iskeyword(package):
        raise click.ClickException(
            f"NAME {name!r}: its import package {package!r} is not a Python identifier; start "
            "it with a letter (e.g. mymodel)"
        )
    found = importlib.util.find_spec(package)
    if found is not None and found.origin is not None:  # a folder on the path is no conflict
        raise click.ClickException(
            f"NAME {name!r}: its import package {package!r} would shadow the module of that "
            f"name already importable here ({found.origin}); choose another NAME"
        )
    return package


def check_new_folder(out: Path) -> None:
    """A ClickException naming --out unless `out` is a new or an empty folder."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise click.ClickException(f"--out {out}: exists and is not a folder; it is left as it is")
    if out.is_dir() and any(out.iterdir()):
        raise click.ClickException(
            f"--out {out}: a folder that is not empty; fedsilo new writes only into a new or "
            "empty folder and never replaces a file: give another --out"
        )


def write_package(package: Package, out: Path) -> None:
    """Render the package into a temporary folder, then move it to `out`: the whole folder
    when `out` is new, else its entries into the empty `out`."""
    values = {
        "name": package.name,
        "package": package.package,
        "task": package.task,
        "strategy": package.strategy,
        "step": package.step,
        "features": FEATURES,
        "classes": CLASSES,
        "hidden": HIDDEN,
    }
    rendered = {
        path: TEMPLATES.get_template(template).render(values)
        for template, path in package.files().items()
    }
    rendered[POLICY] = TEMPLATES.get_template(f"{POLICY}.j2").render(
        values,
        architecture=pin(rendered[f"{package.package}/models.py"], package),
        package_pin=package_pin(rendered, package),
    )
    into_existing = out.is_dir()  # an empty one (checked), perhaps this very folder
    if not into_existing:
        out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(
        tempfile.mkdtemp(prefix=".fedsilo-new.", dir=out if into_existing else out.parent)
    )
    moved: list[Path] = []
    try:
        for path, text in rendered.items():
            (staging / path).parent.mkdir(parents=True, exist_ok=True)
            (staging / path).write_text(text, encoding="utf-8")
        if not into_existing:
            staging.rename(out)
            return
        for entry in sorted(staging.iterdir()):
            entry.rename(out / entry.name)
            moved.append(out / entry.name)
        staging.rmdir()
    except BaseException:
        for path in [staging, *moved]:
            shutil.rmtree(path, ignore_errors=True)
        raise


def package_pin(rendered: dict[str, str], package: Package) -> str:
    """The `package:` block (two spaces in) that pins the rendered package's code: version
    0.1.0 (pyproject.toml's) and the digest `fedsilo plugin pin` prints once it is installed."""
    with tempfile.TemporaryDirectory() as folder:
        for path, text in rendered.items():
            if path.startswith(f"{package.package}/"):
                (Path(folder) / path).parent.mkdir(parents=True, exist_ok=True)
                (Path(folder) / path).write_text(text, encoding="utf-8")
        digest = code_digest(Path(folder) / package.package)
    return f"  package:\n    version: {VERSION}\n    digest: {digest}"


def pin(models_source: str, package: Package) -> str:
    """The policy's `model.architecture` block: the network that `mlp` in the rendered
    `models_source` builds for the loader's rows (FEATURES inputs; CLASSES outputs, or one for
    the task plug-in's log-rate). The source is fedsilo's own template, run here as the silos
    will run it once installed."""
    namespace: dict[str, object] = {"__name__": f"{package.package}.models"}
    exec(compile(models_source, f"{package.package}/models.py", "exec"), namespace)
    shape, outputs = (FEATURES,), 1 if package.task else CLASSES
    model = namespace["mlp"](shape, outputs, hidden=HIDDEN)  # type: ignore[operator]
    return architecture.yaml_block(architecture.describe(model), shape, outputs)
