#!/usr/bin/env bash
# The container image and the compose consortium, as CI's machine runs them: rootful podman
# from Debian, no image registry. It builds the base image from Debian packages (mmdebstrap;
# elsewhere the Containerfile's default base, debian:bookworm-slim, comes from a registry),
# builds the image, checks what a user meets first (the version, the entry point's messages, the
# health check), then runs deploy/compose: a coordinator and three hospitals over mutual TLS
# between containers, a 2-round job submitted from this host with the operator kit, its results
# and the coordinator's metrics endpoint.
#
# Usage: ci/check-image.sh   (as root; installs podman, runc, mmdebstrap, iptables and
# podman-compose when missing). FEDSILO_IMAGE_WORK keeps the work folder (default: a temporary
# one, removed).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
step() { printf '\n== %s (%ds)\n' "$*" "$SECONDS"; }

step "tools: podman with runc, mmdebstrap, podman-compose"
missing=()
# netavark, podman's network stack, runs iptables: a machine with podman but not it cannot build
for tool in podman runc mmdebstrap iptables; do command -v "$tool" > /dev/null || missing+=("$tool"); done
if ((${#missing[@]})); then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq  # container DNS between compose services: netavark with aardvark-dns
    apt-get install -y -qq podman runc mmdebstrap netavark aardvark-dns iptables > /dev/null
fi
tools=$repo/.venv-compose
[[ -x $tools/bin/podman-compose ]] || {
    python3 -m venv "$tools" && "$tools/bin/pip" install -q "podman-compose==1.6.0"
} > /dev/null 2>&1
if [[ -n ${FEDSILO_IMAGE_WORK:-} ]]; then
    work=$FEDSILO_IMAGE_WORK
    mkdir -p "$work"
else
    work=$(mktemp -d "${TMPDIR:-/tmp}/fedsilo-image.XXXXXX")
    trap 'rm -rf "$work"' EXIT
fi
# crun refuses this kernel's cgroup layout; ulimits below the machine's hard limits
cat > "$work/containers.conf" <<'CONF'
[containers]
default_ulimits = ["nofile=8192:8192", "nproc=4096:4096"]
[engine]
runtime = "runc"
CONF
export CONTAINERS_CONF=$work/containers.conf

version=$("$repo/.venv/bin/python" -c "import fedsilo; print(fedsilo.__version__)")
image=localhost/fedsilo:$version
base=localhost/fedsilo-base:bookworm

step "base image $base from Debian packages"
if ! podman image exists "$base"; then
    mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates \
        bookworm "$work/rootfs.tar"
    podman import --quiet "$work/rootfs.tar" "$base" > /dev/null
    rm -f "$work/rootfs.tar"
fi

step "build $image"
build_args=(--build-arg "BASE=$base" --build-arg "VERSION=$version")
mounts=(-v /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro)
if [[ -d /opt/wheels ]]; then  # this machine's CPU build of torch: no PyTorch index to reach
    build_args+=(--build-arg PIP_FIND_LINKS=/opt/wheels --build-arg PIP_EXTRA_INDEX_URL=https://pypi.org/simple)
    mounts+=(-v /opt/wheels:/opt/wheels:ro)
fi
start=$SECONDS
podman build --quiet --format docker "${build_args[@]}" "${mounts[@]}" -t "$image" \
    -f "$repo/Containerfile" "$repo" > "$work/build.log" 2>&1 || { tail -40 "$work/build.log"; exit 1; }
echo "built in $((SECONDS - start)) s; $(podman image inspect "$image" --format '{{.Size}}' | awk '{printf "%.0f MB", $1 / 1e6}')"

step "the image: version, user, messages"
run() { podman run --rm --no-healthcheck "$@"; }  # no systemd here to run health checks
run "$image" --version
[[ $(run --entrypoint id "$image" -u) == 10001 ]] || { echo "the image runs as root" >&2; exit 1; }
expect_refusal() {  # a container started wrongly: exit 1, one message naming what to do
    local what=$1 pattern=$2
    shift 2
    local out
    if out=$(run "$@" 2>&1); then echo "$what: started" >&2; exit 1; fi
    grep -q -- "$pattern" <<< "$out" || { echo "$what: $out" >&2; exit 1; }
    if grep -q Traceback <<< "$out"; then echo "$what: a traceback: $out" >&2; exit 1; fi
    echo "refused, as it should be: $what"
}
expect_refusal "no command" "no command given" "$image"
expect_refusal "no state volume" "is not a volume" "$image" coordinator serve --kit /etc/fedsilo/kit --state /var/lib/fedsilo/state.db
rm -rf "$work/secret" "$work/compose"
mkdir -p "$work/secret"
run --user 0 -v "$work/secret:/out" "$image" provision --example /out/consortium.yaml > /dev/null
run --user 0 -v "$work/secret:/out" -w /out "$image" provision --consortium consortium.yaml --out kits > /dev/null
rm "$work/secret/kits/silos/hungary/client.key"
chmod -R a+rX "$work/secret/kits/silos/hungary"  # as a Secret volume: group-readable files
printf 'version: 1\nkit: /run/fedsilo/kit\ndata: {source: heart, select: Hungary}\n' > "$work/secret/silo.yaml"
expect_refusal "a kit Secret without a key" "client.key: key file not found" \
    -v fedsilo-check-state:/var/lib/fedsilo -v "$work/secret/kits/silos/hungary:/etc/fedsilo/kit-secret:ro" \
    -v "$work/secret/silo.yaml:/etc/fedsilo/silo.yaml:ro" -e FEDSILO_KIT_SECRET=/etc/fedsilo/kit-secret \
    "$image" silo start --config /etc/fedsilo/silo.yaml
podman volume rm -f fedsilo-check-state > /dev/null

step "the compose consortium"
COMPOSE="$tools/bin/podman-compose" IMAGE=$image bash "$repo/deploy/compose/try.sh" "$work/compose"
echo
echo "check-image: $image and the compose consortium work ($SECONDS s)"
