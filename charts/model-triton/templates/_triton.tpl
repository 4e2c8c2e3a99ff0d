{{/*
_triton.tpl: The Triton Deployment: GPU arithmetic, the server's command line and resources, and the
non-fatal findings NOTES.txt prints.
*/}}

{{/*
model-triton.gpuBackend: "true" when the serving backend uses GPUs (fastertransformer).
*/}}
{{- define "model-triton.gpuBackend" -}}
{{- if eq .Values.triton.backend "fastertransformer" -}}true{{- end -}}
{{- end -}}

{{/*
model-triton.gpusPerReplica: GPUs of one Triton replica, T x P.
*/}}
{{- define "model-triton.gpusPerReplica" -}}
{{- mul (int .Values.model.tensorParallelSize) (int .Values.model.pipelineParallelSize) -}}
{{- end -}}

{{/*
model-triton.gpusUsedPerNode: GPUs the replicas of one node take, N x T x P.
*/}}
{{- define "model-triton.gpusUsedPerNode" -}}
{{- mul (int .Values.cluster.replicasPerNode) (include "model-triton.gpusPerReplica" . | int) -}}
{{- end -}}

{{/*
model-triton.replicas: Triton replicas, nodes x N.
*/}}
{{- define "model-triton.replicas" -}}
{{- mul (int .Values.cluster.nodes) (int .Values.cluster.replicasPerNode) -}}
{{- end -}}

{{/*
model-triton.tritonArgs: the `tritonserver` command line (a YAML list): the chart's own options
(the endpoints and what they serve from model-triton.securityArgs, _security.tpl), then
triton.extraArgs (which may not set or abbreviate one of the chart's: _rules.tpl, nor a flag the
security defaults own: _security.tpl).
*/}}
{{- define "model-triton.tritonArgs" -}}
{{- include "model-triton.tritonChartArgs" . }}
{{- range .Values.triton.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end -}}

{{/*
model-triton.tritonChartArgs: the options of the `tritonserver` command line the chart sets.
Metrics listen on every address of the pod (Prometheus scrapes the pod's address): without
`--metrics-address`, Triton 23.05 binds them to the HTTP address (TritonParser::Parse,
src/command_line_parser.cc: "Set metrics_address to default if never specified"), which is the
pod's loopback by default (triton.security.http).
*/}}
{{- define "model-triton.tritonChartArgs" -}}
- tritonserver
- --model-repository={{ include "model-triton.modelPath" . }}
{{ include "model-triton.securityArgs" . }}
- --metrics-address=0.0.0.0
- --metrics-port=8002
- --exit-timeout-secs={{ max 5 (sub (sub (int .Values.triton.terminationGracePeriodSeconds) (int .Values.triton.preStopSleepSeconds)) 10) }}
{{- end -}}

{{/*
model-triton.tritonResources: triton.resources with cluster.gpuResourceName (`nvidia.com/gpu`,
or a MIG profile) = T x P in requests and limits (GPU backend only).
*/}}
{{- define "model-triton.tritonResources" -}}
{{- $res := deepCopy (default dict .Values.triton.resources) -}}
{{- if include "model-triton.gpuBackend" . -}}
{{- $gpus := include "model-triton.gpusPerReplica" . | int -}}
{{- $name := .Values.cluster.gpuResourceName -}}
{{- $_ := set $res "requests" (merge (dict $name $gpus) (default dict $res.requests)) -}}
{{- $_ := set $res "limits" (merge (dict $name $gpus) (default dict $res.limits)) -}}
{{- end -}}
{{- toYaml $res -}}
{{- end -}}

