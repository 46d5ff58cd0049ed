#!/usr/bin/env bash
# CI's check of the Kubernetes manifests, offline: every overlay renders with
# `kubectl kustomize` (from a temporary copy, with a throw-away kit made by `fedsilo provision`),
# every rendered object validates against the Kubernetes 1.30 API schemas (kubernetes-validate,
# strict), and the workloads keep their hardening, their image contract and their network
# policies. The checks are tests/test_kubernetes_manifests.py; nothing is written in the repo.
#
#   bash deploy/kubernetes/check.sh
#
# PYTHON: the interpreter with fedsilo, pytest and kubernetes-validate (default: the repo's
# .venv, else python3); FEDSILO: a fedsilo executable to provision with (default: PYTHON's).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"

if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
if ! command -v kubectl >/dev/null 2>&1; then
  echo "check.sh: kubectl is not on PATH; it renders the overlays (kubectl kustomize)" >&2
  exit 1
fi
if ! "$PYTHON" -c "import kubernetes_validate, fedsilo, pytest" 2>/dev/null; then
  echo "check.sh: $PYTHON lacks fedsilo, pytest or kubernetes-validate" \
    "(pip install -e '.[dev]')" >&2
  exit 1
fi
if [[ -n "${FEDSILO:-}" ]]; then export FEDSILO; fi

echo "kubectl: $(kubectl version --client 2>/dev/null | head -n 2 | tr '\n' ' ')"
echo "kubernetes-validate: $("$PYTHON" -c 'import kubernetes_validate.version as v; print(v.__version__)')"
exec "$PYTHON" -m pytest -q -rs -p no:cacheprovider tests/test_kubernetes_manifests.py
