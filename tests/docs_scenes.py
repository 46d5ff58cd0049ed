"""What each tutorial and how-to page's reader brings and does beside the page's own commands
(`tests/docs_harness.py` runs the page): their CSV, their kit, free ports for the ones printed,
the id of the job they submitted, waiting for a job to end, starting the other sites the same
way. `SCENES` has one entry per page of docs/tutorials and docs/how-to."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from fedsilo.ops.demo import free_port
from tests.docs_harness import REPO, Elsewhere, Scene, Session, wait_for_port

ENDED = ("completed", "failed", "refused", "aborted")


def write_records(path: Path, hospitals: tuple[str, ...] = (), rows: int = 150) -> None:
    """A hospital's export as a user would bring it: an id, age, smoker (no/yes), blood
    pressure with some values missing, a 0/1 outcome that depends on them; with `hospitals`,
    `rows` per hospital and a `hospital` column naming each row's."""
    rng = np.random.default_rng(7)
    frames = []
    for index, hospital in enumerate(hospitals or ("",)):
        age = rng.integers(30, 80, rows)
        smoker = rng.random(rows) < 0.35
        bp = rng.normal(130, 15, rows).round()
        risk = 0.06 * (age - 55) + 1.2 * smoker + 0.04 * (bp - 130) + 0.3 * (index - 1)
        outcome = rng.random(rows) < 1 / (1 + np.exp(-risk))
        bp[rng.random(rows) < 0.05] = np.nan
        frame = pd.DataFrame(
            {
                "patient_id": [f"p{index}-{row}" for row in range(rows)],
                "age": age,
                "smoker": np.where(smoker, "yes", "no"),
                "bp": bp,
                "outcome": outcome.astype(int),
            }
        )
        if hospitals:
            frame.insert(0, "hospital", hospital)
            frame = frame.drop(columns="patient_id")
        frames.append(frame)
    pd.concat(frames).to_csv(path, index=False)


def jobs(session: Session) -> list[dict]:
    """Every job of the page's coordinator, as `job list --json` gives them."""
    listed = session.run("fedsilo job list --kit kits/operator --json")
    return json.loads(listed)["jobs"]


def the_job(session: Session) -> str:
    """The id of the one job this page submitted (`job list --json`)."""
    (job,) = jobs(session)
    return job["job_id"]


def wait_for_job(
    job: Callable[[Session], str], ended: tuple[str, ...] = ENDED, *, timeout_s: float = 300
) -> Callable[[Session], None]:
    """A `before` hook: until `job` has ended (any of `ENDED`); then it must have ended as
    the page expects, one of `ended` (`completed` before its results are fetched)."""

    def wait(session: Session) -> None:
        job_id, deadline, status = job(session), time.monotonic() + timeout_s, ""
        while time.monotonic() < deadline:
            status = next(j["status"] for j in jobs(session) if j["job_id"] == job_id)
            if status in ENDED:
                break
            time.sleep(2)
        assert status in ended, f"job {job_id} is {status}, the page expects {ended}"

    return wait


def coordinator_listens(session: Session) -> None:
    """An `after` hook of `coordinator serve`: until it accepts connections."""
    wait_for_port(int(session.value("50051")), session.serving[-1].process)


def port(_: Session) -> str:
    return str(free_port())


def own_csv() -> Scene:
    return Scene(
        given=lambda session: write_records(
            session.folder / "records.csv", hospitals=("north", "south", "east")
        ),
        values={"50051": port, "JOB": the_job},
        repeat={"north": ("south", "east")},
        after={r"^fedsilo coordinator serve": coordinator_listens},
        before={r"^fedsilo job results": wait_for_job(the_job, ("completed",))},
    )


def own_model() -> Scene:
    """The reader is in the checkout after `make setup`: its `.venv` and `examples/`."""

    def checkout(session: Session) -> None:
        (session.folder / ".venv").symlink_to(Path(sys.executable).parent.parent)
        (session.folder / "examples").symlink_to(REPO / "examples")

    return Scene(given=checkout)


def plugin_environment(session: Session) -> None:
    """A virtual environment of the reader's own in which fedsilo is installed, offline: it
    sees this test environment's packages (torch, fedsilo) through a `.pth` file, has its own
    `pip` and `fedsilo` scripts, and pip is set to use no index and no build isolation (the
    page's `--no-build-isolation`, here from pip's environment). So `pip install -e mymodel`
    installs into it, never into the environment running the tests."""
    environment = session.folder / ".env"
    subprocess.run([sys.executable, "-m", "venv", str(environment)], check=True)
    python = environment / "bin" / "python"
    paths = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    )
    ours = sysconfig.get_paths()["purelib"]
    (Path(paths.stdout.strip()) / "_test_environment.pth").write_text(
        f"import site; site.addsitedir({ours!r})\n"
    )
    # a venv's own old setuptools (Python < 3.12) would shadow ours, the build backend
    subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", "setuptools"], check=True)
    script = (Path(sys.executable).parent / "fedsilo").read_text().split("\n", 1)[1]
    (environment / "bin" / "fedsilo").write_text(f"#!{python}\n{script}")
    (environment / "bin" / "fedsilo").chmod(0o755)
    session.use_bin(environment / "bin")
    session.env.update(PIP_NO_INDEX="1", PIP_NO_BUILD_ISOLATION="0")  # "0": do not isolate


