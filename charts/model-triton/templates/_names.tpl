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
pass to `kubectl create job --from=cronjob/...`; past 52 characters, a CronJob's most, shortened
with a hash: NOTES prints it) and of the hook Job.
*/}}
{{- define "model-triton.loaderName" -}}
{{- include "model-triton.shortName" (dict "name" (printf "%s-model-loader" .Release.Name) "max" 52) -}}
{{- end -}}

{{/*
model-triton.shortName: `name` when it has at most `max` characters, else its first max - 9
characters, `-` and 8 hex digits of its sha256: two long names that differ only past the cut
stay apart (a plain truncation gave two releases one test pod, one CronJob).
Usage: include "model-triton.shortName" (dict "name" $name "max" 63)
*/}}
{{- define "model-triton.shortName" -}}
{{- if le (len .name) (int .max) -}}
{{- .name -}}
{{- else -}}
{{- printf "%s-%s" (.name | trunc (sub (int .max) 9 | int) | trimSuffix "-") (sha256sum .name | trunc 8) -}}
{{- end -}}
{{- end -}}

{{/*
model-triton.monitoringName: the name of the ServiceMonitor or PrometheusRule in `namespace`:
the full name in the release's namespace; in another (a shared monitoring namespace) the full
name and the release's namespace, so the same release name in two namespaces does not collide.
Usage: include "model-triton.monitoringName" (dict "context" $ "namespace" $ns)
*/}}
{{- define "model-triton.monitoringName" -}}
{{- $fullname := include "model-triton.fullname" .context -}}
{{- if or (not .namespace) (eq .namespace .context.Release.Namespace) -}}
{{- $fullname -}}
{{- else -}}
{{- include "model-triton.shortName" (dict "name" (printf "%s-%s" $fullname .context.Release.Namespace) "max" 63) -}}
{{- end -}}
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
app.kubernetes.io/name: {{ include "model-triton.name" .context | quote }}
app.kubernetes.io/instance: {{ .context.Release.Name | quote }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/*
model-triton.labels: the full label set of a resource as one map: commonLabels, then `extra` (a
resource's own labels value, e.g. metrics.serviceMonitor.labels), then the selector labels,
version, chart and manager (which no user map may name: _rules.tpl refuses it).
Usage: include "model-triton.labels" (dict "context" $ "component" "triton" ["extra" $map])
*/}}
{{- define "model-triton.labels" -}}
{{- $labels := merge (deepCopy (default dict .extra)) (deepCopy (default dict .context.Values.commonLabels)) -}}
{{- $standard := include "model-triton.selectorLabels" . | fromYaml -}}
{{- $_ := set $standard "helm.sh/chart" (include "model-triton.chart" .context) -}}
{{- $_ := set $standard "app.kubernetes.io/version" (.context.Chart.AppVersion | toString) -}}
{{- $_ := set $standard "app.kubernetes.io/managed-by" .context.Release.Service -}}
{{- $_ := set $standard "app.kubernetes.io/part-of" "model-triton" -}}
{{- toYaml (merge $standard $labels) -}}
{{- end -}}

{{/*
model-triton.podNamePattern: a regular expression (RE2, as PromQL's =~ takes it, anchored) that
matches exactly the names of this Deployment's pods: <deployment>-<pod-template-hash>-<5
characters>, both drawn from Kubernetes' safe alphabet (no vowels, no 0, 1, 3). Another release
whose name starts with this one's has one more `-` part and does not match. Exact while the
full name has at most 46 characters (longer ones are shortened in pod names: _rules.tpl refuses
them where the pattern is used).
*/}}
{{- define "model-triton.podNamePattern" -}}
{{- printf "%s-[bcdfghjklmnpqrstvwxz2456789]{1,10}-[bcdfghjklmnpqrstvwxz2456789]{5}" (include "model-triton.fullname" .) -}}
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