{{/*
model-triton.warnings: non-fatal findings for NOTES.txt (one per line), e.g. GPUs left idle.
*/}}
{{- define "model-triton.warnings" -}}
{{- if include "model-triton.gpuBackend" . -}}
{{- $used := include "model-triton.gpusUsedPerNode" . | int -}}
{{- $gpus := int .Values.cluster.gpusPerNode -}}
{{- if lt $used $gpus }}
WARNING: model-triton: cluster.replicasPerNode x model.tensorParallelSize x model.pipelineParallelSize = {{ $used }} of cluster.gpusPerNode = {{ $gpus }}: {{ sub $gpus $used }} GPU(s) per node stay idle. Raise cluster.replicasPerNode (or T x P) to use them, or pick a smaller node type.
{{- end }}
{{- end -}}
{{- if include "model-triton.gpuBackend" . -}}
{{- $tolerated := false -}}
{{- range .Values.cluster.tolerations -}}
{{- $key := toString .key -}}
{{- $effect := toString .effect -}}
{{- if and (or (eq $key "nvidia.com/gpu") (and (eq $key "") (eq (toString .operator) "Exists"))) (has $effect (list "" "NoSchedule")) (or (eq (toString .operator) "Exists") (eq (toString .value) "present")) -}}
{{- $tolerated = true -}}
{{- end -}}
{{- end -}}
{{- if not $tolerated }}
WARNING: model-triton: cluster.tolerations replaces the chart's default, and none of its entries tolerates the taint GPU node pools carry (GKE: nvidia.com/gpu=present:NoSchedule): on such a pool every Triton pod stays Pending. Add {key: nvidia.com/gpu, operator: Exists, effect: NoSchedule} to your list.
{{- end }}
{{- end }}
{{- if and .Values.loader.prune.enabled (not .Values.loader.hook.enabled) }}
WARNING: model-triton: loader.prune.enabled removes keys beyond the {{ int .Values.loader.prune.keep }} newest: a `helm rollback` to a pruned key moves the pods to a key nothing loads, and they wait (the old ones already stopped). With loader.hook.enabled the rollback loads it first (pre-rollback); without it, run the loader right after rolling back (step 1).
{{- end }}
{{- $s := .Values.triton.updateStrategy -}}
{{- $configured := toString $s.maxUnavailable -}}
{{- if and (eq $s.type "RollingUpdate") (ne $configured "") (not (hasSuffix "%" $configured)) (include "model-triton.gpuBackend" .) -}}
{{- $bound := include "model-triton.convergentMaxUnavailable" . | int -}}
{{- if lt (int64 $configured) (int64 $bound) }}
WARNING: model-triton: triton.updateStrategy.maxUnavailable = {{ $configured }} is below {{ $bound }} (the most replicas - cluster.nodes + 1): a rollout from a revision with fewer replicas per node (a change of cluster.replicasPerNode, or a rollback, `kubectl rollout undo` or re-render across one) can stop for good on a full pool. Leave it empty for such a change, or use triton.updateStrategy.type Recreate.
{{- end }}
{{- end -}}
{{- end -}}

{{/*
model-triton.topologySpread: the hostname spread of the Triton pods (a YAML list, empty when
cluster.spread.enabled is false). GPU fit does the packing: on a dedicated pool with
N x T x P = G a node has room for exactly N replicas. The spread only breaks ties
(ScheduleAnyway, the default) or, when asked, forbids imbalance (DoNotSchedule). It counts the
pods of one ReplicaSet only (matchLabelKeys pod-template-hash: old and new pods of a rollout are
not compared) and only on nodes whose taints the pods tolerate (nodeTaintsPolicy Honor). No
minDomains: a matching node that is busy (another release's, or without GPUs) would pin the
minimum at 0 and allow one pod per node.
*/}}
{{- define "model-triton.topologySpread" -}}
{{- $spread := .Values.cluster.spread -}}
{{- if $spread.enabled -}}
- maxSkew: {{ int $spread.maxSkew }}
  topologyKey: kubernetes.io/hostname
  whenUnsatisfiable: {{ $spread.whenUnsatisfiable }}
  nodeTaintsPolicy: Honor
  matchLabelKeys:
    - pod-template-hash
  labelSelector:
    matchLabels:
      {{- include "model-triton.selectorLabels" (dict "context" . "component" "triton") | nindent 6 }}
{{- end -}}
{{- end -}}

