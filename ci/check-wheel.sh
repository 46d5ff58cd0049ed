#!/usr/bin/env bash
# The product as a user installs it: build the sdist and the wheel (`python -m build`), install
# the wheel with constraints.txt into a fresh virtualenv in a temporary folder that is not the
# checkout, and from there run what a new user runs first: `fedsilo --version`, the demo (a real
# consortium of processes over mutual TLS), `fedsilo new` -> `pip install` -> `simulate`, and
# `policy validate` of every bundled example. Nothing may import from the checkout.
#
# Usage: ci/check-wheel.sh [WORK_FOLDER]   (default: a new temporary folder, removed at the end)
# Builds with the `build` package of .venv (make setup); PYTHON picks the interpreter of the
# fresh virtualenv (default python3).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}
if [[ $# -ge 1 ]]; then
    work=$1
    mkdir -p "$work"
else
    work=$(mktemp -d "${TMPDIR:-/tmp}/fedsilo-wheel.XXXXXX")
    trap 'rm -rf "$work"' EXIT
fi
work=$(cd "$work" && pwd)
case "$work/" in "$repo"/*) echo "check-wheel: $work is inside the checkout" >&2; exit 1 ;; esac
step() { printf '\n== %s\n' "$*"; }

step "build the sdist and the wheel"
"$repo/.venv/bin/python" -m build --outdir "$work/dist" "$repo" > "$work/build.log" 2>&1 \
    || { tail -30 "$work/build.log"; exit 1; }
ls -l "$work"/dist
wheel=$(ls "$work"/dist/fedsilo-*-py3-none-any.whl)

step "install the wheel into a fresh virtualenv"
"$python" -m venv "$work/venv"
quietly() { "$@" > "$work/last.log" 2>&1 || { tail -30 "$work/last.log"; exit 1; }; }
quietly "$work/venv/bin/pip" install -c "$repo/constraints.txt" "$wheel"
cd "$work"
export PATH="$work/venv/bin:$PATH"
unset PYTHONPATH
echo "fedsilo is $(command -v fedsilo)"

step "fedsilo --version"
fedsilo --version
version=$(python -c "import fedsilo; print(fedsilo.__version__)")
[[ $wheel == *"fedsilo-$version-"* ]] || { echo "the wheel is not version $version" >&2; exit 1; }

step "nothing imports from the checkout"
REPO="$repo" python - <<'PY'
import os
import sys

import fedsilo
import fedsilo.ops.cli
import fedsilo.wire.tasks  # noqa: F401 (once forgotten by a hand-kept package list)

repo = os.environ["REPO"]
loaded = [m.__file__ for m in list(sys.modules.values()) if getattr(m, "__file__", None)]
from_checkout = [f for f in loaded if f.startswith(repo + os.sep)]
assert not from_checkout, f"imported from the checkout: {from_checkout[:5]}"
assert fedsilo.__file__.startswith(sys.prefix), fedsilo.__file__
print("fedsilo from", os.path.dirname(fedsilo.__file__))
PY

step "policy validate of every bundled example"
examples=$(python -c "from fedsilo.policies.loading import example_names; print(' '.join(example_names()))")
fedsilo examples copy heart-fedavg --out "$work/heart-fedavg.yaml"
fedsilo policy validate "$work/heart-fedavg.yaml" $(printf 'example:%s ' $examples) \
    > "$work/validate.log" || { cat "$work/validate.log"; exit 1; }
echo "$(grep -c "^OK " "$work/validate.log") policies OK: a copied one and the $(wc -w <<< "$examples") examples"

step "fedsilo new -> pip install -> simulate"
fedsilo new my-hospital-models --out "$work/my-hospital-models"
quietly pip install -c "$repo/constraints.txt" "$work/my-hospital-models"
fedsilo simulate --policy "$work/my-hospital-models/policy.yaml" --out "$work/new-package-run"
test -s "$work/new-package-run/results.json"

step "fedsilo demo: a real consortium of processes over mutual TLS"
fedsilo demo --folder "$work/demo"

echo
echo "check-wheel: the installed wheel works from $work"
