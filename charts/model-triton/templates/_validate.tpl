{{/*
model-triton.validate: the cross-field rules values.schema.json cannot express. Every problem is
collected first, then the chart fails once, listing each as `model-triton: <key>` and the fix.
Included by deployment.yaml, so `helm template`, `helm lint` and `helm install` all run it.
*/}}
{{- define "model-triton.validate" -}}
{{- $problems := list -}}
{{- $m := .Values.model -}}
{{- $c := .Values.cluster -}}
{{- $t := .Values.triton -}}

{{- /* The model key's inputs: what the loader refuses, the chart refuses (_modelkey.tpl). */ -}}
{{- $problems = concat $problems (include "model-triton.keyProblems" . | fromJsonArray) -}}

{{- /* GPU arithmetic (the CPU backend requests no GPU). */ -}}
{{- if include "model-triton.gpuBackend" . -}}
{{- $perReplica := include "model-triton.gpusPerReplica" . | int -}}
{{- $perNode := include "model-triton.gpusUsedPerNode" . | int -}}
{{- $gpus := int $c.gpusPerNode -}}
{{- if and (ge $perReplica 1) (gt $perReplica $gpus) -}}
{{- $problems = append $problems (printf "model-triton: model.tensorParallelSize x model.pipelineParallelSize = %d exceeds cluster.gpusPerNode = %d: one replica cannot fit on a node. Lower T or P, or use a node type with more GPUs." $perReplica $gpus) -}}
{{- else if gt $perNode $gpus -}}
{{- $problems = append $problems (printf "model-triton: cluster.replicasPerNode x model.tensorParallelSize x model.pipelineParallelSize = %d x %d = %d exceeds cluster.gpusPerNode = %d. Set cluster.replicasPerNode to at most %d." (int $c.replicasPerNode) $perReplica $perNode $gpus (div $gpus (max $perReplica 1))) -}}
{{- end -}}
{{- end -}}

{{- /* N > 1 per node relies on GPU fit in a pool of its own: a selector that names it. */ -}}
{{- if and (include "model-triton.gpuBackend" .) (gt (int $c.replicasPerNode) 1) (not (include "model-triton.dedicatedPool" .)) -}}
{{- $problems = append $problems (printf "model-triton: cluster.replicasPerNode is %d but neither cluster.nodeSelector nor a required node affinity in cluster.affinity (a nodeSelectorTerm with a matchExpressions or matchFields entry) selects a node pool: N replicas per node are packed by GPU fit on a dedicated pool. Set cluster.nodeSelector to the GPU pool's label (e.g. cloud.google.com/gke-nodepool: <pool>)." (int $c.replicasPerNode)) -}}
{{- end -}}

{{- /* Shutdown: the preStop sleep, then at least 5 s for Triton to drain, within the grace period. */ -}}
{{- if lt (int $t.terminationGracePeriodSeconds) (add (int $t.preStopSleepSeconds) 15) -}}
{{- $problems = append $problems (printf "model-triton: triton.terminationGracePeriodSeconds = %d leaves Triton no time to finish in-flight requests after the preStop sleep of triton.preStopSleepSeconds = %d. Set it to at least %d." (int $t.terminationGracePeriodSeconds) (int $t.preStopSleepSeconds) (add (int $t.preStopSleepSeconds) 15)) -}}
{{- end -}}

{{- /* Autoscaling: between 1 and the replicas the pool holds, nodes x N. */ -}}
{{- $a := .Values.autoscaling -}}
{{- if $a.enabled -}}
{{- $most := include "model-triton.replicas" . | int -}}
{{- if gt (int $a.maxReplicas) $most -}}
{{- $problems = append $problems (printf "model-triton: autoscaling.maxReplicas = %d exceeds cluster.nodes x cluster.replicasPerNode = %d, the replicas the GPU pool holds; lower it or raise cluster.nodes." (int $a.maxReplicas) $most) -}}
{{- end -}}
{{- $max := include "model-triton.maxReplicas" . | int -}}
{{- if gt (int $a.minReplicas) $max -}}
{{- $problems = append $problems (printf "model-triton: autoscaling.minReplicas = %d exceeds the most replicas, %d (autoscaling.maxReplicas, or cluster.nodes x cluster.replicasPerNode when it is 0)." (int $a.minReplicas) $max) -}}
{{- end -}}
{{- end -}}

