#!/usr/bin/env bash
# Deploy the chart to the current kube context with values/staging.yaml, load the model, roll
# Triton, and run `helm test`.
#
#   make staging-deploy                 # asks before touching the cluster
#   make staging-deploy YES=1           # no question (CI with a cluster)
#   make staging-deploy DRY_RUN=1       # offline: render, helm lint, kubernetes-validate; no cluster
#
# Environment: RELEASE (codegen), NAMESPACE (model-triton), VALUES (values/staging.yaml),
# HELM (helm), KUBECTL (kubectl), LOADER_TIMEOUT_S (14400), ROLLOUT_TIMEOUT (45m), POLL_S (15),
# HELM_ARGS (extra `helm upgrade` arguments, e.g. "--set model.revision=abc123").
set -euo pipefail

cd "$(dirname "$0")/.."
root=$(pwd)
export PATH="$root/.tools/bin:$root/.venv/bin:$PATH"

release=${RELEASE:-codegen}
namespace=${NAMESPACE:-model-triton}
values=${VALUES:-values/staging.yaml}
helm=${HELM:-helm}
kubectl=${KUBECTL:-kubectl}
loader_timeout_s=${LOADER_TIMEOUT_S:-14400}
rollout_timeout=${ROLLOUT_TIMEOUT:-45m}
poll_s=${POLL_S:-15}
read -r -a helm_args <<<"${HELM_ARGS:-}"
chart=charts/model-triton

say() { printf '==> %s\n' "$*"; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

command -v "$helm" >/dev/null || die "$helm not found: run \`make install\` (pinned helm in .tools/bin)"
[[ -f "$values" ]] || die "values file $values not found"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# 1. Render and validate offline, exactly what will be installed.
say "rendering $chart with $values (release $release, namespace $namespace)"
set_args=()
for ((i = 0; i < ${#helm_args[@]}; i++)); do
  if [[ "${helm_args[i]}" == "--set" && $((i + 1)) -lt ${#helm_args[@]} ]]; then
    set_args+=(--set "${helm_args[i + 1]}")
  fi
done
python "$root/scripts/render_chart.py" --helm "$helm" -f "$values" "${set_args[@]}" \
  --release "$release" --namespace "$namespace" --validate --output "$work/manifests.yaml"

read_rendered() {  # read_rendered KIND FIELD: a field of the one rendered resource of KIND
  python - "$work/manifests.yaml" "$1" "$2" <<'PY'
import sys

import yaml

path, kind, field = sys.argv[1:]
[doc] = [d for d in yaml.safe_load_all(open(path)) if d and d["kind"] == kind
         and "helm.sh/hook" not in (d["metadata"].get("annotations") or {})]
value = doc
for part in field.split("|"):
    value = value[part]
print(value)
PY
}
deployment=$(read_rendered Deployment "metadata|name")
cronjob=$(read_rendered CronJob "metadata|name")
new_key=$(read_rendered Deployment "metadata|annotations|model-triton/model-key")
say "model key: $new_key"

if [[ "${DRY_RUN:-0}" == "1" ]]; then
  say "DRY_RUN=1: rendered, linted and validated; nothing was sent to a cluster"
  exit 0
fi

# 2. The cluster: show where we are going and ask.
command -v "$kubectl" >/dev/null || die "$kubectl not found: install kubectl and select a context"
context=$("$kubectl" config current-context) || die "no current kube context: kubectl config use-context ..."
say "kube context: $context   namespace: $namespace   release: $release"
if [[ "${YES:-0}" != "1" ]]; then
  [[ -t 0 ]] || die "not a terminal: set YES=1 to deploy to $context without asking"
  read -r -p "Deploy $chart with $values to context '$context'? [y/N] " answer
  [[ "$answer" == [yY]* ]] || die "aborted"
fi

old_key=$("$kubectl" -n "$namespace" get deployment "$deployment" \
  -o jsonpath='{.metadata.annotations.model-triton/model-key}' 2>/dev/null || true)

# 3. Install or upgrade (no --wait: the Triton pods wait for the model, loaded next).
say "helm upgrade --install $release"
"$helm" upgrade --install "$release" "$chart" --namespace "$namespace" --create-namespace \
  -f "$values" "${helm_args[@]}"

# 4. Load the model with the Job rendered from the same values, and wait for it.
job="load-$(date +%s)"
say "loading the model: job/$job from cronjob/$cronjob"
# The Job keeps its record for at least an hour whatever loader.ttlSecondsAfterFinished says
# (0 deletes a finished Job at once, before this script could read how it ended).
"$kubectl" -n "$namespace" create job "$job" --from="cronjob/$cronjob" --dry-run=client -o json \
  | python -c 'import json, sys
job = json.load(sys.stdin)
job["spec"]["ttlSecondsAfterFinished"] = max(3600, job["spec"].get("ttlSecondsAfterFinished") or 0)
json.dump(job, sys.stdout)' \
  | "$kubectl" -n "$namespace" create -f -
deadline=$(($(date +%s) + loader_timeout_s))
while true; do
  succeeded=$("$kubectl" -n "$namespace" get job "$job" -o jsonpath='{.status.succeeded}')
  failed=$("$kubectl" -n "$namespace" get job "$job" \
    -o jsonpath='{.status.conditions[?(@.type=="Failed")].status}')
  if [[ "${succeeded:-0}" -ge 1 ]]; then
    say "job/$job completed"
    break
  fi
  if [[ "$failed" == "True" ]]; then
    "$kubectl" -n "$namespace" logs "job/$job" --tail=50 >&2 || true
    die "job/$job failed (logs above); fix and rerun"
  fi
  if [[ $(date +%s) -ge $deadline ]]; then
    die "job/$job still running after ${loader_timeout_s}s: kubectl -n $namespace logs -f job/$job"
  fi
  "$kubectl" -n "$namespace" logs "job/$job" --tail=1 2>/dev/null | sed 's/^/    /' || true
  sleep "$poll_s"
done

# 5. The pods of a new key already wait for it (init container wait-for-model) and see `.ready`
#    within triton.waitForModel.intervalSeconds: no restart, which would only start them over.
if [[ -n "$old_key" && "$old_key" != "$new_key" ]]; then
  say "new model key (was $old_key): the rolled pods pick it up as they find it published"
fi
say "waiting for deployment/$deployment"
"$kubectl" -n "$namespace" rollout status "deployment/$deployment" --timeout="$rollout_timeout"

# 6. Health and one completion.
say "helm test $release"
"$helm" test "$release" --namespace "$namespace" --logs
say "deployed $new_key to $context"