{{/*
model-triton.maxUnavailable: triton.updateStrategy.maxUnavailable, or when it is empty ("auto")
the larger of a quarter of the replicas (of autoscaling.minReplicas with autoscaling on; at
least 1) and, with GPUs, the most replicas - cluster.nodes + 1. It reads nothing from the
cluster: a rollback re-applies a stored manifest and `helm template` renders without a cluster,
so the number must hold whatever the Deployment ran before.
Why that bound: the Deployment controller scales old pods down only while
maxUnavailable > the new ReplicaSet's unavailable pods (pkg/controller/deployment/rolling.go,
`reconcileOldReplicaSets`), and on a full pool new pods that find no GPU stay unavailable. A
rollout is stuck only when every node is blocked: holding an old pod, or N new ones (available
once loaded); so at least cluster.nodes pods are old or available, at most replicas - nodes new
ones are unavailable, and maxUnavailable = replicas - nodes + 1 always leaves one more to scale
down. From any earlier revision (N = 1 with T x P = G is the worst: one old pod fills a node),
any operation. With N = 1 it is 1: only N > 1 pays for it, in replicas serving mid-rollout.
*/}}
{{- define "model-triton.maxUnavailable" -}}
{{- $configured := .Values.triton.updateStrategy.maxUnavailable -}}
{{- if and (not (kindIs "invalid" $configured)) (ne (toString $configured) "") -}}
{{- ternary $configured (int64 $configured | toString) (hasSuffix "%" (toString $configured)) -}}
{{- else -}}
{{- include "model-triton.convergentMaxUnavailable" . -}}
{{- end -}}
{{- end -}}

{{/*
model-triton.convergentMaxUnavailable: the automatic maxUnavailable (model-triton.maxUnavailable).
*/}}
{{- define "model-triton.convergentMaxUnavailable" -}}
{{- $fewest := include "model-triton.replicas" . | int -}}
{{- $most := $fewest -}}
{{- if .Values.autoscaling.enabled -}}
{{- $fewest = int .Values.autoscaling.minReplicas -}}
{{- $most = include "model-triton.maxReplicas" . | int -}}
{{- end -}}
{{- $auto := max 1 (div $fewest 4) -}}
{{- if include "model-triton.gpuBackend" . -}}
{{- $auto = max $auto (add (sub $most (int .Values.cluster.nodes)) 1) -}}
{{- end -}}
{{- $auto -}}
{{- end -}}

{{/*
model-triton.autoscaledReplicas: with autoscaling on, the Deployment's `replicas`, or empty for
none. The autoscaler owns the count; the chart never writes a number of its own (a Helm 4
server-side apply of another value than the autoscaler's conflicts on `.spec.replicas`):
- no live Deployment (`helm install`, `helm template`): none; the autoscaler starts from
  minReplicas;
- a live Deployment whose `.spec.replicas` another field manager owns (the autoscaler has scaled
  it) under a server-side applied release: none, and the field stays the autoscaler's;
- otherwise the live count as it is, not clamped to minReplicas..maxReplicas (the autoscaler
  applies new bounds itself): a manifest without the field would make Helm 3's patch, or Helm
  4's apply as the field's only owner, remove it, and the Deployment drop to 1 replica.
Read with `lookup` during install and upgrade.
*/}}
{{- define "model-triton.autoscaledReplicas" -}}
{{- $live := lookup "apps/v1" "Deployment" .Release.Namespace (include "model-triton.fullname" .) -}}
{{- if and $live (hasKey (default dict $live.spec) "replicas") -}}
{{- $applied := false -}}
{{- $others := false -}}
{{- range (default list $live.metadata.managedFields) -}}
{{- $owns := hasKey (dig "f:spec" dict (default dict .fieldsV1)) "f:replicas" -}}
{{- if and (eq (toString .manager) "helm") (eq (toString .operation) "Apply") -}}
{{- $applied = true -}}
{{- else if $owns -}}
{{- $others = true -}}
{{- end -}}
{{- end -}}
{{- if not (and $applied $others) -}}
{{- int $live.spec.replicas -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
model-triton.updateStrategy: the Deployment strategy. RollingUpdate with maxSurge 0 by default:
a full GPU node has no spare GPU for a surge pod.
*/}}
{{- define "model-triton.updateStrategy" -}}
{{- $s := .Values.triton.updateStrategy -}}
type: {{ $s.type }}
{{- if eq $s.type "RollingUpdate" }}
rollingUpdate:
  maxSurge: {{ include "model-triton.intOrPercent" $s.maxSurge }}
  {{- $mu := include "model-triton.maxUnavailable" . }}
  maxUnavailable: {{ ternary $mu (int $mu) (hasSuffix "%" $mu) }}
{{- end }}
{{- end -}}

