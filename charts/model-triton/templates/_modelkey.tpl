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
model-triton.sourceScheme: the scheme of model.source in lower case (`gs`, `hf`, `file`), "path"
for an absolute path without a scheme, empty for anything else (a relative path, a scheme that
is not ASCII letters). The loader lower-cases only ASCII letters' worth of scheme the same way.
*/}}
{{- define "model-triton.sourceScheme" -}}
{{- $source := .Values.model.source | toString -}}
{{- if contains "://" $source -}}
{{- $scheme := first (splitList "://" $source) -}}
{{- if regexMatch "^[A-Za-z]+$" $scheme }}{{ lower $scheme }}{{ end -}}
{{- else if hasPrefix "/" $source -}}
path
{{- end -}}
{{- end -}}

{{/*
model-triton.sourceProblems: what is wrong with model.source (a JSON list, empty when nothing),
the same refusals as the loader's `loader.repository.key.check_source`: a control character, a
scheme other than gs, hf, file (or an absolute path), a gs:// URI without a bucket, an hf:// URI
without ORG/NAME or with an empty `@`, a file:// URI that is not a plain absolute path.
*/}}
{{- define "model-triton.sourceProblems" -}}
{{- $source := .Values.model.source | toString -}}
{{- $scheme := include "model-triton.sourceScheme" . -}}
{{- $rest := regexReplaceAll "^[^:]*://" $source "" -}}
{{- $problems := list -}}
{{- $hint := "use gs://BUCKET/PREFIX, hf://ORG/NAME[@REVISION], file:///ABSOLUTE/PATH or an absolute path." -}}
{{- if regexMatch "[\\x00-\\x1f\\x7f]" $source -}}
{{- $problems = append $problems (printf "model-triton: model.source %q contains a control character; write it without tabs or newlines." $source) -}}
{{- else if not (has $scheme (list "gs" "hf" "file" "path")) -}}
{{- $problems = append $problems (printf "model-triton: model.source %q is not a source the loader fetches in a pod (a relative path or another scheme); %s" $source $hint) -}}
{{- else if and (eq $scheme "gs") (eq (first (splitList "/" $rest)) "") -}}
{{- $problems = append $problems (printf "model-triton: model.source %q names no bucket; %s" $source $hint) -}}
{{- else if eq $scheme "hf" -}}
{{- $repo := trimAll "/" (first (splitList "@" $rest)) -}}
{{- $parts := splitList "/" $repo -}}
{{- if or (gt (len $parts) 2) (has "" $parts) -}}
{{- $problems = append $problems (printf "model-triton: model.source %q does not name a Hugging Face repository; write hf://ORG/NAME or hf://ORG/NAME@REVISION." $source) -}}
{{- else if and (contains "@" $rest) (eq (include "model-triton.sourceRevision" .) "") -}}
{{- $problems = append $problems (printf "model-triton: model.source %q has an empty revision after '@'; write the revision after '@' or drop the '@'." $source) -}}
{{- end -}}
{{- else if and (eq $scheme "file") (not (regexMatch "^(localhost)?/[^%?#]*$" $rest)) -}}
{{- $problems = append $problems (printf "model-triton: model.source %q is not a plain absolute path; write file:///ABSOLUTE/PATH as it is on disk (no %%-escapes, '?' or '#'), without a host." $source) -}}
{{- else if and (has $scheme (list "file" "path")) (hasPrefix (printf "%s/" (trimSuffix "/" (clean (regexReplaceAll "^localhost" $rest "")))) (printf "%s/" (include "model-triton.modelsMountPath" .))) -}}
{{- $problems = append $problems (printf "model-triton: model.source %q holds the model volume (%s), where the loader publishes: what it writes there would become part of the source, which every later run would find changed; point model.source at the checkpoint's own directory." $source (include "model-triton.modelsMountPath" .)) -}}
{{- end -}}
{{- toJson $problems -}}
{{- end -}}

{{/*
model-triton.canonicalSource: the one spelling of model.source the key hashes, as the loader
writes it (`SourceURI.canonical`): `file://` + the cleaned absolute path (for an absolute path
too), `gs://BUCKET[/PREFIX]` without surrounding slashes, `hf://ORG/NAME[@REV]`. Only for a
source model-triton.sourceProblems accepts.
*/}}
{{- define "model-triton.canonicalSource" -}}
{{- $source := .Values.model.source | toString -}}
{{- $scheme := include "model-triton.sourceScheme" . -}}
{{- $rest := regexReplaceAll "^[^:]*://" $source "" -}}
{{- if eq $scheme "path" -}}
{{- printf "file://%s" (clean $source) -}}
{{- else if eq $scheme "file" -}}
{{- printf "file://%s" (clean (regexReplaceAll "^localhost" $rest "")) -}}
{{- else if eq $scheme "gs" -}}
{{- $bucket := first (splitList "/" $rest) -}}
{{- $prefix := trimAll "/" (trimPrefix $bucket $rest) -}}
{{- ternary (printf "gs://%s/%s" $bucket $prefix) (printf "gs://%s" $bucket) (ne $prefix "") -}}
{{- else -}}
{{- $repo := trimAll "/" (first (splitList "@" $rest)) -}}
{{- $rev := include "model-triton.sourceRevision" . -}}
{{- printf "hf://%s%s" $repo (ternary (printf "@%s" $rev) "" (ne $rev "")) -}}
{{- end -}}
{{- end -}}

