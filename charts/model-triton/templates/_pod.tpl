{{/*
_pod.tpl: What every pod shares: image references.
*/}}

{{/*
model-triton.image: an image reference: repository@digest when a digest is set, else
repository:tag with the tag defaulting to the chart's appVersion; global.imageRegistry, when set,
is prepended to the repository.
Usage: include "model-triton.image" (dict "image" .Values.loader.image "context" $)
*/}}
{{- define "model-triton.image" -}}
{{- $repository := include "model-triton.imageName" . -}}
{{- if .image.digest -}}
{{- printf "%s@%s" $repository .image.digest -}}
{{- else -}}
{{- printf "%s:%s" $repository (default .context.Chart.AppVersion .image.tag | toString) -}}
{{- end -}}
{{- end -}}

{{/*
model-triton.imageName: the image's name without tag or digest, global.imageRegistry first.
Usage: include "model-triton.imageName" (dict "image" .Values.loader.image "context" $)
*/}}
{{- define "model-triton.imageName" -}}
{{- $repository := toString .image.repository -}}
{{- with .context.Values.global.imageRegistry -}}
{{- $repository = printf "%s/%s" (trimSuffix "/" .) $repository -}}
{{- end -}}
{{- $repository -}}
{{- end -}}

{{/*
model-triton.imagePullSecrets: the pod's `imagePullSecrets` field from the top-level
`imagePullSecrets` (names, or `{name: ...}` maps as in a pod spec), shared by the Triton, loader and test pods; empty when none.
*/}}
{{- define "model-triton.imagePullSecrets" -}}
{{- with .Values.imagePullSecrets -}}
imagePullSecrets:
{{- range . }}
  - name: {{ if kindIs "map" . }}{{ .name }}{{ else }}{{ . }}{{ end }}
{{- end }}
{{- end -}}
{{- end -}}

{{/*
model-triton.intOrPercent: an int-or-string value as YAML: a percentage as a quoted string, a
number as an integer (Helm 4 reads a values file's numbers as floats, which print as
2.147483647e+09; Helm 3 as json.Number, a string kind).
*/}}
{{- define "model-triton.intOrPercent" -}}
{{- if hasSuffix "%" (toString .) -}}{{ . | quote }}{{- else -}}{{ int64 . }}{{- end -}}
{{- end -}}
