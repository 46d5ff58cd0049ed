"""The Kubernetes manifests (deploy/kubernetes): each overlay renders with `kubectl kustomize`,
every rendered object validates offline against the Kubernetes API's schemas
(kubernetes-validate, strict: an unknown field fails), and the workloads keep what
deploy/kubernetes/README.md promises: the image's contract (volumes, kit Secret, commands and
probes the CLI parses, the image tag of the package version), one pod per service as a
StatefulSet whose state claim outlives it, hardened pods, and a silo nothing can connect to.

The overlays generate their kit Secrets from kit/ folders an operator fills from
`fedsilo provision`; no key is committed. These tests provision a throw-away consortium with
the real CLI and render from a copy of deploy/kubernetes in tmp_path, so nothing is written
inside the repository. deploy/kubernetes/check.sh runs this file for CI.
"""

from __future__ import annotations

import base64
import copy
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any
from unittest import mock

import click
import kubernetes_validate
import pytest
import yaml

import fedsilo

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy" / "kubernetes"
KUBECTL = shutil.which("kubectl")
# The oldest Kubernetes the manifests promise to run on (deploy/kubernetes/README.md).
KUBERNETES_VERSION = "1.30.0"
NAMESPACE = "fedsilo"
COORDINATOR_ADDRESS = f"fedsilo-coordinator.{NAMESPACE}.svc:50051"
SILOS = ("cleveland", "hungary", "va")  # the all-in-one overlay's, as consortium.yaml's example
# overlay -> {its kit folder: the kit from `fedsilo provision` copied there}
KITS = {
    "coordinator": {"kit": "coordinator"},
    "silo": {"kit": "silos/cleveland"},
    "all-in-one": {
        "coordinator/kit": "coordinator",
        **{f"silos/{silo}/kit": f"silos/{silo}" for silo in SILOS},
    },
}
OVERLAYS = tuple(KITS)
UID = 10001
KIT_SECRET_MOUNT = "/etc/fedsilo/kit-secret"
KIT_COPY = "/run/fedsilo/kit"
STATE = "/var/lib/fedsilo"
RUN = "/run/fedsilo"
GRPC_PORT, METRICS_PORT = 50051, 9464
# The probes: fedsilo-health (ops/health.py) reads the health file the service rewrites.
PROBES = {
    "startupProbe": ["fedsilo-health"],
    "livenessProbe": ["fedsilo-health"],
    "readinessProbe": ["fedsilo-health", "--ready"],
}
RETAIN = {"whenDeleted": "Retain", "whenScaled": "Retain"}

Object = dict[str, Any]


def fedsilo_command() -> list[str]:
    """The fedsilo CLI: $FEDSILO, else this interpreter's package."""
    given = os.environ.get("FEDSILO")
    return [given] if given else [sys.executable, "-m", "fedsilo"]


def provision_kits(folder: Path) -> Path:
    """A throw-away consortium: the coordinator at its in-cluster Service name, three silos."""
    folder.mkdir(parents=True)
    consortium = folder / "consortium.yaml"
    consortium.write_text(
        yaml.safe_dump(
            {
                "consortium": "kubernetes-check",
                "coordinator": {"address": COORDINATOR_ADDRESS},
                "silos": [{"name": silo} for silo in SILOS],
            }
        )
    )
    kits = folder / "kits"
    command = [*fedsilo_command(), "provision", "--consortium", str(consortium), "--out", str(kits)]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stderr}"
    return kits


def render(overlay: Path) -> list[Object]:
    result = subprocess.run(
        [str(KUBECTL), "kustomize", str(overlay)], capture_output=True, text=True
    )
    assert result.returncode == 0, f"kubectl kustomize {overlay.name} failed:\n{result.stderr}"
    return [document for document in yaml.safe_load_all(result.stdout) if document]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Object]]:
    """Each overlay's objects, rendered from a copy of deploy/kubernetes with throw-away kits
    (an operator's own kit/ folders, git-ignored, are neither copied nor touched)."""
    if KUBECTL is None:
        pytest.skip("kubectl is not on PATH (`kubectl kustomize` renders the overlays)")
    work = tmp_path_factory.mktemp("kubernetes")
    kits = provision_kits(work / "consortium")
    tree = work / "deploy"
    shutil.copytree(DEPLOY, tree, ignore=shutil.ignore_patterns("kit"))
    for overlay, folders in KITS.items():
        for folder, kit in folders.items():
            shutil.copytree(kits / kit, tree / "overlays" / overlay / folder)
    return {overlay: render(tree / "overlays" / overlay) for overlay in OVERLAYS}


