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
model-triton.tritonArgs: the `tritonserver` command line (a YAML list).
*/}}
{{- define "model-triton.tritonArgs" -}}
- tritonserver
- --model-repository={{ include "model-triton.modelPath" . }}
- --http-port=8000
- --grpc-port=8001
- --metrics-port=8002
- --exit-timeout-secs={{ max 5 (sub (int .Values.triton.terminationGracePeriodSeconds) 10) }}
{{- range .Values.triton.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end -}}

{{/*
model-triton.tritonResources: triton.resources with `nvidia.com/gpu` = T x P in requests and
limits (GPU backend only).
*/}}
{{- define "model-triton.tritonResources" -}}
{{- $res := deepCopy (default dict .Values.triton.resources) -}}
{{- if include "model-triton.gpuBackend" . -}}
{{- $gpus := include "model-triton.gpusPerReplica" . | int -}}
{{- $_ := set $res "requests" (merge (dict "nvidia.com/gpu" $gpus) (default dict $res.requests)) -}}
{{- $_ := set $res "limits" (merge (dict "nvidia.com/gpu" $gpus) (default dict $res.limits)) -}}
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
{{- end -}}
