{{/*
_quantity.tpl: Resource quantities as numbers, for the rules that add and compare them (requests
x N within a node's allocatable, limits not below requests). The schema admits only the forms
parsed here: a number with an optional unit (Ki..Ei, m, k..E), no sign and no exponent.
*/}}

{{/*
model-triton.quantity: a quantity (string or number) as a float (cores, bytes); empty for none
or for a string that is not one.
Compare with model-triton.lessThan: float64 holds these exactly enough (1 part in 10^15).
*/}}
{{- define "model-triton.quantity" -}}
{{- if and (kindIs "string" .) (not (regexMatch "^([0-9]+(\\.[0-9]+)?|\\.[0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E)?$" .)) -}}
{{- /* Not a quantity (`32GB`): empty, and the rule that reads the key says so. */ -}}
{{- else if kindIs "string" . -}}
{{- $unit := regexFind "(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E)$" . -}}
{{- $scale := dict "" 1.0 "m" 0.001 "k" 1e3 "M" 1e6 "G" 1e9 "T" 1e12 "P" 1e15 "E" 1e18 "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 "Pi" 1125899906842624.0 "Ei" 1152921504606846976.0 -}}
{{- mulf (float64 (trimSuffix $unit .)) (get $scale $unit) -}}
{{- else if not (kindIs "invalid" .) -}}
{{- float64 . -}}
{{- end -}}
{{- end -}}

{{/*
model-triton.exceeds: "true" when .a exceeds .b beyond float rounding (both from
model-triton.quantity).
Usage: include "model-triton.exceeds" (dict "a" $need "b" $have)
*/}}
{{- define "model-triton.exceeds" -}}
{{- if gt (float64 .a) (mulf (float64 .b) 1.000000000001) -}}true{{- end -}}
{{- end -}}

{{/*
model-triton.podRequest: the request of one resource by a pod: the larger of its containers'
sum and its largest init container (what the scheduler counts), a container's limit standing in
for a missing request (as the API server defaults it). A float, 0 when nothing asks for it.
Usage: include "model-triton.podRequest" (dict "containers" (list $res...) "init" (list $res...) "name" "cpu")
*/}}
{{- define "model-triton.podRequest" -}}
{{- $name := .name -}}
{{- $sum := 0.0 -}}
{{- range .containers -}}
{{- $q := include "model-triton.quantity" (dig "requests" $name (dig "limits" $name nil .) .) -}}
{{- $sum = addf $sum (float64 (default "0" $q)) -}}
{{- end -}}
{{- $init := 0.0 -}}
{{- range .init -}}
{{- $q := include "model-triton.quantity" (dig "requests" $name (dig "limits" $name nil .) .) -}}
{{- $init = maxf $init (float64 (default "0" $q)) -}}
{{- end -}}
{{- maxf $sum $init -}}
{{- end -}}