{{- /* A rolling update that may neither add nor remove a pod never moves. */ -}}
{{- $u := $t.updateStrategy -}}
{{- if and (eq $u.type "RollingUpdate") (eq (toString $u.maxSurge | trimSuffix "%") "0") (eq (toString $u.maxUnavailable | trimSuffix "%") "0") -}}
{{- $problems = append $problems "model-triton: triton.updateStrategy.maxSurge and triton.updateStrategy.maxUnavailable are both 0: the rollout could never replace a pod. Leave maxUnavailable empty (auto) or set it to 1 or more." -}}
{{- end -}}

{{- /* Images: a tag or a digest; the Triton and wait images have no default tag. */ -}}
{{- range $key, $image := dict "triton.image" $t.image "triton.waitForModel.image" $t.waitForModel.image -}}
{{- if and (not $image.digest) (not $image.tag) -}}
{{- $problems = append $problems (printf "model-triton: %s.tag is empty and %s.digest is not set; set the tag as a quoted string (e.g. \"23.05\") or the digest (sha256:...)." $key $key) -}}
{{- end -}}
{{- end -}}

{{- /* Storage: the loader writes while Triton pods read, possibly on several nodes. The access
mode is the value for a created claim; for an existing one, the live claim's (read with lookup
during install and upgrade; `helm template` cannot see it). */ -}}
{{- $p := .Values.modelRepository.persistence -}}
{{- $key := "modelRepository.persistence.accessMode" -}}
{{- $modes := list $p.accessMode -}}
{{- if $p.existingClaim -}}
{{- $key = printf "the accessModes of modelRepository.persistence.existingClaim %q" $p.existingClaim -}}
{{- $modes = list -}}
{{- with lookup "v1" "PersistentVolumeClaim" .Release.Namespace $p.existingClaim -}}
{{- $modes = .spec.accessModes | default list -}}
{{- end -}}
{{- end -}}
{{- if and $modes (not (has "ReadWriteMany" $modes)) -}}
{{- if not (or (has "ReadWriteOnce" $modes) (has "ReadWriteOncePod" $modes)) -}}
{{- $problems = append $problems (printf "model-triton: %s is ReadOnlyMany, but the loader writes the model repository. Use ReadWriteMany (e.g. Filestore, NFS), or ReadWriteOnce on a single node." $key) -}}
{{- else if not (has "ReadWriteOnce" $modes) -}}
{{- $problems = append $problems (printf "model-triton: %s is ReadWriteOncePod, but the loader and every Triton pod mount the volume. Use ReadWriteMany, or ReadWriteOnce on a single node." $key) -}}
{{- else if gt (int $c.nodes) 1 -}}
{{- $problems = append $problems (printf "model-triton: %s is ReadWriteOnce, but cluster.nodes = %d: a ReadWriteOnce volume attaches to one node. Use ReadWriteMany (a storage class such as GKE Filestore standard-rwx)." $key (int $c.nodes)) -}}
{{- end -}}
{{- end -}}

{{- $problems = concat $problems (include "model-triton.numberProblems" . | fromJsonArray) -}}
{{- $problems = concat $problems (include "model-triton.nameProblems" . | fromJsonArray) -}}
{{- $problems = concat $problems (include "model-triton.collisionProblems" . | fromJsonArray) -}}
{{- $problems = concat $problems (include "model-triton.fitProblems" . | fromJsonArray) -}}
{{- $problems = concat $problems (include "model-triton.featureProblems" . | fromJsonArray) -}}
{{- $problems = concat $problems (include "model-triton.workProblems" . | fromJsonArray) -}}
{{- $problems = concat $problems (include "model-triton.securityProblems" . | fromJsonArray) -}}
{{- $problems = concat $problems (include "model-triton.openaiProblems" . | fromJsonArray) -}}
{{- $problems = concat $problems (include "model-triton.liveProblems" . | fromJsonArray) -}}

{{- if $problems -}}
{{- fail (printf "\n%s" (join "\n" $problems)) -}}
{{- end -}}
{{- end -}}

{{/*
model-triton.dedicatedPool: "true" when cluster.nodeSelector is set or cluster.affinity has a
required node affinity whose every nodeSelectorTerm has a requirement (an empty term or an
empty affinity selects every node, so it is no pool).
*/}}
{{- define "model-triton.dedicatedPool" -}}
{{- $terms := dig "nodeAffinity" "requiredDuringSchedulingIgnoredDuringExecution" "nodeSelectorTerms" list (default dict .Values.cluster.affinity) -}}
{{- $selective := gt (len $terms) 0 -}}
{{- range $terms -}}
{{- if not (or (dig "matchExpressions" list .) (dig "matchFields" list .)) -}}
{{- $selective = false -}}
{{- end -}}
{{- end -}}
{{- if or .Values.cluster.nodeSelector $selective -}}true{{- end -}}
{{- end -}}