def hospital_it() -> Scene:
    """A hospital with its kit from a provisioned consortium whose coordinator serves, its
    export, the policy it checks against, a completed job's model and new records."""

    def given(session: Session) -> None:
        write_records(session.folder / "records.csv")
        records = pd.read_csv(session.folder / "records.csv")
        records.drop(columns="outcome").head(20).to_csv(session.folder / "new.csv", index=False)
        (session.folder / "consortium.yaml").write_text(
            yaml.safe_dump(
                {
                    "consortium": "hospital",
                    "coordinator": {"address": f"127.0.0.1:{session.value('50051')}"},
                    "silos": [{"name": "here"}, {"name": "there"}],
                }
            )
        )
        session.run("fedsilo provision --consortium consortium.yaml --out kits/")
        shutil.copytree(session.folder / "kits/silos/here", session.folder / "kit")
        session.serve("fedsilo coordinator serve --kit kits/coordinator --state state.db")
        coordinator_listens(session)
        session.run("fedsilo examples copy heart-fedavg --out heart.yaml")
        policy = yaml.safe_load((session.folder / "heart.yaml").read_text())
        policy["data"] = {
            "source": "csv",
            "path": "records.csv",
            "target": "outcome",
            "categorical": {"smoker": ["no", "yes"]},
            "missing": "impute",
            "drop_columns": ["patient_id"],
            "partition": {"kind": "iid", "silos": 3},
        }
        policy["rounds"] = 3
        (session.folder / "heart.yaml").write_text(yaml.safe_dump(policy))
        session.run("fedsilo simulate --policy heart.yaml --out results")

    return Scene(
        given=given,
        values={"50051": port, "9465": port},
        after={r"^fedsilo silo start": lambda session: time.sleep(3)},
        elsewhere={
            **WHEEL,
            "podman run -d --name silo --restart unless-stopped -v fedsilo-silo:/var/lib/fedsilo "
            '-v "$PWD/kit:/etc/fedsilo/kit:ro" -v "$PWD/silo.yaml:/etc/fedsilo/silo.yaml:ro" '
            "-v /srv/exports:/data:ro fedsilo:0.2.0 silo start --config /etc/fedsilo/silo.yaml": (
                SILO_CONTAINER
            ),
        },
    )


def operator() -> Scene:
    """`heart-fedavg-3f9a1c2e` is the job the page submits. The hospitals start their agents
    on the bundled heart records (hospital-it.md) only once the operator has aborted it, so
    the job the page aborts is still waiting for them to join (`job status` says so), and its
    retry runs to the end."""

    def hospitals_start(session: Session) -> None:
        wait_for_job(submitted, ("aborted",))(session)
        for name, select in (
            ("cleveland", "Cleveland"),
            ("hungary", "Hungary"),
            ("va", "VA Long Beach"),
        ):
            session.run(
                f"fedsilo silo init --kit kits/silos/{name} --out {name}/silo.yaml"
                f" --source heart --select '{select}'"
            )
            session.serve(f"fedsilo silo start --config {name}/silo.yaml")

    def submitted(session: Session) -> str:
        return next(job["job_id"] for job in jobs(session) if job["attempt"] == 1)

    def attempt2(session: Session) -> str:
        return f"{submitted(session)}-attempt2"

    return Scene(
        values={"50051": port, "9464": port, "heart-fedavg-3f9a1c2e": submitted},
        after={
            r"^fedsilo provision --example": lambda session: session.substitute_file(
                "consortium.yaml"
            ),
            r"^fedsilo coordinator serve": coordinator_listens,
            # a revoked silo's agent exits, saying so (operator.md, "Silos between jobs")
            r"revoke hungary": lambda session: session.ends(
                "--config hungary/silo.yaml", "revoked"
            ),
            r"revoke va": lambda session: session.ends("--config va/silo.yaml", "revoked"),
        },
        before={
            r"--retry": hospitals_start,
            r"^fedsilo job results": wait_for_job(attempt2, ("completed",)),
        },
    )


