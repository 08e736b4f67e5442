#!/usr/bin/env bash
# Builds the upstream control plane of the real-control-plane lane (kube-apiserver,
# kube-controller-manager, kube-scheduler and etcd, one binary: tests/harness/main.go) from
# their published Go modules, and prints its path. The binary is cached outside the repository,
# keyed by what it is built from (go.mod, go.sum, main.go, this script, the Go version), so a
# warm machine does not build it again:
#   scripts/build-control-plane.sh            # prints e.g. ~/.cache/baleen/kube/<key>/kube
#   BALEEN_CACHE=/somewhere scripts/build-control-plane.sh
# The version is stamped as upstream's build stamps it (k8s.io/component-base/version and
# k8s.io/client-go/pkg/version): built from the module it would report v0.0.0.
set -euo pipefail
cd "$(dirname "$0")/../tests/harness"
command -v go >/dev/null || {
  echo "go is not on PATH: the real-control-plane lane builds Kubernetes with Go 1.26 or later" >&2
  exit 1
}
version=$(sed -n 's/^\tk8s.io\/kubernetes v\(.*\)$/\1/p' go.mod)
[ -n "$version" ] || { echo "no k8s.io/kubernetes version in tests/harness/go.mod" >&2; exit 1; }
key=$(cat go.mod go.sum main.go ../../scripts/build-control-plane.sh <(go version) | sha256sum | cut -c1-16)
out="${BALEEN_CACHE:-$HOME/.cache/baleen}/kube/$key"
if [ -x "$out/kube" ]; then
  echo "$out/kube"
  exit 0
fi
mkdir -p "$out"
major=${version%%.*}
rest=${version#*.}
minor=${rest%%.*}
stamp=""
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  stamp+=" -X $pkg.gitVersion=v$version -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
  stamp+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done
started=$(date +%s)
echo "building Kubernetes v$version's control plane and etcd (cold: about 9 minutes on 2 cores, 3 GiB of memory)" >&2
go build -buildvcs=false -trimpath -ldflags "-s -w$stamp" -o "$out/kube.partial" .
mv "$out/kube.partial" "$out/kube"
echo "built in $(( $(date +%s) - started )) s: $out/kube" >&2
echo "$out/kube"
