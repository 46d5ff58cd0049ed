#!/usr/bin/env bash
# Run deploy/compose end to end on this machine: provision kits for a coordinator reachable as
# `coordinator:50051` inside the compose network (and 127.0.0.1 from this host), give the
# services' kits to the image's user, start the consortium, submit a 2-round FedAvg job from
# this host with the operator kit, wait for it, fetch its results, read the coordinator's
# metrics endpoint and the services' health, then stop everything and remove the volumes.
#
# Usage: deploy/compose/try.sh [WORK_FOLDER]   (default: a new temporary folder, removed)
# IMAGE: the fedsilo image (default localhost/fedsilo:<the checkout's version>); COMPOSE: the
# compose command (default podman-compose). CI runs it through ci/check-image.sh.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
compose=${COMPOSE:-podman-compose}
engine=${ENGINE:-podman}
image=${IMAGE:?set IMAGE to the fedsilo image, e.g. localhost/fedsilo:0.2.0}
if [[ $# -ge 1 ]]; then
    work=$1
    mkdir -p "$work"
else
    work=$(mktemp -d "${TMPDIR:-/tmp}/fedsilo-compose.XXXXXX")
fi
work=$(cd "$work" && pwd)
step() { printf '\n== %s (%ds)\n' "$*" "$SECONDS"; }
# the admin CLI of the image, run from this host as this host's user, with the operator kit
operator() {
    "$engine" run --rm --no-healthcheck --network host --user "$(id -u):$(id -g)" -v "$work:$work" -w "$work" \
        "$image" "$@"
}
export IMAGE=$image KITS=$work/kits
up() { "$compose" -f "$here/compose.yaml" -p fedsilo-try "$@"; }
cleanup() {
    up down -v > "$work/down.log" 2>&1 || cat "$work/down.log"
    [[ -n $keep ]] || rm -rf "$work"
}
keep=${1:-}
trap cleanup EXIT

step "provision kits for coordinator:50051"
cat > "$work/consortium.yaml" <<'YAML'
consortium: compose-heart
coordinator:
  address: "coordinator:50051"
silos:
  - name: cleveland
  - name: hungary
  - name: va-long-beach
YAML
operator provision --consortium consortium.yaml --out kits
chown -R 10001:10001 "$work/kits/coordinator" "$work/kits/silos"

step "compose up"
start=$SECONDS
up up -d > "$work/up.log" 2>&1 || { cat "$work/up.log"; exit 1; }

step "submit a 2-round job from this host"
operator examples copy heart-fedavg --out policy.yaml > /dev/null
sed -i 's/^rounds: [0-9]*/rounds: 2/' "$work/policy.yaml"
operator job submit policy.yaml --kit kits/operator --key kits/operator/operator.key \
    --coordinator 127.0.0.1:${COORDINATOR_PORT:-50051} | tee "$work/submit.log"
job=$(grep -o 'job [A-Za-z0-9_.-]*' "$work/submit.log" | head -1 | cut -d' ' -f2)

step "wait for job $job"
for _ in $(seq 60); do  # at most about 10 minutes: each status call starts a container
    operator job status "$job" --kit kits/operator --coordinator 127.0.0.1:${COORDINATOR_PORT:-50051} \
        --json > "$work/status.json" || true
    state=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['job']['status'])" \
        "$work/status.json" 2> /dev/null || echo unknown)
    [[ $state == running || $state == queued || $state == unknown ]] || break
    sleep 5
done
if [[ $state != completed ]]; then
    echo "job $job ended $state" >&2
    up logs > "$work/compose.log" 2>&1 || true
    tail -60 "$work/compose.log" >&2
    exit 1
fi
echo "job $job completed in $((SECONDS - start)) s after compose up"

step "its results"
operator job results "$job" --kit kits/operator --coordinator 127.0.0.1:${COORDINATOR_PORT:-50051} \
    --out results
python3 - "$work/results" <<'PY'
import json
import pathlib
import sys

results = pathlib.Path(sys.argv[1])
history = json.loads(next(results.rglob("history.json")).read_text())
rounds = history["rounds"] if isinstance(history, dict) else history
assert len(rounds) == 2, f"{len(rounds)} rounds in history.json, not 2"
assert any(results.rglob("*.safetensors")), "no final model"
print(f"history.json: {len(rounds)} rounds; final model:", *results.rglob("*.safetensors"))
PY

step "the coordinator's metrics endpoint and the services' health"
python3 - "${METRICS_PORT:-9464}" <<'PY'
import sys
import urllib.request

text = urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics", timeout=5).read().decode()
lines = [line for line in text.splitlines() if line.startswith("fedsilo_")]
assert lines, "no fedsilo_ samples"
print(f"{len(lines)} fedsilo_ samples, e.g. {lines[0]}")
PY
for service in coordinator cleveland hungary va-long-beach; do
    "$engine" exec "fedsilo-try_${service}_1" fedsilo-health --ready
done
echo "compose consortium: $((SECONDS - start)) s from up to checked"