QUICK_START = {
    "make demo": Elsewhere(
        "its recipe is `fedsilo demo` after `make setup`; tests/test_demo.py runs `fedsilo demo`"
        " (2 rounds of the 40) and checks what it prints",
        "Makefile",
        "$(BIN)/fedsilo demo --folder runs/demo-",
    ),
    "make test": Elsewhere(
        "CI's .ci/run runs it, and this harness is part of it", ".ci/run", "make test"
    ),
}

RAY_CLUSTER = Elsewhere(
    "starts or joins a Ray cluster of several machines, which no test has; the local instance"
    " runs here, and tests/test_ray_backend.py checks --address's refusals",
    "tests/test_ray_backend.py",
    "no Ray head answers there",
)


# tracking.md: the viewers serve until stopped, the deployment needs a consortium
TRACKING = {
    "pip install 'fedsilo[tracking]'": Elsewhere(
        "`make setup` installs the dev extra, which holds the tracking extra's packages",
        "pyproject.toml",
        '"mlflow-skinny>=',
    ),
    "mlflow ui --backend-store-uri sqlite:///mlflow.db": Elsewhere(
        "MLflow's UI serves until stopped (and needs the full mlflow package): the test reads "
        "the same store with MLflow's client",
        "tests/test_tracking.py",
        "client = MlflowClient(store(",
    ),
    "tensorboard --logdir runs/tb": Elsewhere(
        "TensorBoard serves until stopped: the test reads the same event files with "
        "TensorBoard's own reader",
        "tests/test_tracking.py",
        "EventAccumulator(str(folder)",
    ),
    "fedsilo coordinator serve --kit kits/coordinator --state state.db --track "
    "mlflow:sqlite:////srv/fedsilo/mlflow.db --track tensorboard:/srv/fedsilo/tb": Elsewhere(
        "needs a provisioned consortium and writes /srv: the test serves one with both --track",
        "tests/test_tracking.py",
        'consortium.start_serve("--track", f"mlflow:{store(root)}", "--track", "tensorboard:tb")',
    ),
}


def a_policy(session: Session) -> None:
    """The reader's policy, P.yaml."""
    session.run("fedsilo examples copy heart-fedavg --out P.yaml")


def first_runs_digest(session: Session) -> str:
    """The digest `fedsilo model digest` printed for the first run's final model, which the
    reader pastes (the page shows the one its run printed; another machine's run may differ)."""
    printed = session.run("fedsilo model digest runs/first/final_model.safetensors")
    return yaml.safe_load("model:\n" + printed)["model"]["init"]["digest"]


# the wheel as hospital-it.md installs it: ci/check-wheel.sh does the same outside the checkout
WHEEL = {
    "python3 -m venv /opt/fedsilo": Elsewhere(
        "writes /opt: ci/check-wheel.sh makes the virtualenv in a temporary folder",
        "ci/check-wheel.sh",
        '"$python" -m venv "$work/venv"',
    ),
    "/opt/fedsilo/bin/pip install -c constraints.txt fedsilo-0.2.0-py3-none-any.whl": Elsewhere(
        "ci/check-wheel.sh installs the wheel it builds, with constraints.txt",
        "ci/check-wheel.sh",
        'install -c "$repo/constraints.txt" "$wheel"',
    ),
    "/opt/fedsilo/bin/fedsilo --version": Elsewhere(
        "ci/check-wheel.sh runs the installed wheel's fedsilo",
        "ci/check-wheel.sh",
        'step "fedsilo --version"',
    ),
}
# the container image and the compose consortium: ci/check-image.sh builds and runs them
IMAGE = {
    "podman build --format docker -t fedsilo:0.2.0 -f Containerfile .": Elsewhere(
        "needs root and podman: ci/check-image.sh builds the image",
        "ci/check-image.sh",
        "podman build --quiet --format docker",
    ),
    "IMAGE=fedsilo:0.2.0 deploy/compose/try.sh": Elsewhere(
        "needs root and podman: ci/check-image.sh runs it",
        "ci/check-image.sh",
        'bash "$repo/deploy/compose/try.sh"',
    ),
}
COMPOSE_OPERATOR = Elsewhere(
    "the operator's path of deploy/compose: try.sh submits and follows a job so",
    "deploy/compose/try.sh",
    "--coordinator 127.0.0.1:",
)
CROSS_SITE_DEPLOYED = Elsewhere(
    "needs a serving coordinator and silos that ran a job asking for cross-site validation: the"
    " test runs one",
    "tests/test_cross_site_validation.py",
    'main, ["job", "validate", short, *operator]',
)
JOB_VALIDATE = {
    "fedsilo job validate JOB --kit kits/operator": CROSS_SITE_DEPLOYED,
    "fedsilo job validate JOB --kit kits/operator --json": CROSS_SITE_DEPLOYED,
}
SITE_PLAN = Elsewhere(
    "needs a site's silo.yaml and kit: the test provisions one, with a cap below the plan",
    "tests/test_budget_plan_cli.py",
    "def test_a_site_whose_cap_is_below_the_plan_refuses_with_both_numbers(",
)
SILO_CONTAINER = Elsewhere(
    "needs root and podman: the compose consortium starts its silos so",
    "deploy/compose/compose.yaml",
    "command: [silo, start, --config, /etc/fedsilo/silo.yaml]",
)