{{/*
model-triton.sourceRevision: the revision written in an `hf://ORG/NAME@REV` source (everything
after the first `@`), empty for other sources.
*/}}
{{- define "model-triton.sourceRevision" -}}
{{- $source := .Values.model.source | toString -}}
{{- if eq (include "model-triton.sourceScheme" .) "hf" -}}
{{- $rest := regexReplaceAll "^[^:]*://" $source "" -}}
{{- if contains "@" $rest -}}
{{- trimPrefix (printf "%s@" (first (splitList "@" $rest))) $rest -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
model-triton.modelRevision: the revision part of the model key: model.revision if set; else the
revision of an `hf://org/name@rev` source; else `src-` + the first 10 hex digits of the sha256
of the canonical source (model-triton.canonicalSource).
*/}}
{{- define "model-triton.modelRevision" -}}
{{- $uriRevision := include "model-triton.sourceRevision" . -}}
{{- if .Values.model.revision -}}
{{- .Values.model.revision -}}
{{- else if $uriRevision -}}
{{- $uriRevision -}}
{{- else -}}
{{- printf "src-%s" (include "model-triton.canonicalSource" . | sha256sum | trunc 10) -}}
{{- end -}}
{{- end -}}

{{/*
model-triton.keyProblems: every reason the loader would refuse this key's inputs (a JSON list,
empty when none): the source (model-triton.sourceProblems), the model name and the revision
(the loader's NAME_PATTERN, REVISION_PATTERN, MAX_PART_BYTES and reserved names), T, P, I >= 1
and preferred batch sizes within maxBatchSize. model-triton.validate fails with them.
*/}}
{{- define "model-triton.keyProblems" -}}
{{- $m := .Values.model -}}
{{- $t := .Values.triton -}}
{{- $problems := include "model-triton.sourceProblems" . | fromJsonArray -}}
{{- $name := $m.name | toString -}}
{{- $maxPart := 64 -}}
{{- if not (regexMatch "^[A-Za-z0-9][A-Za-z0-9._-]*$" $name) -}}
{{- $problems = append $problems (printf "model-triton: model.name %q is not usable as a Triton model and directory name; use letters, digits, '.', '_' and '-', starting with a letter or digit." $name) -}}
{{- else if gt (len $name) $maxPart -}}
{{- $problems = append $problems (printf "model-triton: model.name is %d characters long; at most %d fit in the model key's file names." (len $name) $maxPart) -}}
{{- else if has $name (list "preprocessing" "fastertransformer" "postprocessing" "llm") -}}
{{- $problems = append $problems (printf "model-triton: model.name %q clashes with a model the repository holds; choose another name." $name) -}}
{{- end -}}
{{- if not $problems -}}
{{- $revision := include "model-triton.modelRevision" . -}}
{{- $from := ternary "model.revision" "the @revision of model.source" (ne (toString (default "" $m.revision)) "") -}}
{{- if not (regexMatch "^[A-Za-z0-9][A-Za-z0-9._-]*$" $revision) -}}
{{- $problems = append $problems (printf "model-triton: %s %q cannot name a directory; use a commit hash or tag of letters, digits, '.', '_' and '-'." $from $revision) -}}
{{- else if gt (len $revision) $maxPart -}}
{{- $problems = append $problems (printf "model-triton: %s is %d characters long; at most %d fit in the model key's file names (a commit id has 40)." $from (len $revision) $maxPart) -}}
{{- end -}}
{{- end -}}
{{- if lt (int $m.tensorParallelSize) 1 -}}
{{- $problems = append $problems (printf "model-triton: model.tensorParallelSize is %v; set it to 1 or more (the number of GPUs one copy of the weights is split across)." $m.tensorParallelSize) -}}
{{- end -}}
{{- if lt (int $m.pipelineParallelSize) 1 -}}
{{- $problems = append $problems (printf "model-triton: model.pipelineParallelSize is %v; set it to 1 or more (1 = no pipeline parallelism)." $m.pipelineParallelSize) -}}
{{- end -}}
{{- if lt (int $t.instanceCount) 1 -}}
{{- $problems = append $problems (printf "model-triton: triton.instanceCount is %v; set it to 1 or more (model instances per Triton replica)." $t.instanceCount) -}}
{{- end -}}
{{- if $t.dynamicBatching.enabled -}}
{{- range $t.dynamicBatching.preferredBatchSize -}}
{{- if gt (int .) (int $t.maxBatchSize) -}}
{{- $problems = append $problems (printf "model-triton: triton.dynamicBatching.preferredBatchSize contains %d, more than triton.maxBatchSize = %d; remove it or raise triton.maxBatchSize." (int .) (int $t.maxBatchSize)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- toJson $problems -}}
{{- end -}}

{{/*
model-triton.sourcePinned: "true" when the source names immutable content (an `hf://` URI at a
40-hex commit), else empty.
*/}}
{{- define "model-triton.sourcePinned" -}}
{{- if and (eq (include "model-triton.sourceScheme" .) "hf") (regexMatch "^[0-9a-f]{40}$" (include "model-triton.sourceRevision" .)) -}}true{{- end -}}
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