def name_of(document: Object) -> str:
    return f"{document['kind']}/{document['metadata']['name']}"


def workloads(documents: list[Object]) -> Iterator[Object]:
    """The objects that run pods (the manifests' are all StatefulSets: a test checks it)."""
    return (d for d in documents if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet"))


def pod_containers(workload: Object) -> list[Object]:
    pod = workload["spec"]["template"]["spec"]
    return pod["containers"] + pod.get("initContainers", [])


def of_kind(documents: list[Object], kind: str) -> list[Object]:
    return [d for d in documents if d["kind"] == kind]


def component(document: Object) -> str:
    return document["metadata"]["labels"]["app.kubernetes.io/component"]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def mounts(container: Object) -> dict[str, Object]:
    return {mount["mountPath"]: mount for mount in container.get("volumeMounts", [])}


def volume_at(workload: Object, container: Object, path: str) -> Object:
    """The volume (or volume claim template) mounted at `path`."""
    name = mounts(container)[path]["name"]
    spec = workload["spec"]
    volumes = {v["name"]: v for v in spec["template"]["spec"].get("volumes", [])}
    templates = {t["metadata"]["name"]: t for t in spec.get("volumeClaimTemplates", [])}
    if name in templates:
        return {"name": name, "volumeClaimTemplate": templates[name]}
    return volumes[name]


def silo_config(documents: list[Object], workload: Object) -> tuple[str, str]:
    """The silo.yaml a silo workload mounts, and the ConfigMap that holds it."""
    container = workload["spec"]["template"]["spec"]["containers"][0]
    config = container["args"][container["args"].index("--config") + 1]
    mount = mounts(container)[config]
    volume = volume_at(workload, container, config)
    configmap = next(
        c
        for c in of_kind(documents, "ConfigMap")
        if c["metadata"]["name"] == volume["configMap"]["name"]
    )
    return configmap["data"][mount["subPath"]], name_of(configmap)


def test_every_overlay_is_checked() -> None:
    assert sorted(p.name for p in (DEPLOY / "overlays").iterdir() if p.is_dir()) == sorted(OVERLAYS)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_objects_validate_against_the_kubernetes_schemas(
    rendered: dict[str, list[Object]], overlay: str
) -> None:
    failures = []
    for document in rendered[overlay]:
        try:
            kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            where = ".".join(str(part) for part in error.absolute_path) or "(top)"
            failures.append(f"{name_of(document)} at {where}: {error.message}")
        except kubernetes_validate.SchemaNotFoundError as error:
            failures.append(f"{name_of(document)}: {error.message}")
    assert not failures, (
        f"overlay {overlay}: objects invalid for Kubernetes {KUBERNETES_VERSION}:\n"
        + "\n".join(failures)
    )


def test_strict_validation_rejects_an_unknown_field(rendered: dict[str, list[Object]]) -> None:
    """The check above has teeth: a misspelt field of a workload fails it."""
    broken = copy.deepcopy(next(workloads(rendered["silo"])))
    broken["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError, match="livenesProbe"):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_no_kit_or_key_is_committed() -> None:
    """What git would commit under deploy/kubernetes holds no kit file, and a kit copied into
    an overlay's kit/ folder is ignored."""
    listed = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "--cached", "--others", "--exclude-standard"]
        + ["deploy/kubernetes"],
        capture_output=True,
        text=True,
    )
    if listed.returncode != 0:
        pytest.skip(f"not a git checkout: {listed.stderr.strip()}")
    files = listed.stdout.split()
    assert files, "git sees no file under deploy/kubernetes"
    committed = [f for f in files if f.endswith((".key", ".crt")) or "kit" in Path(f).parent.parts]
    assert not committed, f"kit files would be committed (generate the Secrets): {committed}"
    kit_files = [
        f"deploy/kubernetes/overlays/{overlay}/{folder}/signing.key"
        for overlay, folders in KITS.items()
        for folder in folders
    ]
    ignored = subprocess.run(
        ["git", "-C", str(ROOT), "check-ignore", "--no-index", *kit_files],
        capture_output=True,
        text=True,
    ).stdout.split()
    assert sorted(ignored) == sorted(kit_files), "a kit/ folder is not git-ignored"
    secrets = [
        f
        for f in files
        if f.endswith((".yaml", ".yml"))
        for document in yaml.safe_load_all((ROOT / f).read_text())
        if isinstance(document, dict) and document.get("kind") == "Secret"
    ]
    assert not secrets, f"Secret manifests are committed: {secrets}"


