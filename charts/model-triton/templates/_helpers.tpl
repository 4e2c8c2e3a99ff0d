{{/*
model-triton.name: the chart name, or nameOverride.
*/}}
{{- define "model-triton.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
model-triton.fullname: the prefix of every resource name (`<release>-model-triton` unless the
release name already contains the chart name), at most 63 characters.
*/}}
{{- define "model-triton.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
model-triton.loaderName: name of the loader CronJob (`<release>-model-loader`, the name users
pass to `kubectl create job --from=cronjob/...`) and of the hook Job.
*/}}
{{- define "model-triton.loaderName" -}}
{{- printf "%s-model-loader" .Release.Name | trunc 52 | trimSuffix "-" -}}
{{- end -}}

{{/*
model-triton.chart: chart name and version, for the helm.sh/chart label.
*/}}
{{- define "model-triton.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
model-triton.selectorLabels: the labels a selector matches (name, instance, component). Never
add the version or helm.sh/chart here: selectors are immutable.
Usage: include "model-triton.selectorLabels" (dict "context" $ "component" "triton")
*/}}
{{- define "model-triton.selectorLabels" -}}
app.kubernetes.io/name: {{ include "model-triton.name" .context }}
app.kubernetes.io/instance: {{ .context.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/*
model-triton.labels: the full label set of a resource: selector labels, version, chart,
manager, and commonLabels.
Usage: include "model-triton.labels" (dict "context" $ "component" "triton")
*/}}
{{- define "model-triton.labels" -}}
helm.sh/chart: {{ include "model-triton.chart" .context }}
{{ include "model-triton.selectorLabels" . }}
app.kubernetes.io/version: {{ .context.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .context.Release.Service }}
app.kubernetes.io/part-of: model-triton
{{- with .context.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/*
model-triton.serviceAccountName: the ServiceAccount of the Triton and loader pods.
*/}}
{{- define "model-triton.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "model-triton.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/*
model-triton.claimName: the PVC holding the model repositories.
*/}}
{{- define "model-triton.claimName" -}}
{{- default (printf "%s-models" (include "model-triton.fullname" .)) .Values.modelRepository.persistence.existingClaim -}}
{{- end -}}

{{/*
model-triton.modelsMountPath: where the model volume is mounted, in the loader AND in Triton.
Absolute paths the loader writes into config files are final paths, so both must agree.
*/}}
{{- define "model-triton.modelsMountPath" -}}
/models
{{- end -}}

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
model-triton.sourceScheme: the scheme of model.source (`gs`, `hf`, `file`, ...), empty when the
URI has none.
*/}}
{{- define "model-triton.sourceScheme" -}}
{{- $source := .Values.model.source | toString -}}
{{- if contains "://" $source -}}
{{- first (splitList "://" $source) | lower -}}
{{- end -}}
{{- end -}}

{{/*
model-triton.modelRevision: the revision part of the model key: model.revision if set; else the
text after the first `@` of an `hf://org/name@rev` source; else `src-` + the first 10 hex digits of the sha256 of
the source URI exactly as given.
*/}}
{{- define "model-triton.modelRevision" -}}
{{- $source := .Values.model.source | toString -}}
{{- $repo := trimPrefix "hf://" $source -}}
{{- if .Values.model.revision -}}
{{- .Values.model.revision -}}
{{- else if and (hasPrefix "hf://" $source) (contains "@" $repo) -}}
{{- regexReplaceAll "^[^@]*@" $repo "" -}}
{{- else -}}
{{- printf "src-%s" (sha256sum $source | trunc 10) -}}
{{- end -}}
{{- end -}}

{{/*
model-triton.preferredBatchSizes: the preferred batch sizes comma-joined ("4,8"), empty when
dynamic batching is off.
*/}}
{{- define "model-triton.preferredBatchSizes" -}}
{{- $sizes := list -}}
{{- if .Values.triton.dynamicBatching.enabled -}}
{{- range .Values.triton.dynamicBatching.preferredBatchSize -}}
{{- $sizes = append $sizes (int . | toString) -}}
{{- end -}}
{{- end -}}
{{- join "," $sizes -}}
{{- end -}}

