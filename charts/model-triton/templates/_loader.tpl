{{/*
_loader.tpl: The loader Job: its `model-loader run` arguments and the Job spec shared by the CronJob
and the hook Job.
*/}}

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
{{- if .Values.model.followSource }}
- --follow-source
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
{{- if .Values.loader.prune.enabled }}
- --prune-keep
- {{ int .Values.loader.prune.keep | quote }}
{{- end }}
{{- end -}}

{{/*
model-triton.loaderJobSpec: the Job spec of the loader, shared by the CronJob's jobTemplate and
the hook Job.
*/}}
{{- define "model-triton.loaderJobSpec" -}}
backoffLimit: {{ int .Values.loader.backoffLimit }}
activeDeadlineSeconds: {{ int .Values.loader.activeDeadlineSeconds }}
ttlSecondsAfterFinished: {{ int .Values.loader.ttlSecondsAfterFinished }}
# The loader's exit codes (README, "Source changes, pruning and exit codes"): a disrupted pod is
# not counted, 75 (transient) and 143 (SIGTERM) are retried up to backoffLimit, anything else
# (2: bad input, 1: a bug) fails the Job at once.
podFailurePolicy:
  rules:
    - action: Ignore
      onPodConditions:
        - type: DisruptionTarget
          status: "True"
    - action: FailJob
      onExitCodes:
        containerName: loader
        operator: NotIn
        values: [75, 143]
template:
  metadata:
    labels:
      {{- include "model-triton.labels" (dict "context" . "component" "loader") | nindent 6 }}
    annotations:
      model-triton/model-key: {{ include "model-triton.modelKey" . | quote }}
  spec:
    restartPolicy: Never
    terminationGracePeriodSeconds: {{ int .Values.loader.terminationGracePeriodSeconds }}
    serviceAccountName: {{ include "model-triton.loaderServiceAccountName" . }}
    automountServiceAccountToken: false
    {{- with include "model-triton.imagePullSecrets" . }}
    {{- . | nindent 4 }}
    {{- end }}
    securityContext:
      {{- toYaml .Values.podSecurityContext | nindent 6 }}
    {{- include "model-triton.loaderPlacement" . | nindent 4 }}
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
          - name: HF_TOKEN_FILE
            value: /var/secrets/hf/token
          {{- end }}
          {{- if .Values.loader.gcsCredentialsSecret.name }}
          - name: GOOGLE_APPLICATION_CREDENTIALS
            value: /var/secrets/gcs/key.json
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
      {{- /* items: a Secret without that key fails the mount, not the download (anonymous). */}}
      {{- with .Values.loader.hfTokenSecret }}
      {{- if .name }}
      - name: hf-token
        secret:
          secretName: {{ .name }}
          items:
            - key: {{ .key }}
              path: token
      {{- end }}
      {{- end }}
      {{- with .Values.loader.gcsCredentialsSecret }}
      {{- if .name }}
      - name: gcs-credentials
        secret:
          secretName: {{ .name }}
          items:
            - key: {{ .key }}
              path: key.json
      {{- end }}
      {{- end }}
{{- end -}}


{{/*
model-triton.volumeIsOneNode: "true" when the model volume attaches to one node only: a created
claim with accessMode ReadWriteOnce, or an existing claim whose live accessModes (read with
`lookup` on install and upgrade) have ReadWriteOnce and not ReadWriteMany.
*/}}
{{- define "model-triton.volumeIsOneNode" -}}
{{- $p := .Values.modelRepository.persistence -}}
{{- $modes := list $p.accessMode -}}
{{- if $p.existingClaim -}}
{{- $modes = list -}}
{{- with lookup "v1" "PersistentVolumeClaim" .Release.Namespace $p.existingClaim -}}
{{- $modes = .spec.accessModes | default list -}}
{{- end -}}
{{- end -}}
{{- if and (has "ReadWriteOnce" $modes) (not (has "ReadWriteMany" $modes)) -}}true{{- end -}}
{{- end -}}