def image_reference(image: str) -> tuple[str, str | None, str | None]:
    """An image reference's name (with its registry), tag and digest."""
    image, _, digest = image.partition("@")
    name, _, tag = image.rpartition(":") if ":" in image.rsplit("/", 1)[-1] else (image, "", "")
    return name, tag or None, digest or None


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_are_hardened(rendered: dict[str, list[Object]], overlay: str) -> None:
    for workload in workloads(rendered[overlay]):
        where = f"overlay {overlay}, {name_of(workload)}"
        assert workload["spec"]["replicas"] == 1, where
        pod = workload["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False, where
        assert pod["securityContext"] == {
            "runAsNonRoot": True,
            "runAsUser": UID,
            "runAsGroup": UID,
            "fsGroup": UID,
            "fsGroupChangePolicy": "OnRootMismatch",
            "seccompProfile": {"type": "RuntimeDefault"},
        }, where
        for container in pod_containers(workload):
            there = f"{where}, container {container['name']}"
            assert {"cpu", "memory"} <= set(container["resources"]["requests"]), there
            assert "memory" in container["resources"]["limits"], there
            for probe, command in PROBES.items():
                assert container[probe]["exec"]["command"] == command, f"{there}: {probe}"
                # fedsilo-health loads no torch: it answers in a fraction of a second
                assert 1 <= container[probe]["timeoutSeconds"] <= 5, f"{there}: {probe}"
            startup = container["startupProbe"]
            budget = startup["periodSeconds"] * startup["failureThreshold"]
            assert budget >= 300, f"{there}: {budget} s to start (torch's import, a resumed job)"
            assert container["securityContext"] == {
                "runAsNonRoot": True,
                "allowPrivilegeEscalation": False,
                "readOnlyRootFilesystem": True,
                "capabilities": {"drop": ["ALL"]},
            }, there
            name, tag, digest = image_reference(container["image"])
            assert name.rsplit("/", 1)[-1] == "fedsilo", there
            # the bases' tag (the package version), unless an operator pinned a digest
            assert tag == fedsilo.__version__ or digest, there
    images = {c["image"] for w in workloads(rendered[overlay]) for c in pod_containers(w)}
    assert len(images) == 1, f"overlay {overlay}: workloads run different images: {images}"


def test_the_image_tag_is_the_package_version() -> None:
    """The bases run `fedsilo:<fedsilo.__version__>`, and every `fedsilo:X.Y.Z` under
    deploy/kubernetes (README.md, the overlays' comments) names that version: a release that
    bumps the version and forgets the manifests fails here."""
    wanted = f"fedsilo:{fedsilo.__version__}"
    images = [
        (path.relative_to(ROOT), container["image"])
        for path in sorted((DEPLOY / "base").rglob("*.yaml"))
        for document in yaml.safe_load_all(path.read_text())
        if isinstance(document, dict) and "kind" in document
        for workload in workloads([document])
        for container in pod_containers(workload)
    ]
    assert len(images) == 2, f"the bases' workloads: {images}"  # coordinator and silo
    assert [image for _, image in images] == [wanted] * len(images), images
    stale = [
        f"{path.relative_to(ROOT)}: {match.group(0)}"
        for path in sorted(DEPLOY.rglob("*"))
        if path.is_file() and "kit" not in path.relative_to(DEPLOY).parts
        for match in re.finditer(
            r"fedsilo:v?\d+\.\d+\.\d+[\w.+-]*", path.read_text("utf-8", "replace")
        )
        if match.group(0).rstrip(".") != wanted
    ]
    assert not stale, f"not the package version {fedsilo.__version__}: {stale}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_service_is_one_statefulset_pod(
    rendered: dict[str, list[Object]], overlay: str
) -> None:
    """One pod per coordinator or silo, as a StatefulSet: a pod of the same name starts only
    once the previous one is gone, even from a node that stopped answering, so two agents of
    one silo never write its privacy ledger at once. The state is a volumeClaimTemplate whose
    claim the StatefulSet keeps (retention Retain) and `kubectl delete -k` does not list."""
    documents = rendered[overlay]
    services = {s["metadata"]["name"]: s for s in of_kind(documents, "Service")}
    claims = {c["metadata"]["name"] for c in of_kind(documents, "PersistentVolumeClaim")}
    for workload in workloads(documents):
        where = f"overlay {overlay}, {name_of(workload)}"
        assert workload["kind"] == "StatefulSet", where
        spec = workload["spec"]
        assert spec["replicas"] == 1, where
        # Parallel: OrderedReady would hold a new kit back from a pod that is not ready, and
        # a silo is not ready while its coordinator does not answer it
        assert spec["podManagementPolicy"] == "Parallel", where
        assert spec.get("updateStrategy", {}).get("type", "RollingUpdate") == "RollingUpdate"
        assert spec["persistentVolumeClaimRetentionPolicy"] == RETAIN, where
        (container,) = spec["template"]["spec"]["containers"]
        state = volume_at(workload, container, STATE)
        assert "volumeClaimTemplate" in state, f"{where}: {STATE} is not a volumeClaimTemplate"
        template = state["volumeClaimTemplate"]
        assert template["spec"]["accessModes"] == ["ReadWriteOnce"], where
        assert template["metadata"]["name"] not in claims, where
        # the governing Service the API requires: it selects these pods
        governing = services[spec["serviceName"]]
        labels = spec["template"]["metadata"]["labels"]
        assert selects(governing["spec"]["selector"], labels), where
        if component(workload) == "silo":  # a name only: headless, no port
            assert governing["spec"]["clusterIP"] == "None", where
            assert not governing["spec"].get("ports"), where
            assert governing["spec"].get("type", "ClusterIP") == "ClusterIP", where


