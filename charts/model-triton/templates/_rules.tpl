{{/*
_rules.tpl: The rule groups model-triton.validate runs besides the key and the GPU arithmetic:
numbers the API accepts, names it accepts, user maps that never repeat a key the chart writes,
what fits on a node, and features that work together. Each returns a JSON list of problems,
`model-triton: <key> ...` with the fix.
*/}}

{{/*
model-triton.numberProblems: every computed integer stays within int32 where the API field is
int32. The schema bounds each input by int32, so any product of two stays within int64 and is
compared, not wrapped.
*/}}
{{- define "model-triton.numberProblems" -}}
{{- $problems := list -}}
{{- $int32 := 2147483647 -}}
{{- $c := .Values.cluster -}}
{{- $t := .Values.triton -}}
{{- $replicas := mul (int $c.nodes) (int $c.replicasPerNode) -}}
{{- if gt $replicas $int32 -}}
{{- $problems = append $problems (printf "model-triton: cluster.nodes x cluster.replicasPerNode = %d is more replicas than a Deployment holds (%d); lower them." $replicas $int32) -}}
{{- end -}}
{{- $sizes := dict "cluster.nodeAllocatable.memory" (default dict $c.nodeAllocatable).memory "triton.shmSize" $t.shmSize "loader.scratchSizeLimit" .Values.loader.scratchSizeLimit "modelRepository.persistence.size" .Values.modelRepository.persistence.size -}}
{{- range $key, $res := dict "triton.resources" $t.resources "triton.waitForModel.resources" $t.waitForModel.resources "loader.resources" .Values.loader.resources "openai.resources" .Values.openai.resources -}}
{{- range $part := list "requests" "limits" -}}
{{- range $name := list "memory" "ephemeral-storage" -}}
{{- $_ := set $sizes (printf "%s.%s.%s" $key $part $name) (dig $part $name "" (default dict $res)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- range $key, $size := $sizes -}}
{{- $text := toString $size -}}
{{- if and (kindIs "string" $size) (ne $text "") (not (regexMatch "^([0-9]*[1-9][0-9]*(\\.[0-9]+)?|[0-9]*\\.[0-9]*[1-9][0-9]*)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)$" $text)) -}}
{{- $digits := regexReplaceAll "[^0-9.]" $text "" -}}
{{- $prefix := upper (regexReplaceAll "^[0-9.]+([kKmMgGtTpPeE]).*$" $text "${1}") -}}
{{- $hint := ternary (printf "write %q or %q" (printf "%s%si" $digits $prefix) (printf "%s%s" $digits (ternary "k" $prefix (eq $prefix "K")))) "e.g. \"32Gi\"" (regexMatch "^[0-9.]+[kKmMgGtTpPeE]i?[bB]?$" $text) -}}
{{- $problems = append $problems (printf "model-triton: %s is %q, not a size Kubernetes reads: a number above 0 and a unit, Ki, Mi, Gi, Ti, Pi, Ei (powers of 1024) or k, M, G, T, P, E (powers of 1000): %s." $key $text $hint) -}}
{{- end -}}
{{- end -}}
{{- $deadline := add (int $t.waitForModel.timeoutSeconds) (mul (int $t.startupProbe.periodSeconds) (int $t.startupProbe.failureThreshold)) 600 -}}
{{- if gt $deadline $int32 -}}
{{- $problems = append $problems (printf "model-triton: triton.waitForModel.timeoutSeconds + triton.startupProbe.periodSeconds x triton.startupProbe.failureThreshold + 600 = %d s, the Deployment's progressDeadlineSeconds, exceeds %d; lower them." $deadline $int32) -}}
{{- end -}}
{{- toJson $problems -}}
{{- end -}}

{{/*
model-triton.qualifiedKeyProblems: the keys of a label, annotation or resource map that
Kubernetes refuses: a qualified name is an optional DNS-1123 subdomain prefix (at most 253
characters) and `/`, then a name of at most 63 characters of letters, digits, '-', '_', '.',
starting and ending with a letter or digit.
Usage: include "model-triton.qualifiedKeyProblems" (dict "map" $m "key" "commonLabels")
*/}}
{{- define "model-triton.qualifiedKeyProblems" -}}
{{- $problems := list -}}
{{- $where := .key -}}
{{- range $k, $_ := (default dict .map) -}}
{{- $prefix := ternary (regexReplaceAll "/[^/]*$" $k "") "" (contains "/" $k) -}}
{{- $name := regexReplaceAll "^.*/" $k "" -}}
{{- $prefixOk := or (not (contains "/" $k)) (and (le (len $prefix) 253) (regexMatch "^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$" $prefix)) -}}
{{- $nameOk := and (le (len $name) 63) (regexMatch "^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$" $name) -}}
{{- if not (and $prefixOk $nameOk) -}}
{{- $problems = append $problems (printf "model-triton: %s has the key %q, which Kubernetes refuses: write [prefix/]name, the prefix a DNS subdomain of at most 253 characters, the name at most 63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit." $where $k) -}}
{{- end -}}
{{- end -}}
{{- toJson $problems -}}
{{- end -}}

{{/*
model-triton.nameProblems: resource names and image references the API server and the kubelet
accept: the full name is a DNS-1035 label (Service names start with a letter, no dots), the
loader's name a DNS-1123 subdomain, every image a reference the kubelet can pull.
*/}}
{{- define "model-triton.nameProblems" -}}
{{- $problems := list -}}
{{- $fullname := include "model-triton.fullname" . -}}
{{- if not (regexMatch "^[a-z]([-a-z0-9]*[a-z0-9])?$" $fullname) -}}
{{- $problems = append $problems (printf "model-triton: the release name %q (with nameOverride %q, fullnameOverride %q) makes the Service name %q, which Kubernetes refuses: a Service name starts with a letter and holds only a-z, 0-9 and '-'. Choose such a release name, or set fullnameOverride." .Release.Name (toString .Values.nameOverride) (toString .Values.fullnameOverride) $fullname) -}}
{{- end -}}
{{- $loader := include "model-triton.loaderName" . -}}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$" $loader) -}}
{{- $problems = append $problems (printf "model-triton: the release name %q makes the loader CronJob name %q, which Kubernetes refuses; choose a release name of a-z, 0-9 and '-'." .Release.Name $loader) -}}
{{- end -}}
{{- $component := "[a-z0-9]+((\\.|_|__|-+)[a-z0-9]+)*" -}}
{{- $domain := "(([a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])(\\.([a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9]))*(:[0-9]+)?/)?" -}}
{{- $reference := printf "^%s%s(/%s)*$" $domain $component $component -}}
{{- range $key, $image := dict "triton.image" .Values.triton.image "triton.waitForModel.image" .Values.triton.waitForModel.image "loader.image" .Values.loader.image "openai.image" .Values.openai.image -}}
{{- $name := include "model-triton.imageName" (dict "image" $image "context" $) -}}
{{- if or (not (regexMatch $reference $name)) (gt (len $name) 255) -}}
{{- $problems = append $problems (printf "model-triton: global.imageRegistry and %s.repository make the image name %q, which is not a reference the kubelet can pull (lower-case path components, an optional registry host[:port] first, at most 255 characters); put the tag in %s.tag and the digest in %s.digest." $key $name $key $key) -}}
{{- end -}}
{{- end -}}
{{- range $key, $map := dict "commonLabels" .Values.commonLabels "triton.podLabels" .Values.triton.podLabels "triton.podAnnotations" .Values.triton.podAnnotations "cluster.nodeSelector" .Values.cluster.nodeSelector "loader.nodeSelector" .Values.loader.nodeSelector "metrics.serviceMonitor.labels" .Values.metrics.serviceMonitor.labels "metrics.prometheusRule.labels" .Values.metrics.prometheusRule.labels "metrics.prometheus.podLabels" .Values.metrics.prometheus.podLabels "service.annotations" .Values.service.annotations "serviceAccount.annotations" .Values.serviceAccount.annotations "loader.serviceAccount.annotations" .Values.loader.serviceAccount.annotations "modelRepository.persistence.annotations" .Values.modelRepository.persistence.annotations "triton.resources.requests" (dig "requests" dict (default dict .Values.triton.resources)) "triton.resources.limits" (dig "limits" dict (default dict .Values.triton.resources)) "loader.resources.requests" (dig "requests" dict (default dict .Values.loader.resources)) "loader.resources.limits" (dig "limits" dict (default dict .Values.loader.resources)) "openai.podLabels" .Values.openai.podLabels "openai.podAnnotations" .Values.openai.podAnnotations "openai.nodeSelector" .Values.openai.nodeSelector "openai.service.annotations" .Values.openai.service.annotations "openai.resources.requests" (dig "requests" dict (default dict .Values.openai.resources)) "openai.resources.limits" (dig "limits" dict (default dict .Values.openai.resources)) -}}
{{- $problems = concat $problems (include "model-triton.qualifiedKeyProblems" (dict "map" $map "key" $key) | fromJsonArray) -}}
{{- end -}}
{{- toJson $problems -}}
{{- end -}}

{{/*
model-triton.ownedLabels: the label keys the chart writes itself (selectors, version, chart).
*/}}
{{- define "model-triton.ownedLabels" -}}
{{- toJson (list "app.kubernetes.io/name" "app.kubernetes.io/instance" "app.kubernetes.io/component" "app.kubernetes.io/version" "app.kubernetes.io/managed-by" "app.kubernetes.io/part-of" "helm.sh/chart") -}}
{{- end -}}

{{/*
model-triton.tritonOwnedFlags: the `tritonserver` long options the chart sets (read from the
command line it renders) and their synonyms (`--model-store` is `--model-repository`).
*/}}
{{- define "model-triton.tritonOwnedFlags" -}}
{{- $owned := list -}}
{{- range (include "model-triton.tritonChartArgs" . | fromYamlArray) -}}
{{- if hasPrefix "--" . -}}
{{- $owned = append $owned (first (splitList "=" (trimPrefix "--" .))) -}}
{{- end -}}
{{- end -}}
{{- if has "model-repository" $owned -}}
{{- $owned = append $owned "model-store" -}}
{{- end -}}
{{- toJson $owned -}}
{{- end -}}

{{/*
model-triton.collisionProblems: a user map or list never repeats what the chart writes itself:
label keys, pod annotations, the PVC's resource policy, volume names and mount paths,
environment variables, `tritonserver` options (getopt_long also takes an unambiguous prefix:
`--exit-timeout=0` is `--exit-timeout-secs`), the GPU resource, ServiceAccount names.
*/}}
{{- define "model-triton.collisionProblems" -}}
{{- $problems := list -}}
{{- $v := .Values -}}
{{- $t := .Values.triton -}}
{{- $owned := include "model-triton.ownedLabels" . | fromJsonArray -}}
{{- range $key, $map := dict "commonLabels" $v.commonLabels "triton.podLabels" $t.podLabels "metrics.serviceMonitor.labels" $v.metrics.serviceMonitor.labels "metrics.prometheusRule.labels" $v.metrics.prometheusRule.labels "openai.podLabels" $v.openai.podLabels -}}
{{- range $label, $_ := (default dict $map) -}}
{{- if has $label $owned -}}
{{- $problems = append $problems (printf "model-triton: %s sets %q, a label the chart writes itself (its selectors and version); remove it." $key $label) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- range $annotation, $_ := (default dict $t.podAnnotations) -}}
{{- if has $annotation (list "checksum/config" "model-triton/model-key") -}}
{{- $problems = append $problems (printf "model-triton: triton.podAnnotations sets %q, an annotation the chart writes on the Triton pods; remove it." $annotation) -}}
{{- end -}}
{{- end -}}
{{- range $annotation, $_ := (default dict $v.modelRepository.persistence.annotations) -}}
{{- if eq $annotation "helm.sh/resource-policy" -}}
{{- $problems = append $problems "model-triton: modelRepository.persistence.annotations sets helm.sh/resource-policy, which the chart sets from modelRepository.persistence.keep; use keep (true keeps the claim on uninstall) and remove the annotation." -}}
{{- end -}}
{{- end -}}
{{- $volumes := list "models" "dshm" "tmp" -}}
{{- range $t.extraVolumes -}}
{{- if has .name $volumes -}}
{{- $problems = append $problems (printf "model-triton: triton.extraVolumes has the volume name %q, which the chart's own volumes (models, dshm, tmp) or an earlier entry already use; rename it." .name) -}}
{{- end -}}
{{- $volumes = append $volumes .name -}}
{{- end -}}
{{- $paths := list "/models" "/dev/shm" "/tmp" -}}
{{- range $t.extraVolumeMounts -}}
{{- $path := clean (toString .mountPath) -}}
{{- if has $path $paths -}}
{{- $problems = append $problems (printf "model-triton: triton.extraVolumeMounts mounts at %q, where the chart (/models, /dev/shm, /tmp) or an earlier entry already mounts; choose another mountPath." (toString .mountPath)) -}}
{{- end -}}
{{- $paths = append $paths $path -}}
{{- if not (has .name $volumes) -}}
{{- $problems = append $problems (printf "model-triton: triton.extraVolumeMounts names the volume %q, which is neither one of triton.extraVolumes nor the chart's (models, dshm, tmp)." (toString .name)) -}}
{{- end -}}
{{- end -}}
{{- range $key, $spec := dict "triton.extraEnv" (dict "list" $t.extraEnv "owned" (list "HOME")) "loader.extraEnv" (dict "list" $v.loader.extraEnv "owned" (list "HOME" "HF_HOME" "HF_TOKEN_FILE" "GOOGLE_APPLICATION_CREDENTIALS")) -}}
{{- $seen := $spec.owned -}}
{{- range $spec.list -}}
{{- if has .name $seen -}}
{{- $problems = append $problems (printf "model-triton: %s sets %q twice, or a variable the chart sets (%s); remove it." $key .name (join ", " $spec.owned)) -}}
{{- end -}}
{{- $seen = append $seen .name -}}
{{- end -}}
{{- end -}}
{{- $flags := include "model-triton.tritonOwnedFlags" . | fromJsonArray -}}
{{- range $t.extraArgs -}}
{{- $arg := toString . -}}
{{- if hasPrefix "--" $arg -}}
{{- $name := first (splitList "=" (trimPrefix "--" $arg)) -}}
{{- $clash := eq $name "" -}}
{{- range $flags -}}
{{- if hasPrefix $name . -}}{{- $clash = true -}}{{- end -}}
{{- end -}}
{{- if $clash -}}
{{- $problems = append $problems (printf "model-triton: triton.extraArgs has %q, which sets (or abbreviates) a tritonserver option the chart sets itself (--%s); remove it and use the value the chart derives it from (README, \"Triton's command line\")." $arg (join ", --" $flags)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $gpu := .Values.cluster.gpuResourceName -}}
{{- range $key, $res := dict "triton.resources" $t.resources -}}
{{- range $part := list "requests" "limits" -}}
{{- range $name, $_ := (default dict (get (default dict $res) $part)) -}}
{{- if or (eq $name $gpu) (eq $name "nvidia.com/gpu") (hasPrefix "nvidia.com/mig-" $name) -}}
{{- $problems = append $problems (printf "model-triton: %s.%s sets %q, which the chart computes (T x P of cluster.gpuResourceName); remove it." $key $part $name) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $triton := include "model-triton.serviceAccountName" . -}}
{{- $loader := include "model-triton.loaderServiceAccountName" . -}}
{{- if eq $triton $loader -}}
{{- $problems = append $problems (printf "model-triton: serviceAccount.name (%q, create: %v) and loader.serviceAccount.name (%q, create: %v) give the Triton pods and the loader one ServiceAccount, %q (with create: false an empty name is the namespace's \"default\"); the loader's identity (storage access) must not be the Triton pods'. Give them different names, e.g. loader.serviceAccount.create: true." (toString .Values.serviceAccount.name) .Values.serviceAccount.create (toString .Values.loader.serviceAccount.name) .Values.loader.serviceAccount.create $triton) -}}
{{- end -}}
{{- toJson $problems -}}
{{- end -}}

{{/*
model-triton.fitProblems: what one node must hold and what the API checks of every container:
N x the Triton pod's CPU and memory within cluster.nodeAllocatable, limits not below requests,
one MIG slice per replica with cluster.gpuMemoryGiB within it.
*/}}
{{- define "model-triton.fitProblems" -}}
{{- $problems := list -}}
{{- $c := .Values.cluster -}}
{{- $t := .Values.triton -}}
{{- range $key, $res := dict "triton.resources" $t.resources "triton.waitForModel.resources" $t.waitForModel.resources "loader.resources" .Values.loader.resources "openai.resources" .Values.openai.resources -}}
{{- range $name := list "cpu" "memory" "ephemeral-storage" -}}
{{- $request := include "model-triton.quantity" (dig "requests" $name nil (default dict $res)) -}}
{{- $limit := include "model-triton.quantity" (dig "limits" $name nil (default dict $res)) -}}
{{- if and $request $limit (include "model-triton.exceeds" (dict "a" $request "b" $limit)) -}}
{{- $problems = append $problems (printf "model-triton: %s.requests.%s (%v) is above %s.limits.%s (%v); Kubernetes refuses a limit below its request." $key $name (dig "requests" $name "" $res) $key $name (dig "limits" $name "" $res)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $n := int $c.replicasPerNode -}}
{{- $oneNode := include "model-triton.volumeIsOneNode" . -}}
{{- range $name := list "cpu" "memory" -}}
{{- $have := include "model-triton.quantity" (get (default dict $c.nodeAllocatable) $name | default nil) -}}
{{- if $have -}}
{{- $one := include "model-triton.podRequest" (dict "containers" (list (default dict $t.resources)) "init" (list (default dict $t.waitForModel.resources)) "name" $name) -}}
{{- $need := mulf (float64 $one) $n -}}
{{- $triton := dig "requests" $name (dig "limits" $name "0" (default dict $t.resources)) (default dict $t.resources) -}}
{{- if include "model-triton.exceeds" (dict "a" $need "b" $have) -}}
{{- $problems = append $problems (printf "model-triton: cluster.replicasPerNode x the Triton pod's %s request = %d x %v exceeds cluster.nodeAllocatable.%s = %v: the replicas cannot all fit on a node. Lower triton.resources.requests.%s or cluster.replicasPerNode." $name $n $triton $name (get $c.nodeAllocatable $name) $name) -}}
{{- else if $oneNode -}}
{{- /* A one-node volume: the loader runs on the Triton pods' node (_loader.tpl), next to them. */ -}}
{{- $loaderRes := default dict $.Values.loader.resources -}}
{{- $loader := include "model-triton.podRequest" (dict "containers" (list $loaderRes) "init" list "name" $name) -}}
{{- if include "model-triton.exceeds" (dict "a" (addf $need (float64 $loader)) "b" $have) -}}
{{- $problems = append $problems (printf "model-triton: the volume attaches to one node (ReadWriteOnce), so the loader runs next to the Triton pods: cluster.replicasPerNode x the Triton pod's %s request + the loader's = %d x %v + %v exceeds cluster.nodeAllocatable.%s = %v, and neither could finish. Lower loader.resources.requests.%s, triton.resources.requests.%s or cluster.replicasPerNode, or use a ReadWriteMany volume." $name $n $triton (dig "requests" $name (dig "limits" $name "0" $loaderRes) $loaderRes) $name (get $c.nodeAllocatable $name) $name $name) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $mig := regexFindAll "^nvidia\\.com/mig-[0-9]+g\\.([0-9]+)gb" (toString $c.gpuResourceName) 1 -}}
{{- if and $mig (include "model-triton.gpuBackend" .) -}}
{{- $perReplica := include "model-triton.gpusPerReplica" . | int -}}
{{- if gt $perReplica 1 -}}
{{- $problems = append $problems (printf "model-triton: cluster.gpuResourceName is the MIG slice %s, but model.tensorParallelSize x model.pipelineParallelSize = %d: FasterTransformer's NCCL cannot span MIG slices. Use T = P = 1 on MIG, or whole GPUs (nvidia.com/gpu)." $c.gpuResourceName $perReplica) -}}
{{- end -}}
{{- $slice := regexReplaceAll "^.*\\.([0-9]+)gb.*$" (toString $c.gpuResourceName) "${1}" | float64 -}}
{{- if gt (float64 $c.gpuMemoryGiB) $slice -}}
{{- $problems = append $problems (printf "model-triton: cluster.gpuMemoryGiB = %v is more than one %s slice holds (%v GB); set it to the slice's memory (nvidia-smi mig -lgip), which the loader plans the model for." $c.gpuMemoryGiB $c.gpuResourceName $slice) -}}
{{- end -}}
{{- end -}}
{{- toJson $problems -}}
{{- end -}}

{{/*
model-triton.featureProblems: optional features that only work in some combinations.
*/}}
{{- define "model-triton.featureProblems" -}}
{{- $problems := list -}}
{{- $fullname := include "model-triton.fullname" . -}}
{{- $queries := or .Values.metrics.prometheusRule.enabled (and .Values.autoscaling.enabled (eq .Values.autoscaling.kind "keda")) -}}
{{- if and $queries (gt (len $fullname) 46) -}}
{{- $problems = append $problems (printf "model-triton: the full name %q is %d characters long: Kubernetes shortens the names of its pods, so the alerts and the KEDA query could not tell them from another release's. Set fullnameOverride (or a release name) of at most 46 characters, or turn off metrics.prometheusRule and KEDA." $fullname (len $fullname)) -}}
{{- end -}}
{{- $p := .Values.modelRepository.persistence -}}
{{- if and .Values.loader.prune.enabled $p.existingClaim $p.shared -}}
{{- $problems = append $problems (printf "model-triton: loader.prune.enabled removes published keys from modelRepository.persistence.existingClaim %q, which other releases may serve from (modelRepository.persistence.shared: true). Turn prune off, or set shared: false if this release alone uses the claim." $p.existingClaim) -}}
{{- end -}}
{{- toJson $problems -}}
{{- end -}}

{{/*
model-triton.workProblems: values every part of Kubernetes accepts that still cannot work.
*/}}
{{- define "model-triton.workProblems" -}}
{{- $problems := list -}}
{{- $c := .Values.cluster -}}
{{- $t := .Values.triton -}}
{{- if include "model-triton.gpuBackend" . -}}
{{- $perReplica := include "model-triton.gpusPerReplica" . | int -}}
{{- /* Time-shared GPUs: GKE grants a container one time-shared (or MPS) GPU at most, and the
device plugin's time-slicing may hand two replicas of one GPU to one pod: FasterTransformer's
NCCL ranks need a GPU each. */ -}}
{{- $sharing := get (default dict $c.nodeSelector) "cloud.google.com/gke-gpu-sharing-strategy" -}}
{{- if and (gt $perReplica 1) (or $sharing (hasSuffix ".shared" (toString $c.gpuResourceName))) -}}
{{- $problems = append $problems (printf "model-triton: model.tensorParallelSize x model.pipelineParallelSize = %d on shared GPUs (%s): a container gets one time-shared GPU at most (GKE refuses more; the device plugin's time-slicing may give one pod two slices of one GPU), and FasterTransformer's NCCL ranks each need a GPU of their own. Use T = P = 1 on shared GPUs, or a pool of whole GPUs." $perReplica (ternary (printf "cloud.google.com/gke-gpu-sharing-strategy: %v" $sharing) (toString $c.gpuResourceName) (ne (toString $sharing) ""))) -}}
{{- end -}}
{{- /* maxUnavailable 0 leaves the rollout to surge pods, which a full node has no GPU for. */ -}}
{{- $u := $t.updateStrategy -}}
{{- if and (eq $u.type "RollingUpdate") (eq (toString $u.maxUnavailable | trimSuffix "%") "0") (eq (include "model-triton.gpusUsedPerNode" . | int) (int $c.gpusPerNode)) -}}
{{- $problems = append $problems (printf "model-triton: triton.updateStrategy.maxUnavailable is 0 on a full pool (cluster.replicasPerNode x T x P = %d = cluster.gpusPerNode): every rollout would wait for surge pods that find no free GPU, and never replace a pod. Leave maxUnavailable empty (automatic), or use triton.updateStrategy.type Recreate." (int $c.gpusPerNode)) -}}
{{- end -}}
{{- end -}}
{{- /* A Service outside the cluster, behind a policy that admits only pods. */ -}}
{{- if and .Values.networkPolicy.enabled (has .Values.service.type (list "LoadBalancer" "NodePort")) -}}
{{- $blocks := false -}}
{{- range .Values.networkPolicy.allowedFrom -}}
{{- if hasKey . "ipBlock" -}}{{- $blocks = true -}}{{- end -}}
{{- end -}}
{{- if not $blocks -}}
{{- $problems = append $problems (printf "model-triton: service.type is %s, which exposes Triton's gRPC and metrics ports outside the cluster, but the NetworkPolicy admits only pods (networkPolicy.allowedFrom has no ipBlock): no outside client could connect. Keep service.type ClusterIP behind your gateway (let it in with networkPolicy.allowedFrom), or add an ipBlock of your clients' addresses to networkPolicy.allowedFrom." .Values.service.type) -}}
{{- end -}}
{{- end -}}
{{- toJson $problems -}}
{{- end -}}
