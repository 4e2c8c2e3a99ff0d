{{/*
_live.tpl: What `helm install` and `helm upgrade` read from the live release (`lookup`; empty for
`helm template` and `--dry-run=client`), only to refuse a change Kubernetes cannot apply in
place before Helm applies any of it. Nothing rendered comes from here: a rollback re-applies
a stored manifest, which must hold whatever the cluster held when it was rendered (a claim
field read from the cluster in one revision and not in another makes Helm 3's rollback patch
an immutable field).
*/}}

{{/*
model-triton.liveClaim: the live PersistentVolumeClaim the chart creates (no existingClaim), as
JSON; `{}` when there is none or nothing can be read.
*/}}
{{- define "model-triton.liveClaim" -}}
{{- $live := dict -}}
{{- if not .Values.modelRepository.persistence.existingClaim -}}
{{- $live = lookup "v1" "PersistentVolumeClaim" .Release.Namespace (include "model-triton.claimName" .) | default dict -}}
{{- end -}}
{{- toJson $live -}}
{{- end -}}

{{/*
model-triton.liveProblems: changes of a live release that would half-apply or lose the models.
- The claim's storage class and access mode are immutable: Helm would update the Deployment
  and the CronJob to the new key, then fail on the claim.
- A claim does not shrink.
- New resource names (nameOverride, fullnameOverride) on a live release: Helm would delete the
  Deployment, every replica, and create an empty claim next to the one holding the models.
- A created claim given up for existingClaim with keep: false: Helm would delete it, models and all.
*/}}
{{- define "model-triton.liveProblems" -}}
{{- $problems := list -}}
{{- $p := .Values.modelRepository.persistence -}}
{{- $claim := include "model-triton.claimName" . -}}
{{- $live := include "model-triton.liveClaim" . | fromJson -}}
{{- if $live -}}
{{- $spec := default dict $live.spec -}}
{{- $class := toString (default "" $spec.storageClassName) -}}
{{- if and $p.storageClass (ne (ternary "" $p.storageClass (eq $p.storageClass "-")) $class) -}}
{{- $problems = append $problems (printf "model-triton: modelRepository.persistence.storageClass is %q, but the claim %s holding the models has the class %q, which Kubernetes cannot change on a claim (Helm would move the Deployment and the CronJob, then fail on the claim). Keep storageClass %q; to move the models to another class, create a claim of that class, copy them, and set modelRepository.persistence.existingClaim to it (docs/operations.md)." (toString $p.storageClass) $claim $class (ternary "-" $class (eq $class "")) ) -}}
{{- end -}}
{{- $modes := default list $spec.accessModes -}}
{{- if and $modes (not (has $p.accessMode $modes)) -}}
{{- $problems = append $problems (printf "model-triton: modelRepository.persistence.accessMode is %s, but the claim %s holding the models has %s, which Kubernetes cannot change on a claim. Keep accessMode %s, or move the models to a new claim and set modelRepository.persistence.existingClaim to it (docs/operations.md)." $p.accessMode $claim (join ", " $modes) (first $modes)) -}}
{{- end -}}
{{- $size := include "model-triton.quantity" $p.size -}}
{{- $liveSize := include "model-triton.quantity" (dig "resources" "requests" "storage" "" $spec) -}}
{{- if and $size $liveSize (include "model-triton.exceeds" (dict "a" $liveSize "b" $size)) -}}
{{- $problems = append $problems (printf "model-triton: modelRepository.persistence.size is %v, less than the %v the claim %s holding the models has: a claim never shrinks. Keep size %v or more." $p.size (dig "resources" "requests" "storage" "" $spec) $claim (dig "resources" "requests" "storage" "" $spec)) -}}
{{- end -}}
{{- end -}}
{{- if .Release.IsUpgrade -}}
{{- $fullname := include "model-triton.fullname" . -}}
{{- range (lookup "apps/v1" "Deployment" .Release.Namespace "" | default dict).items -}}
{{- $meta := .metadata -}}
{{- $annotations := default dict $meta.annotations -}}
{{- $labels := default dict $meta.labels -}}
{{- if and (eq (get $annotations "meta.helm.sh/release-name") $.Release.Name) (eq (get $labels "app.kubernetes.io/component") "triton") (eq (get $labels "app.kubernetes.io/part-of") "model-triton") (ne $meta.name $fullname) -}}
{{- $problems = append $problems (printf "model-triton: this upgrade renames the release's resources from %q to %q (nameOverride %q, fullnameOverride %q): Helm would delete the Deployment %s, every replica, and serve from a new, empty claim while the one holding the models stays behind. Keep the names as they were; to rename, install a second release with modelRepository.persistence.existingClaim set to this one's claim, move the clients, then uninstall this one (docs/operations.md)." $meta.name $fullname (toString $.Values.nameOverride) (toString $.Values.fullnameOverride) $meta.name) -}}
{{- end -}}
{{- end -}}
{{- if and $p.existingClaim (not $p.keep) -}}
{{- $own := include "model-triton.suffixedName" (dict "context" . "suffix" "-models") -}}
{{- with lookup "v1" "PersistentVolumeClaim" .Release.Namespace $own -}}
{{- if and (ne $own $p.existingClaim) (eq (get (default dict .metadata.annotations) "meta.helm.sh/release-name") $.Release.Name) (ne (get (default dict .metadata.annotations) "helm.sh/resource-policy") "keep") -}}
{{- $problems = append $problems (printf "model-triton: modelRepository.persistence.existingClaim is now %q: Helm would delete this release's own claim %s and the models on it (modelRepository.persistence.keep is false). Set keep: true for this upgrade (the claim then stays, outside the release), or move the models first." $p.existingClaim $own) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- toJson $problems -}}
{{- end -}}
