#!/usr/bin/env bash
# The plain manifests for `kubectl apply` users, rendered from the Helm chart (the one source):
#   scripts/render-manifests.sh [OUT_DIR]    (default packaging/manifests)
# One file per shipped values file of the chart's ci/ directory that an operator may apply as it
# is, plus default.yaml. A test (tests/tests/e2e/install.rs) renders them again and fails when
# the committed ones are stale: run this after changing the chart.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-packaging/manifests}"
chart=packaging/helm/baleen
command -v helm >/dev/null || {
  echo "helm is not on PATH: scripts/install-kube-tools.sh installs helm 4.1.4 and prints where" >&2
  exit 1
}
mkdir -p "$out"
render() {
  local name="$1"
  shift
  {
    echo "# baleen's install, rendered from $chart by scripts/render-manifests.sh ($*)."
    echo "# Do not edit: change the chart (or its values) and render again. Apply with"
    echo "#   kubectl apply --server-side -f packaging/manifests/$name.yaml"
    helm template baleen "$chart" --namespace baleen-system --set namespace.create=true "$@"
  } >"$out/$name.yaml"
}
render default --values "$chart/values.yaml"
for name in mig no-mps extender-service prometheus-operator dra; do
  render "$name" --values "$chart/ci/$name-values.yaml"
done