{{/*
model-triton.variantSettings: the canonical settings string the variant hashes (UTF-8, no
spaces). The loader builds the same string (loader.repository.key); keep them identical.
*/}}
{{- define "model-triton.variantSettings" -}}
{{- $t := .Values.triton -}}
{{- $batching := $t.dynamicBatching.enabled -}}
{{- printf "backend=%s;dtype=%s;max_batch_size=%d;dynamic_batching=%s;preferred_batch_size=%s;max_queue_delay_us=%s;streaming=%s"
      $t.backend
      (default "auto" .Values.model.dtype)
      (int $t.maxBatchSize)
      (ternary "1" "0" $batching)
      (include "model-triton.preferredBatchSizes" .)
      (ternary (int $t.dynamicBatching.maxQueueDelayMicroseconds | toString) "" $batching)
      (ternary "1" "0" $t.streaming) -}}
{{- end -}}

{{/*
model-triton.modelKey: `{name}@{revision}/tp{T}-pp{P}-i{I}-{variant}`, the directory under
/models the loader publishes and Triton serves; variant = sha256(variantSettings)[:8].
*/}}
{{- define "model-triton.modelKey" -}}
{{- printf "%s@%s/tp%d-pp%d-i%d-%s"
      .Values.model.name
      (include "model-triton.modelRevision" .)
      (int .Values.model.tensorParallelSize)
      (int .Values.model.pipelineParallelSize)
      (int .Values.triton.instanceCount)
      (include "model-triton.variantSettings" . | sha256sum | trunc 8) -}}
{{- end -}}

{{/*
model-triton.modelPath: the published repository Triton serves, /models/<key>.
*/}}
{{- define "model-triton.modelPath" -}}
{{- printf "%s/%s" (include "model-triton.modelsMountPath" .) (include "model-triton.modelKey" .) -}}
{{- end -}}

