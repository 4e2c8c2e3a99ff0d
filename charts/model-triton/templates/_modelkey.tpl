{{/*
_modelkey.tpl: The model key: the contract between the chart and the loader. `loader.repository.key`
builds the same key from the same settings; tests/test_chart.py checks both agree for every
values file.
*/}}

{{/*
model-triton.modelsMountPath: where the model volume is mounted, in the loader AND in Triton.
Absolute paths the loader writes into config files are final paths, so both must agree.
*/}}
{{- define "model-triton.modelsMountPath" -}}
/models
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
model-triton.canonicalSource: the one spelling of model.source the key hashes, as the loader
writes it (`SourceURI.canonical`): `file://` + the cleaned absolute path, `gs://BUCKET[/PREFIX]`
without surrounding slashes, `hf://ORG/NAME[@REV]`.
*/}}
{{- define "model-triton.canonicalSource" -}}
{{- $source := .Values.model.source | toString -}}
{{- $scheme := include "model-triton.sourceScheme" . -}}
{{- $rest := regexReplaceAll "^[^:]*://" $source "" -}}
{{- if eq $scheme "file" -}}
{{- printf "file://%s" (clean (trimPrefix "localhost" $rest)) -}}
{{- else if eq $scheme "gs" -}}
{{- $bucket := first (splitList "/" $rest) -}}
{{- $prefix := trimAll "/" (trimPrefix $bucket $rest) -}}
{{- ternary (printf "gs://%s/%s" $bucket $prefix) (printf "gs://%s" $bucket) (ne $prefix "") -}}
{{- else -}}
{{- $repo := trimAll "/" (first (splitList "@" $rest)) -}}
{{- $rev := trimPrefix (first (splitList "@" $rest)) $rest -}}
{{- printf "%s://%s%s" $scheme $repo $rev -}}
{{- end -}}
{{- end -}}

{{/*
model-triton.modelRevision: the revision part of the model key: model.revision if set; else the
text after the first `@` of an `hf://org/name@rev` source; else `src-` + the first 10 hex digits
of the sha256 of the canonical source (model-triton.canonicalSource).
*/}}
{{- define "model-triton.modelRevision" -}}
{{- $source := .Values.model.source | toString -}}
{{- $repo := trimPrefix "hf://" $source -}}
{{- if .Values.model.revision -}}
{{- .Values.model.revision -}}
{{- else if and (hasPrefix "hf://" $source) (contains "@" $repo) -}}
{{- regexReplaceAll "^[^@]*@" $repo "" -}}
{{- else -}}
{{- printf "src-%s" (include "model-triton.canonicalSource" . | sha256sum | trunc 10) -}}
{{- end -}}
{{- end -}}

{{/*
model-triton.sourcePinned: "true" when the source names immutable content (an `hf://` URI at a
40-hex commit), else empty.
*/}}
{{- define "model-triton.sourcePinned" -}}
{{- $source := .Values.model.source | toString -}}
{{- if regexMatch "^hf://[^@]+@[0-9a-f]{40}$" $source -}}true{{- end -}}
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
