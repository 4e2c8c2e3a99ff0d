{{/*
_openai.tpl: The OpenAI-compatible completions service (openai.enabled): its name, labels, the
command line it runs (the flags of `completions-service`), where its API keys are mounted, the
URL of Triton it calls, and the values that cannot work together.
*/}}

{{/*
model-triton.openaiName: the name of the service's Deployment, Service, NetworkPolicy,
PodDisruptionBudget and HorizontalPodAutoscaler.
*/}}
{{- define "model-triton.openaiName" -}}
{{- include "model-triton.suffixedName" (dict "context" . "suffix" "-openai") -}}
{{- end -}}

{{/*
model-triton.openaiClientLabel: the label (`key: value`) that admits a pod of the release
namespace to the service's port.
*/}}
{{- define "model-triton.openaiClientLabel" -}}
model-triton/openai-client: {{ include "model-triton.fullname" . }}
{{- end -}}

{{/*
model-triton.openaiPodLabels: the labels of the service's pods: commonLabels, openai.podLabels,
then the standard labels (component `openai`).
*/}}
{{- define "model-triton.openaiPodLabels" -}}
{{- include "model-triton.labels" (dict "context" . "component" "openai" "extra" .Values.openai.podLabels) -}}
{{- end -}}

{{/*
model-triton.openaiKeysDir / openaiKeysFile: where the API-key Secret is mounted, and the file
`--api-keys-file` names (the Secret's openai.apiKeys.key, projected under a fixed name).
*/}}
{{- define "model-triton.openaiKeysDir" -}}
/var/secrets/openai
{{- end -}}

{{- define "model-triton.openaiKeysFile" -}}
{{ include "model-triton.openaiKeysDir" . }}/keys
{{- end -}}

{{/*
model-triton.openaiAdminToken: "true" when the service needs Triton's admin header: it reads the
`llm` model's configuration (context length, served name) over the `model-config` protocol,
which triton.security.restrictedGrpcProtocols restricts by default. Only then is the admin
Secret's token mounted into its pods.
*/}}
{{- define "model-triton.openaiAdminToken" -}}
{{- if has "model-config" .Values.triton.security.restrictedGrpcProtocols -}}true{{- end -}}
{{- end -}}

{{- define "model-triton.openaiAdminTokenDir" -}}
/var/secrets/triton-admin
{{- end -}}

{{/*
model-triton.tritonGrpcUrl: Triton's gRPC endpoint as the service calls it: the chart's Triton
Service (port 8001, open on the network whatever triton.security.http is).
*/}}
{{- define "model-triton.tritonGrpcUrl" -}}
grpc://{{ include "model-triton.fullname" . }}.{{ .Release.Namespace }}.svc:8001
{{- end -}}

{{/*
model-triton.openaiCommand: the service's command line (a YAML list), the flags of
`completions-service`: Triton's URL and the `llm` model, where it listens, its bounds, the keys
file when openai.apiKeys.existingSecret names one, and Triton's admin header with the file of
its token when `model-config` is restricted (model-triton.openaiAdminToken).
*/}}
{{- define "model-triton.openaiCommand" -}}
{{- $o := .Values.openai -}}
- completions-service
- --triton-url={{ include "model-triton.tritonGrpcUrl" . }}
- --triton-model=llm
- --listen=0.0.0.0:8080
- --max-concurrency={{ int $o.maxConcurrency }}
- --max-queue={{ int $o.maxQueue }}
- --max-body-bytes={{ int64 $o.maxBodyBytes }}
- --request-timeout-s={{ int $o.requestTimeoutSeconds }}
{{- if $o.apiKeys.existingSecret }}
- --api-keys-file={{ include "model-triton.openaiKeysFile" . }}
{{- end }}
{{- if include "model-triton.openaiAdminToken" . }}
- --triton-protocol-header={{ include "model-triton.adminHeader" . }}
- --triton-protocol-token-file={{ include "model-triton.openaiAdminTokenDir" . }}/token
{{- end }}
{{- end -}}

{{/*
model-triton.openaiOwnedEnv: the `COMPLETIONS_<FLAG>` variables of the flags the chart sets
(each flag of `completions-service` also reads one): openai.extraEnv may not set them.
*/}}
{{- define "model-triton.openaiOwnedEnv" -}}
{{- $owned := list -}}
{{- range (include "model-triton.openaiCommand" . | fromYamlArray) -}}
{{- if hasPrefix "--" . -}}
{{- $owned = append $owned (printf "COMPLETIONS_%s" (first (splitList "=" (trimPrefix "--" .)) | upper | replace "-" "_")) -}}
{{- end -}}
{{- end -}}
{{- toJson $owned -}}
{{- end -}}