@pytest.mark.parametrize("overlay", ["coordinator", "silo"])
def test_the_namespace_outlives_kubectl_delete(
    rendered: dict[str, list[Object]], overlay: str
) -> None:
    """A real deployment's overlay renders no Namespace: `kubectl delete -k` would delete it,
    and a namespace's deletion deletes every claim in it (the privacy ledger's, state.db's).
    Its namespace.yaml, applied once by hand, is valid and enforces Pod Security restricted."""
    documents = rendered[overlay]
    assert not of_kind(documents, "Namespace"), f"overlay {overlay} renders its Namespace"
    assert {d["metadata"]["namespace"] for d in documents} == {NAMESPACE}
    namespace = yaml.safe_load((DEPLOY / "overlays" / overlay / "namespace.yaml").read_text())
    kubernetes_validate.validate(namespace, KUBERNETES_VERSION, strict=True)
    assert namespace["metadata"]["name"] == NAMESPACE
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_mounts_follow_the_image_contract(rendered: dict[str, list[Object]], overlay: str) -> None:
    documents = rendered[overlay]
    secrets = {s["metadata"]["name"]: s for s in of_kind(documents, "Secret")}
    claims = {c["metadata"]["name"] for c in of_kind(documents, "PersistentVolumeClaim")}
    for workload in workloads(documents):
        where = f"overlay {overlay}, {name_of(workload)}"
        (container,) = workload["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        assert env["FEDSILO_KIT_SECRET"] == KIT_SECRET_MOUNT, where
        # the entrypoint's check that the state folder is a volume stays on
        assert "FEDSILO_STATE_VOLUME" not in env, where
        # the state volume: a claim of its own (the entrypoint insists on a mount point)
        assert "subPath" not in mounts(container)[STATE], where
        assert "volumeClaimTemplate" in volume_at(workload, container, STATE), where
        # the kit: a Secret of this rendering, group-readable for fsGroup, with the kit.yaml
        # the entrypoint looks for, copied into memory
        kit = volume_at(workload, container, KIT_SECRET_MOUNT)
        assert kit["secret"]["defaultMode"] == 0o440, where
        secret = secrets[kit["secret"]["secretName"]]
        wanted = {
            "coordinator": {"kit.yaml", "roster.json", "ca.crt", "server.crt", "server.key"},
            "silo": {"kit.yaml", "ca.crt", "client.crt", "client.key", "sealing.key"},
        }[component(workload)] | {"signing.key"}
        assert set(secret["data"]) == wanted, where
        run = volume_at(workload, container, RUN)
        assert run["emptyDir"]["medium"] == "Memory", where
        assert "emptyDir" in volume_at(workload, container, "/tmp"), where
        writable = {p for p, m in mounts(container).items() if not m.get("readOnly")}
        assert writable == {STATE, RUN, "/tmp"}, where
        if "/data" in mounts(container):
            assert mounts(container)["/data"]["readOnly"] is True, where
            claim = volume_at(workload, container, "/data")["persistentVolumeClaim"]
            assert claim["readOnly"] is True and claim["claimName"] in claims, where


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_kit_is_its_own(rendered: dict[str, list[Object]], overlay: str) -> None:
    """Each workload mounts the kit of its own role and name, under its own selector."""
    documents = rendered[overlay]
    secrets = {s["metadata"]["name"]: s for s in of_kind(documents, "Secret")}
    seen: set[str] = set()
    for workload in workloads(documents):
        (container,) = workload["spec"]["template"]["spec"]["containers"]
        secret = secrets[volume_at(workload, container, KIT_SECRET_MOUNT)["secret"]["secretName"]]
        kit = yaml.safe_load(base64.b64decode(secret["data"]["kit.yaml"]))
        assert kit["role"] == component(workload), name_of(workload)
        identity = kit.get("name", kit["role"])
        assert identity not in seen, f"overlay {overlay}: two workloads run {identity}'s kit"
        seen.add(identity)
        if overlay == "all-in-one" and kit["role"] == "silo":
            assert workload["metadata"]["name"] == f"fedsilo-silo-{identity}"
    selectors = [w["spec"]["selector"]["matchLabels"] for w in workloads(documents)]
    for workload in workloads(documents):
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert sum(selects(s, labels) for s in selectors) == 1, (
            f"overlay {overlay}: {name_of(workload)}'s pods are selected by another workload"
        )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_silo_config_is_one_fedsilo_accepts(
    rendered: dict[str, list[Object]], overlay: str
) -> None:
    from fedsilo.silo.config import parse_silo_config

    documents = rendered[overlay]
    for workload in workloads(documents):
        if component(workload) != "silo":
            continue
        (container,) = workload["spec"]["template"]["spec"]["containers"]
        text, source = silo_config(documents, workload)
        config = parse_silo_config(yaml.safe_load(text), f"overlay {overlay}, {source}")
        assert config.kit == KIT_COPY, source
        for path in (config.ledger, config.state):
            assert path.startswith(f"{STATE}/"), f"{source}: {path} is not on the state volume"
        data = config.data.source
        if data.path is not None:
            assert data.path.startswith("/data/"), f"{source}: data.path is not under /data"
            assert "/data" in mounts(container), f"{source}: nothing is mounted at /data"
        else:  # data bundled in the image: the selected silo must exist
            config.data.load(seed=0, base_dir=None)


def image_environment() -> dict[str, str]:
    """The environment the Containerfile's ENV instructions set (FEDSILO_HEALTH_FILE, ...)."""
    text = (ROOT / "Containerfile").read_text().replace("\\\n", " ")
    environment: dict[str, str] = {}
    for line in text.splitlines():
        if line.strip().startswith("ENV "):
            words = shlex.split(line.strip()[4:], comments=True)
            environment.update(word.split("=", 1) for word in words if "=" in word)
    return environment


def pod_environment(container: Object) -> dict[str, str]:
    """What a container's commands see of the FEDSILO_* variables: the image's, then its own."""
    environment = {k: v for k, v in image_environment().items() if k.startswith("FEDSILO_")}
    environment.update({e["name"]: e["value"] for e in container.get("env", []) if "value" in e})
    return environment


def parse_command(argv: list[str], environment: dict[str, str]) -> click.Context:
    """What `argv` parses to, as its console script parses it, without running it: click
    checks every subcommand, option and value (type, range, required) and reads the options'
    environment variables from `environment` (the FEDSILO_* ones only). click.UsageError
    (an unknown command or option, a missing or bad value) otherwise, or LookupError for a
    program that is no console script of fedsilo."""
    scripts = {
        script.name: script
        for script in entry_points(group="console_scripts")
        if script.dist is not None and script.dist.name == "fedsilo"
    }
    program, *words = argv
    if program not in scripts:
        raise LookupError(f"{program}: not a console script of fedsilo ({sorted(scripts)})")
    command: click.Command = scripts[program].load()
    context: click.Context | None = None
    name = program
    while isinstance(command, click.Group):  # the subcommands, as the group resolves them
        context = click.Context(command, parent=context, info_name=name)
        if not words or words[0].startswith("-"):
            raise click.UsageError("no command (or an option before it, not checked)", context)
        name = words.pop(0)
        sub = command.get_command(context, name)
        if sub is None:
            raise click.UsageError(f"No such command {name!r}.", context)
        command = sub
    with mock.patch.dict(os.environ):
        for variable in [v for v in os.environ if v.startswith("FEDSILO_")]:
            del os.environ[variable]
        os.environ.update(environment)
        return command.make_context(name, words, parent=context)


def container_port(container: Object, name: str) -> int:
    (port,) = [p["containerPort"] for p in container.get("ports", []) if p["name"] == name]
    return int(port)


def test_commands_and_probes_parse_as_the_cli_parses_them(
    rendered: dict[str, list[Object]],
) -> None:
    """Every container's args (run as `fedsilo ARGS` by the image's entrypoint) and every
    probe's command parse with the installed fedsilo, in the pod's environment; the service
    writes its health file where the probes read it; the coordinator listens on its ports."""
    from fedsilo.policies.consortium import split_address

    failures = []
    for overlay, documents in rendered.items():
        for workload in workloads(documents):
            for container in pod_containers(workload):
                where = f"overlay {overlay}, {name_of(workload)}, container {container['name']}"
                environment = pod_environment(container)
                commands = {"args": ["fedsilo", *container["args"]]}
                commands |= {probe: container[probe]["exec"]["command"] for probe in PROBES}
                parsed = {}
                for what, argv in commands.items():
                    try:
                        parsed[what] = parse_command(argv, environment).params
                    except (click.UsageError, LookupError) as error:
                        message = (
                            error.format_message() if isinstance(error, click.UsageError) else error
                        )
                        failures.append(f"{where}, {what}: {shlex.join(argv)}: {message}")
                if len(parsed) < len(commands):
                    continue
                service = parsed["args"]
                health_file = service["health_file"]
                assert health_file is not None, f"{where}: the service writes no health file"
                for probe in PROBES:
                    assert parsed[probe]["path"] == health_file, f"{where}: {probe}"
                writable = [
                    m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")
                ]
                assert any(health_file.is_relative_to(path) for path in writable), where
                if container["args"][:2] == ["coordinator", "serve"]:
                    assert str(service["kit_dir"]) == KIT_COPY, where
                    assert service["state_file"].is_relative_to(STATE), where
                    assert service["listen"] is not None, where
                    assert split_address(service["listen"]) == (
                        "0.0.0.0",
                        container_port(container, "grpc"),
                    ), where
                    assert container_port(container, "grpc") == GRPC_PORT, where
                    assert service["metrics_host"] == "0.0.0.0", where  # Prometheus' pods
                    assert service["metrics_port"] == container_port(container, "metrics"), where
                    assert service["metrics_port"] == METRICS_PORT, where
                else:
                    assert container["args"][:2] == ["silo", "start"], where
                    assert not container.get("ports"), f"{where}: a silo serves no port"
    assert not failures, "commands the fedsilo CLI refuses:\n" + "\n".join(failures)


@pytest.mark.parametrize(
    ("command", "refusal", "word"),
    [
        ("fedsilo silo start --config s.yaml --bogus", click.NoSuchOption, "--bogus"),
        ("fedsilo-health --readiness", click.NoSuchOption, "--readiness"),
        ("fedsilo silo stop --config s.yaml", click.UsageError, "stop"),
        ("fedsilo health", click.UsageError, "health"),
        ("fedsilo silo start", click.MissingParameter, "config"),
        (
            "fedsilo coordinator serve --kit k --state s.db --metrics-port x",
            click.BadParameter,
            "x",
        ),
        ("fedsilo-healthz", LookupError, "fedsilo-healthz"),
    ],
)
def test_the_command_check_refuses_what_the_cli_refuses(
    command: str, refusal: type[Exception], word: str
) -> None:
    """The check above has teeth: an unknown option, command or program, or a bad or missing
    value, fails it."""
    with pytest.raises((click.UsageError, LookupError)) as refused:
        parse_command(shlex.split(command), {"FEDSILO_HEALTH_FILE": f"{STATE}/health.json"})
    error = refused.value
    assert isinstance(error, refusal), repr(error)
    message = error.format_message() if isinstance(error, click.UsageError) else str(error)
    assert word in message, message


def test_fedsilo_health_needs_the_image_environment() -> None:
    """The probes name no --file: the image's FEDSILO_HEALTH_FILE is what fedsilo-health
    reads, and the service writes (so without it, fedsilo-health refuses to run)."""
    assert image_environment()["FEDSILO_HEALTH_FILE"].startswith(f"{STATE}/")
    with pytest.raises(click.MissingParameter):
        parse_command(["fedsilo-health"], {})


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies(rendered: dict[str, list[Object]], overlay: str) -> None:
    documents = rendered[overlay]
    policies = of_kind(documents, "NetworkPolicy")
    for workload in workloads(documents):
        labels = workload["spec"]["template"]["metadata"]["labels"]
        (policy,) = [
            p for p in policies if selects(p["spec"]["podSelector"]["matchLabels"], labels)
        ]
        spec, where = policy["spec"], f"overlay {overlay}, {name_of(policy)}"
        assert set(spec["policyTypes"]) == {"Ingress", "Egress"}, where
        egress_ports = {
            (p["port"], p["protocol"]) for rule in spec["egress"] for p in rule["ports"]
        }
        if component(workload) == "silo":
            # a silo only connects out: no ingress rule at all
            assert not spec.get("ingress"), f"{where}: a silo must accept no connection"
            assert egress_ports == {(53, "UDP"), (53, "TCP"), (50051, "TCP")}, where
        else:
            rules = {rule["ports"][0]["port"]: rule for rule in spec["ingress"]}
            assert set(rules) == {50051, 9464}, where
            assert "from" not in rules[50051], f"{where}: silos come from anywhere"
            assert rules[9464]["from"], f"{where}: metrics only for Prometheus"
            assert egress_ports == {(53, "UDP"), (53, "TCP")}, where


def test_all_in_one_silos_reach_the_coordinator_service(
    rendered: dict[str, list[Object]],
) -> None:
    """The coordinator kit's address is its Service's name, and the silos' egress reaches its
    pods."""
    documents = rendered["all-in-one"]
    (service,) = [s for s in of_kind(documents, "Service") if component(s) == "coordinator"]
    (secret,) = [s for s in of_kind(documents, "Secret") if component(s) == "coordinator"]
    kit = yaml.safe_load(base64.b64decode(secret["data"]["kit.yaml"]))
    name, namespace = service["metadata"]["name"], service["metadata"]["namespace"]
    assert kit["address"] == f"{name}.{namespace}.svc:50051"
    (coordinator,) = [w for w in workloads(documents) if component(w) == "coordinator"]
    labels = coordinator["spec"]["template"]["metadata"]["labels"]
    assert selects(service["spec"]["selector"], labels)
    assert coordinator["spec"]["serviceName"] == service["metadata"]["name"]
    for policy in of_kind(documents, "NetworkPolicy"):
        if component(policy) != "silo":
            continue
        (rule,) = [r for r in policy["spec"]["egress"] if r["ports"][0]["port"] == 50051]
        (peer,) = rule["to"]
        assert selects(peer["podSelector"]["matchLabels"], labels), name_of(policy)
    silos = [w["metadata"]["name"] for w in workloads(documents) if component(w) == "silo"]
    assert sorted(silos) == [f"fedsilo-silo-{silo}" for silo in SILOS]
    assert {d["metadata"]["namespace"] for d in documents if d["kind"] != "Namespace"} == {
        NAMESPACE
    }