PROMETHEUS_HOST = {  # commands on the operator's Prometheus host
    "promtool check config /etc/prometheus/prometheus.yml": Elsewhere(
        "needs a Prometheus install: tests/test_alert_rules.py runs promtool on the rules where it"
        " is installed, and checks the compose Prometheus loads them",
        "tests/test_alert_rules.py",
        '["promtool", "check", "rules", str(ALERTS)]',
    ),
    'kill -HUP "$(pidof prometheus)"': Elsewhere(
        "needs a running Prometheus: the compose deployment's loads the rules at its start",
        "deploy/compose/prometheus.yml",
        "rule_files:",
    ),
}


def a_prometheus_folder(session: Session) -> None:
    """The reader's Prometheus configuration folder."""
    (session.folder / "prometheus").mkdir()


SCENES: dict[str, Callable[[], Scene]] = {
    "metrics.md": lambda: Scene(
        given=a_prometheus_folder,
        values={"/etc/prometheus/": "prometheus/"},
        elsewhere=PROMETHEUS_HOST,
    ),
    "index.md": lambda: Scene(elsewhere=QUICK_START),
    "tutorials/demo.md": lambda: Scene(elsewhere=QUICK_START),
    "tutorials/own-csv.md": own_csv,
    "tutorials/own-model.md": own_model,
    "how-to/new-plugin-package.md": lambda: Scene(given=plugin_environment),
    "how-to/research-plugins.md": lambda: Scene(given=plugin_environment),
    "how-to/hospital-it.md": hospital_it,
    "how-to/containers.md": lambda: Scene(
        elsewhere={
            **IMAGE,
            "fedsilo job submit heart.yaml --kit kits/operator --key kits/operator/operator.key "
            "--coordinator 127.0.0.1:50051": COMPOSE_OPERATOR,
            "fedsilo job status JOB --kit kits/operator --coordinator 127.0.0.1:50051": (
                COMPOSE_OPERATOR
            ),
        }
    ),
    "how-to/operator.md": operator,
    "how-to/researcher.md": Scene,
    "how-to/warm-start.md": lambda: Scene(
        values={
            "8c11a81468aae7abad0688debb0a09f1076b9267fa4c15b75ca4f694d57c4b3a": first_runs_digest
        }
    ),
    "how-to/site-data.md": Scene,
    "how-to/privacy-officer.md": Scene,
    "how-to/cross-site-validation.md": lambda: Scene(elsewhere=JOB_VALIDATE),
    "adding-an-algorithm.md": Scene,
    "privacy.md": lambda: Scene(
        elsewhere={
            "fedsilo privacy plan example:fedavg_dp --config silo.yaml": SITE_PLAN,
            "fedsilo silo check --config silo.yaml --policy example:fedavg_dp": SITE_PLAN,
        }
    ),
    "python-api.md": Scene,
    "robust-aggregation.md": lambda: Scene(
        elsewhere={
            "python -m bench.robust": Elsewhere(
                "runs the whole benchmark from a checkout (minutes); its --quick configuration "
                "runs in tests/test_robust_bench.py",
                "tests/test_robust_bench.py",
                'robust.main(["--quick"])',
            )
        }
    ),
    "compression.md": lambda: Scene(
        elsewhere={
            "python -m bench.compression": Elsewhere(
                "runs the whole benchmark from a checkout (minutes); its --quick configuration "
                "runs in tests/test_compression.py",
                "tests/test_compression.py",
                'compression_bench.main(["--quick"])',
            )
        }
    ),
    "how-to/tracking.md": lambda: Scene(elsewhere=TRACKING),
    "ray-backend.md": lambda: Scene(
        given=a_policy,
        elsewhere={
            "pip install 'fedsilo[ray]'": Elsewhere(
                "`make setup` installs the dev extra, which holds Ray",
                "pyproject.toml",
                '"ray>=2.52",',
            ),
            "fedsilo simulate --policy P.yaml --backend ray --address auto": RAY_CLUSTER,
            "ray start --head --port=6379": RAY_CLUSTER,
            "ray start --address=HEAD_IP:6379": RAY_CLUSTER,
        },
    ),
}
