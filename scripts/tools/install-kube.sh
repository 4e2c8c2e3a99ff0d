#!/usr/bin/env bash
# Build the local Kubernetes control plane the tests run against, and fetch the upstream CRDs
# the chart renders.
#
# 1. $TOOLS_DIR/bin/kube: the Go module tools/kube links the upstream kube-apiserver,
#    kube-controller-manager and kube-scheduler commands (Kubernetes v1.35.4) and an embedded
#    etcd (v3.6.5) into one binary (`kube <component> [flags]`), so the packages they share
#    compile once. Cached: rebuilt only when tools/kube's go.mod, go.sum or *.go change (their
#    hash is kept next to the binary). From a cold cache the build takes a long while on 2 cores
#    (see the README, "Development").
# 2. $TOOLS_DIR/crds: ServiceMonitor and PrometheusRule from the prometheus-operator Go module,
#    ScaledObject from KEDA's, downloaded by `go mod download` and checked against the pinned
#    module hashes below.
#
# The Go module and build caches are Go's own (`go env GOMODCACHE GOCACHE`: under $HOME unless
# the environment says otherwise), shared by every checkout on the machine as for any Go build:
# a second clone links the binary in under a minute instead of compiling it again. The build's
# log is $TOOLS_DIR/kube-build.log. Idempotent.
set -euo pipefail

: "${TOOLS_DIR:?set TOOLS_DIR (the Makefile passes .tools)}"
src=$(cd "$(dirname "$0")/../../tools/kube" && pwd)
bin="$TOOLS_DIR/bin"
mkdir -p "$bin" "$TOOLS_DIR/crds"

command -v go >/dev/null || {
  echo "error: go not found: the local control plane is built from Go modules; install Go >= 1.25" >&2
  exit 1
}
GOMODCACHE=$(go env GOMODCACHE) GOCACHE=$(go env GOCACHE)
export GOMODCACHE GOCACHE
export GOFLAGS="-modcacherw -buildvcs=false" GOTOOLCHAIN=local GOTELEMETRY=off CGO_ENABLED=0

# module@version  h1 hash of the module  file in the module
crds=(
  "github.com/prometheus-operator/prometheus-operator@v0.89.0 h1:2HA351OwWBa10H6TDhjeSdHOA7wiY71sEivg+z2cykk= example/prometheus-operator-crd/monitoring.coreos.com_servicemonitors.yaml"
  "github.com/prometheus-operator/prometheus-operator@v0.89.0 h1:2HA351OwWBa10H6TDhjeSdHOA7wiY71sEivg+z2cykk= example/prometheus-operator-crd/monitoring.coreos.com_prometheusrules.yaml"
  "github.com/kedacore/keda/v2@v2.21.0 h1:R6z2HZvstK4RLUMxroNACzBj74xGxt3kG59b5Xc+Xps= config/crd/bases/keda.sh_scaledobjects.yaml"
)

for pin in "${crds[@]}"; do
  read -r module sum file <<<"$pin"
  dest="$TOOLS_DIR/crds/$(basename "$file")"
  [[ -f "$dest" && "$(cat "$dest.source" 2>/dev/null)" == "$module $sum" ]] && continue
  info=$(cd "$TOOLS_DIR" && go mod download -json "$module")
  got_sum=$(sed -n 's/^[[:space:]]*"Sum": "\(.*\)",$/\1/p' <<<"$info")
  dir=$(sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p' <<<"$info")
  if [[ "$got_sum" != "$sum" ]]; then
    echo "error: $module has hash '$got_sum', pinned $sum" >&2
    exit 1
  fi
  cp "$dir/$file" "$dest.tmp" && mv -f "$dest.tmp" "$dest"
  echo "$module $sum" >"$dest.source"
  echo "CRD $(basename "$file") from $module"
done

stamp=$(cat "$src/go.mod" "$src/go.sum" "$src"/*.go | sha256sum | cut -d' ' -f1)
if [[ -x "$bin/kube" && "$(cat "$bin/kube.stamp" 2>/dev/null)" == "$stamp" ]]; then
  echo "kube (Kubernetes control plane) already built"
  exit 0
fi

version=k8s.io/component-base/version
ldflags="-s -w -X $version.gitVersion=v1.35.4 -X $version.gitMajor=1 -X $version.gitMinor=35"
ldflags+=" -X $version.gitTreeState=clean -X $version.buildDate=2026-04-01T00:00:00Z"
echo "building kube (kube-apiserver, kube-controller-manager, kube-scheduler, etcd) from tools/kube;"
echo "from a cold cache about 11.5 CPU-minutes (see README, Development); later builds reuse $GOCACHE"
start=$(date +%s)
log="$TOOLS_DIR/kube-build.log"
ticker=
trap '[[ -z "$ticker" ]] || kill "$ticker" 2>/dev/null || true' EXIT

# Until stop_ticker, a progress line every PROGRESS_S seconds (30): `$1` says what is done so far.
every() {
  (while sleep "${PROGRESS_S:-30}"; do echo "  kube: $($1), $(($(date +%s) - start)) s"; done) &
  ticker=$!
}
stop_ticker() { kill "$ticker" 2>/dev/null || true; wait "$ticker" 2>/dev/null || true; ticker=; }

downloaded() { echo "$(du -sm "$GOMODCACHE/cache/download" 2>/dev/null | cut -f1) MB of modules downloaded"; }
echo "  kube: downloading the Go modules it needs (about 100 MB, once)"
every downloaded
total=$(cd "$src" && go list -mod=readonly -deps . | wc -l) # fetches the modules the build needs
stop_ticker
echo "  kube: $(downloaded), $(($(date +%s) - start)) s"

compiled() { echo "$(grep -cv '^#\| ' "$log" || true) of at most $total packages compiled"; }
: >"$log"
every compiled
if ! (cd "$src" && go build -v -mod=readonly -trimpath -ldflags "$ldflags" -o "$bin/kube.tmp" . 2>"$log"); then
  stop_ticker
  tail -n 40 "$log" >&2
  echo "error: building tools/kube failed (full log: $log)" >&2
  exit 1
fi
stop_ticker
mv -f "$bin/kube.tmp" "$bin/kube"
echo "$stamp" >"$bin/kube.stamp"
echo "kube built in $(($(date +%s) - start)) s: $("$bin/kube" kube-apiserver --version)"