{{/*
model-triton.progressDeadlineSeconds: how long one step of a rollout may take before the
Deployment reports ProgressDeadlineExceeded: a new pod may wait triton.waitForModel.timeoutSeconds
for the model, then load it within the startup probe's budget; plus 10 minutes for the image pull.
*/}}
{{- define "model-triton.progressDeadlineSeconds" -}}
{{- $t := .Values.triton -}}
{{- add (int $t.waitForModel.timeoutSeconds) (mul (int $t.startupProbe.periodSeconds) (int $t.startupProbe.failureThreshold)) 600 -}}
{{- end -}}

{{/*
model-triton.podLabels: the labels of the Triton pods: commonLabels, triton.podLabels (which
win over commonLabels), then the standard labels (which no user map may name).
*/}}
{{- define "model-triton.podLabels" -}}
{{- include "model-triton.labels" (dict "context" . "component" "triton" "extra" .Values.triton.podLabels) -}}
{{- end -}}

{{/*
model-triton.tritonLifecycle: triton.lifecycle, or by default a preStop sleep of
triton.preStopSleepSeconds: the pod leaves the Service endpoints (and the clients' resolvers)
before Triton receives SIGTERM, so no new request reaches a server that is shutting down; then
Triton finishes its in-flight requests within --exit-timeout-secs.
*/}}
{{- define "model-triton.tritonLifecycle" -}}
{{- if .Values.triton.lifecycle -}}
{{- toYaml .Values.triton.lifecycle -}}
{{- else -}}
preStop:
  exec:
    command: ["sleep", "{{ int .Values.triton.preStopSleepSeconds }}"]
{{- end -}}
{{- end -}}

{{/*
model-triton.queueTimeQuery: PromQL of the average queue time per request, in microseconds,
over 5 minutes: Triton's cumulative queue time divided by its successful requests. Used by the
PrometheusRule and the KEDA trigger (the HPA's prometheus-adapter rule is the same query).
Usage: include "model-triton.queueTimeQuery" (dict "selector" "<label matchers>" "by" "pod")
*/}}
{{- define "model-triton.queueTimeQuery" -}}
{{- $grouping := ternary (printf " by (%s)" .by) "" (ne .by "") -}}
{{- printf "sum%s (rate(nv_inference_queue_duration_us{%s}[5m])) / clamp_min(sum%s (rate(nv_inference_request_success{%s}[5m])), 0.001)" $grouping .selector $grouping .selector -}}
{{- end -}}

{{/*
model-triton.maxReplicas: autoscaling.maxReplicas, or nodes x N when it is 0.
*/}}
{{- define "model-triton.maxReplicas" -}}
{{- $most := include "model-triton.replicas" . | int -}}
{{- ternary $most (int .Values.autoscaling.maxReplicas) (eq (int .Values.autoscaling.maxReplicas) 0) -}}
{{- end -}}
