{{/*
_names.tpl: Resource names and labels: the name prefix, the loader's name, the standard
labels and selector labels, the ServiceAccount and the claim.
*/}}

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
model-triton.labels: the full label set of a resource: commonLabels, then the selector labels,
version, chart and manager, which win over a commonLabels key of the same name (a selector that
no longer matches its pods, or a duplicate key, is never rendered).
Usage: include "model-triton.labels" (dict "context" $ "component" "triton")
*/}}
{{- define "model-triton.labels" -}}
{{- $labels := deepCopy (default dict .context.Values.commonLabels) -}}
{{- $standard := include "model-triton.selectorLabels" . | fromYaml -}}
{{- $_ := set $standard "helm.sh/chart" (include "model-triton.chart" .context) -}}
{{- $_ := set $standard "app.kubernetes.io/version" (.context.Chart.AppVersion | toString) -}}
{{- $_ := set $standard "app.kubernetes.io/managed-by" .context.Release.Service -}}
{{- $_ := set $standard "app.kubernetes.io/part-of" "model-triton" -}}
{{- toYaml (merge $standard $labels) -}}
{{- end -}}

{{/*
model-triton.suffixedName: the full name with a suffix, the full name shortened so that the
whole stays within 63 characters (a DNS label: Service, PVC, Pod and Job names).
Usage: include "model-triton.suffixedName" (dict "context" $ "suffix" "-headless")
*/}}
{{- define "model-triton.suffixedName" -}}
{{- $base := include "model-triton.fullname" .context | trunc (sub 63 (len .suffix) | int) | trimSuffix "-" -}}
{{- printf "%s%s" $base .suffix -}}
{{- end -}}

{{/*
model-triton.serviceAccountName: the ServiceAccount of the Triton and `helm test` pods (no
storage identity: they only read the mounted volume).
*/}}
{{- define "model-triton.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "model-triton.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/*
model-triton.loaderServiceAccountName: the loader's own ServiceAccount, the only one that carries
a storage identity (GKE Workload Identity for gs:// sources).
*/}}
{{- define "model-triton.loaderServiceAccountName" -}}
{{- if .Values.loader.serviceAccount.create -}}
{{- default (include "model-triton.suffixedName" (dict "context" . "suffix" "-loader")) .Values.loader.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.loader.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/*
model-triton.claimName: the PVC holding the model repositories.
*/}}
{{- define "model-triton.claimName" -}}
{{- default (include "model-triton.suffixedName" (dict "context" . "suffix" "-models")) .Values.modelRepository.persistence.existingClaim -}}
{{- end -}}
