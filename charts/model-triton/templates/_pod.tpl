{{/*
_pod.tpl: What every pod shares: image references.
*/}}

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
model-triton.imagePullSecrets: the pod's `imagePullSecrets` field from the top-level
`imagePullSecrets` (names), shared by the Triton, loader and test pods; empty when none.
*/}}
{{- define "model-triton.imagePullSecrets" -}}
{{- with .Values.imagePullSecrets -}}
imagePullSecrets:
{{- range . }}
  - name: {{ . }}
{{- end }}
{{- end -}}
{{- end -}}