{{/*
model-triton.loaderPlacement: the loader pod's nodeSelector, tolerations and affinity: the
loader.* values; on a one-node volume (model-triton.volumeIsOneNode), where a loader value is
empty, the Triton pods' (so the loader may run on their tainted GPU node) and a preference for
the node of a Triton pod (where the volume is attached).
*/}}
{{- define "model-triton.loaderPlacement" -}}
{{- $l := .Values.loader -}}
{{- $c := .Values.cluster -}}
{{- $oneNode := include "model-triton.volumeIsOneNode" . -}}
{{- $selector := $l.nodeSelector -}}
{{- $tolerations := $l.tolerations -}}
{{- $affinity := $l.affinity -}}
{{- if $oneNode -}}
{{- $selector = default $c.nodeSelector $selector -}}
{{- $tolerations = default $c.tolerations $tolerations -}}
{{- if not $affinity -}}
{{- $affinity = dict "podAffinity" (dict "preferredDuringSchedulingIgnoredDuringExecution" (list (dict "weight" 100 "podAffinityTerm" (dict "topologyKey" "kubernetes.io/hostname" "labelSelector" (dict "matchLabels" (include "model-triton.selectorLabels" (dict "context" . "component" "triton") | fromYaml)))))) -}}
{{- with (default dict $c.affinity).nodeAffinity -}}
{{- $_ := set $affinity "nodeAffinity" . -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- with $selector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/*
model-triton.loaderNetworkPolicySpec: the spec of the loader's NetworkPolicy
(loader-networkpolicy.yaml; loader-hook-networkpolicy.yaml for the hook Job).
*/}}
{{- define "model-triton.loaderNetworkPolicySpec" -}}
{{- $np := .Values.networkPolicy.loader -}}
{{- $scheme := include "model-triton.sourceScheme" . -}}
{{- $remote := has $scheme (list "gs" "hf") -}}
{{- $v4 := list -}}
{{- $v6 := list -}}
{{- range $np.exceptCIDRs -}}
{{- if contains ":" . -}}
{{- $v6 = append $v6 . -}}
{{- else -}}
{{- $v4 = append $v4 . -}}
{{- end -}}
{{- end -}}
podSelector:
  matchLabels:
    {{- include "model-triton.selectorLabels" (dict "context" . "component" "loader") | nindent 4 }}
policyTypes:
  - Ingress
  - Egress
{{- if or $remote $np.extraEgress }}
egress:
  {{- if $remote }}
  - ports:
      - port: 53
        protocol: UDP
      - port: 53
        protocol: TCP
  - to:
      - ipBlock:
          cidr: 0.0.0.0/0
          {{- with $v4 }}
          except:
            {{- toYaml . | nindent 12 }}
          {{- end }}
      - ipBlock:
          cidr: ::/0
          {{- with $v6 }}
          except:
            {{- toYaml . | nindent 12 }}
          {{- end }}
    ports:
      - port: 443
        protocol: TCP
  {{- if and (eq $scheme "gs") (not .Values.loader.gcsCredentialsSecret.name) }}
  # The GKE metadata server answers Workload Identity token requests on 169.254.169.254:80,
  # served by 169.254.169.252:988.
  - to:
      - ipBlock:
          cidr: 169.254.169.254/32
    ports:
      - port: 80
        protocol: TCP
  - to:
      - ipBlock:
          cidr: 169.254.169.252/32
    ports:
      - port: 988
        protocol: TCP
  {{- end }}
  {{- end }}
  {{- with $np.extraEgress }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end }}
{{- end -}}

{{/*
model-triton.loaderHookEvents: the Helm hook events of the loader Job (and of its NetworkPolicy).
At install, pre-install when the claim and the loader's ServiceAccount exist beforehand (nothing
holds a GPU yet), post-install otherwise, after the chart has created them. pre-upgrade only
when both exist already (read with lookup): an upgrade that creates them (a claim or
ServiceAccount the chart creates from now on) does so after its pre-upgrade hooks, and the Job
could not start before Helm's --timeout; post-upgrade then. pre-rollback: `helm rollback` runs
the hooks of the revision it returns to, so a key pruned since is loaded again first.
*/}}
{{- define "model-triton.loaderHookEvents" -}}
{{- $existing := and (ne .Values.modelRepository.persistence.existingClaim "") (not .Values.loader.serviceAccount.create) -}}
{{- $upgrade := "pre-upgrade" -}}
{{- if .Release.IsUpgrade -}}
{{- $account := lookup "v1" "ServiceAccount" .Release.Namespace (include "model-triton.loaderServiceAccountName" .) -}}
{{- $claim := lookup "v1" "PersistentVolumeClaim" .Release.Namespace (include "model-triton.claimName" .) -}}
{{- if not (and $account $claim) -}}
{{- $upgrade = "post-upgrade" -}}
{{- end -}}
{{- end -}}
{{- printf "%s,%s,pre-rollback" (ternary "pre-install" "post-install" $existing) $upgrade -}}
{{- end -}}