{{/*
model-triton.openaiAutoscaledReplicas: with openai.autoscaling on, the live Deployment's
replicas (read with `lookup` during `helm upgrade`) within its bounds, so that turning the HPA
on keeps the pods until it decides; empty on install and `helm template`.
*/}}
{{- define "model-triton.openaiAutoscaledReplicas" -}}
{{- $a := .Values.openai.autoscaling -}}
{{- $live := lookup "apps/v1" "Deployment" .Release.Namespace (include "model-triton.openaiName" .) -}}
{{- if and $live (hasKey (default dict $live.spec) "replicas") -}}
{{- min (int $a.maxReplicas) (max (int $a.minReplicas) (int $live.spec.replicas)) -}}
{{- end -}}
{{- end -}}

{{/*
model-triton.openaiLifecycle: a preStop sleep of openai.preStopSleepSeconds (none when 0): the
pod leaves the Service endpoints before the service receives SIGTERM.
*/}}
{{- define "model-triton.openaiLifecycle" -}}
{{- if gt (int .Values.openai.preStopSleepSeconds) 0 -}}
preStop:
  exec:
    command: ["sleep", "{{ int .Values.openai.preStopSleepSeconds }}"]
{{- end -}}
{{- end -}}

{{/*
model-triton.openaiProblems: the values of the service (and of who may reach Triton) that
cannot work together, as a JSON list of `model-triton: <key> ...` lines with the fix
(collected by model-triton.validate).
*/}}
{{- define "model-triton.openaiProblems" -}}
{{- $problems := list -}}
{{- $o := .Values.openai -}}
{{- $np := .Values.networkPolicy -}}
{{- if eq $np.tritonFrom "openai" -}}
{{- if not $o.enabled -}}
{{- $problems = append $problems "model-triton: networkPolicy.tritonFrom is openai, but openai.enabled is false: no pod could reach Triton but the helm test pod. Set openai.enabled=true, or networkPolicy.tritonFrom=clients." -}}
{{- end -}}
{{- if not $np.enabled -}}
{{- $problems = append $problems "model-triton: networkPolicy.tritonFrom is openai, but networkPolicy.enabled is false: without the NetworkPolicies every pod can reach Triton. Set networkPolicy.enabled=true, or networkPolicy.tritonFrom=clients." -}}
{{- end -}}
{{- if $np.allowedFrom -}}
{{- $problems = append $problems "model-triton: networkPolicy.tritonFrom is openai (only the OpenAI-compatible service reaches Triton), but networkPolicy.allowedFrom admits other peers. Empty networkPolicy.allowedFrom (admit those clients to the service with openai.networkPolicy.allowedFrom), or set networkPolicy.tritonFrom=clients." -}}
{{- end -}}
{{- end -}}
{{- if $o.enabled -}}
{{- $a := $o.autoscaling -}}
{{- if and $a.enabled (gt (int $a.minReplicas) (int $a.maxReplicas)) -}}
{{- $problems = append $problems (printf "model-triton: openai.autoscaling.minReplicas = %d exceeds openai.autoscaling.maxReplicas = %d; lower it or raise maxReplicas." (int $a.minReplicas) (int $a.maxReplicas)) -}}
{{- end -}}
{{- if and $a.enabled (not (dig "requests" "cpu" "" (default dict $o.resources))) -}}
{{- $problems = append $problems "model-triton: openai.autoscaling.enabled scales on CPU utilization, a share of the CPU request, but openai.resources.requests.cpu is not set: the HorizontalPodAutoscaler could never compute it. Set openai.resources.requests.cpu (e.g. 500m)." -}}
{{- end -}}
{{- if lt (int $o.terminationGracePeriodSeconds) (add (int $o.preStopSleepSeconds) 5) -}}
{{- $problems = append $problems (printf "model-triton: openai.terminationGracePeriodSeconds = %d leaves the service no time to finish in-flight requests after the preStop sleep of openai.preStopSleepSeconds = %d. Set it to at least %d." (int $o.terminationGracePeriodSeconds) (int $o.preStopSleepSeconds) (add (int $o.preStopSleepSeconds) 5)) -}}
{{- end -}}
{{- $ownedEnv := include "model-triton.openaiOwnedEnv" . | fromJsonArray -}}
{{- $seen := list "HOME" -}}
{{- range $o.extraEnv -}}
{{- $name := toString .name -}}
{{- if has $name $ownedEnv -}}
{{- $problems = append $problems (printf "model-triton: openai.extraEnv sets %s, the variable of a flag the chart sets on the service's command line (%s); set the openai value it comes from instead (README values table)." $name (join ", " $ownedEnv)) -}}
{{- else if has $name $seen -}}
{{- $problems = append $problems (printf "model-triton: openai.extraEnv sets %q twice, or a variable the chart sets (HOME); remove it." $name) -}}
{{- end -}}
{{- $seen = append $seen $name -}}
{{- end -}}
{{- end -}}
{{- toJson $problems -}}
{{- end -}}