{{/*
model-triton.loaderArgs: the `model-loader` arguments (a YAML list) derived from the same values
as the Deployment, so T, P, I and batching cannot drift between the Job and the pods.
*/}}
{{- define "model-triton.loaderArgs" -}}
{{- $t := .Values.triton -}}
- run
- --source
- {{ .Values.model.source | quote }}
- --repository
- {{ include "model-triton.modelsMountPath" . | quote }}
- --model-name
- {{ .Values.model.name | quote }}
{{- with .Values.model.revision }}
- --revision
- {{ . | quote }}
{{- end }}
- --tp-size
- {{ int .Values.model.tensorParallelSize | quote }}
- --pp-size
- {{ int .Values.model.pipelineParallelSize | quote }}
- --instance-count
- {{ int $t.instanceCount | quote }}
- --backend
- {{ $t.backend | quote }}
{{- with .Values.model.dtype }}
- --dtype
- {{ . | quote }}
{{- end }}
- --max-batch-size
- {{ int $t.maxBatchSize | quote }}
{{- if $t.dynamicBatching.enabled }}
- --dynamic-batching
{{- with $t.dynamicBatching.preferredBatchSize }}
- --preferred-batch-size
{{- range . }}
- {{ int . | quote }}
{{- end }}
{{- end }}
- --max-queue-delay-us
- {{ int $t.dynamicBatching.maxQueueDelayMicroseconds | quote }}
{{- else }}
- --no-dynamic-batching
{{- end }}
- --gpu-memory-gib
- {{ .Values.cluster.gpuMemoryGiB | toString | quote }}
- --gpus-per-replica
- {{ include "model-triton.gpusPerReplica" . | quote }}
{{- if $t.streaming }}
- --streaming
{{- end }}
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
model-triton.image: an image reference: repository@digest when a digest is set, else
repository:tag with the tag defaulting to the chart's appVersion.
Usage: include "model-triton.image" (dict "image" .Values.loader.image "context" $)
*/}}
{{- define "model-triton.image" -}}
{{- if .image.digest -}}
{{- printf "%s@%s" .image.repository .image.digest -}}
{{- else -}}
{{- printf "%s:%s" .image.repository (default .context.Chart.AppVersion .image.tag | toString) -}}
{{- end -}}
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
model-triton.loaderJobSpec: the Job spec of the loader, shared by the CronJob's jobTemplate and
the hook Job.
*/}}
{{- define "model-triton.loaderJobSpec" -}}
backoffLimit: {{ int .Values.loader.backoffLimit }}
activeDeadlineSeconds: {{ int .Values.loader.activeDeadlineSeconds }}
ttlSecondsAfterFinished: {{ int .Values.loader.ttlSecondsAfterFinished }}
template:
  metadata:
    labels:
      {{- include "model-triton.labels" (dict "context" . "component" "loader") | nindent 6 }}
    annotations:
      model-triton/model-key: {{ include "model-triton.modelKey" . | quote }}
  spec:
    restartPolicy: Never
    serviceAccountName: {{ include "model-triton.serviceAccountName" . }}
    automountServiceAccountToken: false
    {{- with .Values.triton.imagePullSecrets }}
    imagePullSecrets:
      {{- range . }}
      - name: {{ . }}
      {{- end }}
    {{- end }}
    securityContext:
      {{- toYaml .Values.podSecurityContext | nindent 6 }}
    {{- with .Values.loader.nodeSelector }}
    nodeSelector:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    {{- with .Values.loader.tolerations }}
    tolerations:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    {{- with .Values.loader.affinity }}
    affinity:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    containers:
      - name: loader
        image: {{ include "model-triton.image" (dict "image" .Values.loader.image "context" .) }}
        imagePullPolicy: {{ .Values.loader.image.pullPolicy }}
        args:
          {{- include "model-triton.loaderArgs" . | nindent 10 }}
        env:
          - name: HOME
            value: /tmp
          - name: HF_HOME
            value: /tmp/huggingface
          {{- if .Values.loader.hfTokenSecret.name }}
          - name: HF_TOKEN_PATH
            value: /var/secrets/hf/{{ .Values.loader.hfTokenSecret.key }}
          {{- end }}
          {{- if .Values.loader.gcsCredentialsSecret.name }}
          - name: GOOGLE_APPLICATION_CREDENTIALS
            value: /var/secrets/gcs/{{ .Values.loader.gcsCredentialsSecret.key }}
          {{- end }}
          {{- with .Values.loader.extraEnv }}
          {{- toYaml . | nindent 10 }}
          {{- end }}
        resources:
          {{- toYaml .Values.loader.resources | nindent 10 }}
        securityContext:
          {{- toYaml .Values.containerSecurityContext | nindent 10 }}
        volumeMounts:
          - name: models
            mountPath: {{ include "model-triton.modelsMountPath" . }}
          - name: scratch
            mountPath: /tmp
          {{- if .Values.loader.hfTokenSecret.name }}
          - name: hf-token
            mountPath: /var/secrets/hf
            readOnly: true
          {{- end }}
          {{- if .Values.loader.gcsCredentialsSecret.name }}
          - name: gcs-credentials
            mountPath: /var/secrets/gcs
            readOnly: true
          {{- end }}
    volumes:
      - name: models
        persistentVolumeClaim:
          claimName: {{ include "model-triton.claimName" . }}
      - name: scratch
        emptyDir:
          sizeLimit: {{ .Values.loader.scratchSizeLimit }}
      {{- with .Values.loader.hfTokenSecret.name }}
      - name: hf-token
        secret:
          secretName: {{ . }}
      {{- end }}
      {{- with .Values.loader.gcsCredentialsSecret.name }}
      - name: gcs-credentials
        secret:
          secretName: {{ . }}
      {{- end }}
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
