{{/*
_security.tpl: What Triton 23.05 serves and to whom (SECURITY.md): the HTTP mode, the gRPC
protocols behind the admin header and the Secret holding its token, the NetworkPolicy client
label, the values that would undo them (refused), and the NOTES lines for a release that loosens
them.

Facts from the r23.05 server sources (triton-inference-server/server, branch r23.05):
- `src/command_line_parser.cc` (TritonParser::Parse, OPTION_GRPC_RESTRICTED_PROTOCOL and
  ParseGrpcRestrictedProtocolOption): `--grpc-restricted-protocol=<p1>,<p2>:<key>=<value>`; the
  text before the first `:` is the comma-separated protocols, the key runs to the next `=`, the
  value is the rest. The help text says `<protocols>,<key>=<value>`; the parser splits on `:`.
- `src/grpc/grpc_server.cc` (Server::Server, CommonHandler::Register*): the protocol names are
  health, metadata, inference, shared-memory, model-config, model-repository, statistics, trace
  and logging; the header is `triton-grpc-protocol-<key>` (kRestrictedProtocolHeaderTemplate,
  src/grpc/grpc_server.h); a call without it answers UNAVAILABLE "This protocol is restricted".
  23.05 ignores a name it does not know (later releases refuse it), so the schema lists them.
- HTTP (`src/http_server.cc`, HTTPAPIServer::Handle) has no restriction switch in 23.05
  (`--http-restricted-api` came later): `/v2/logging`, `/v2/trace/setting`, shared memory and
  the repository answer whoever reaches the port, hence `triton.security.http`.
*/}}

{{/*
model-triton.adminTokenEnv: the Triton container's environment variable holding the admin token;
Kubernetes substitutes `$(NAME)` in the command from it.
*/}}
{{- define "model-triton.adminTokenEnv" -}}
TRITON_ADMIN_TOKEN
{{- end -}}

{{/*
model-triton.adminSecretName: triton.security.adminSecret.name, or the Secret the chart creates.
*/}}
{{- define "model-triton.adminSecretName" -}}
{{- default (include "model-triton.suffixedName" (dict "context" . "suffix" "-admin")) .Values.triton.security.adminSecret.name -}}
{{- end -}}

{{/*
model-triton.adminHeader: the full gRPC metadata key admin calls carry.
*/}}
{{- define "model-triton.adminHeader" -}}
triton-grpc-protocol-{{ .Values.triton.security.adminHeader }}
{{- end -}}

{{/*
model-triton.adminProtocols: every 23.05 gRPC protocol except inference and health, the ones
restricted by default.
*/}}
{{- define "model-triton.adminProtocols" -}}
logging trace shared-memory model-repository statistics model-config metadata
{{- end -}}

{{/*
model-triton.clientLabel: the label (`key: value`) that admits a pod of the release namespace
to Triton's inference ports.
*/}}
{{- define "model-triton.clientLabel" -}}
model-triton/client: {{ include "model-triton.fullname" . }}
{{- end -}}

{{/*
model-triton.securityArgs: the `tritonserver` arguments of the security defaults (YAML list
items): the HTTP mode, gRPC on every address of the pod, the restricted gRPC protocols (the token comes from the environment),
and model control `none` (the repository is fixed at start; load and unload are refused:
ModelRepositoryManager::LoadUnloadModel in core r23.05).
*/}}
{{- define "model-triton.securityArgs" -}}
{{- $s := .Values.triton.security -}}
- --model-control-mode=none
{{- if eq $s.http "off" }}
- --allow-http=false
{{- else }}
- --allow-http=true
- --http-address={{ ternary "127.0.0.1" "0.0.0.0" (eq $s.http "loopback") }}
- --http-port=8000
{{- end }}
- --allow-grpc=true
- --grpc-address=0.0.0.0
- --grpc-port=8001
{{- with $s.restrictedGrpcProtocols }}
- --grpc-restricted-protocol={{ join "," . }}:{{ $s.adminHeader }}=$({{ include "model-triton.adminTokenEnv" $ }})
{{- end }}
{{- end -}}

{{/*
model-triton.httpOnNetwork: "true" when Triton's HTTP port listens on the pod's address.
*/}}
{{- define "model-triton.httpOnNetwork" -}}
{{- if eq .Values.triton.security.http "network" -}}true{{- end -}}
{{- end -}}

{{/*
model-triton.securityOwnedFlags: the `tritonserver` flags the security defaults own, refused in
triton.extraArgs. getopt_long accepts any unambiguous abbreviation of a long option, so an
argument is refused when its name is a prefix of one of these.
*/}}
{{- define "model-triton.securityOwnedFlags" -}}
allow-http http-address http-port reuse-http-port http-restricted-api allow-grpc grpc-address grpc-port reuse-grpc-port grpc-restricted-protocol model-control-mode load-model repository-poll-secs allow-sagemaker sagemaker-port sagemaker-safe-port-range sagemaker-thread-count allow-vertex-ai vertex-ai-port vertex-ai-thread-count vertex-ai-default-model
{{- end -}}

{{/*
model-triton.securityProblems: values that would silently undo the security defaults, as a JSON
list of `model-triton: ...` lines (collected by model-triton.validate). A `--` option the chart
sets itself is already refused by model-triton.collisionProblems (_rules.tpl); this adds the
flags the defaults own without setting them (SageMaker, Vertex AI, model loading, the HTTP
address when HTTP is off, ...), single-dash spellings, gRPC TLS and the environment.
*/}}
{{- define "model-triton.securityProblems" -}}
{{- $problems := list -}}
{{- $owned := splitList " " (include "model-triton.securityOwnedFlags" .) -}}
{{- $chartFlags := include "model-triton.tritonOwnedFlags" . | fromJsonArray -}}
{{- range $arg := .Values.triton.extraArgs -}}
{{- $text := toString $arg -}}
{{- $name := regexReplaceAll "=.*$" (trimPrefix "-" (trimPrefix "-" $text)) "" -}}
{{- $isFlag := and (hasPrefix "-" $text) (ne $name "") -}}
{{- $refusedByRules := false -}}
{{- if hasPrefix "--" $text -}}
{{- range $chartFlags -}}
{{- if hasPrefix $name . -}}{{- $refusedByRules = true -}}{{- end -}}
{{- end -}}
{{- end -}}
{{- $hit := "" -}}
{{- if $isFlag -}}
{{- range $flag := $owned -}}
{{- if and (not $hit) (hasPrefix $name $flag) -}}
{{- $hit = $flag -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if $refusedByRules -}}
{{- else if $hit -}}
{{- $problems = append $problems (printf "model-triton: triton.extraArgs has %q, which sets --%s, a flag the security defaults own. Use triton.security (http, restrictedGrpcProtocols, adminHeader) to loosen them deliberately; SageMaker, Vertex AI, model control and --http-restricted-api (not in Triton 23.05) are not offered." $text $hit) -}}
{{- else if and $isFlag (hasPrefix "grpc-use" $name) (hasPrefix $name "grpc-use-ssl-mutual") (not (regexMatch "=(false|0|off)$" (lower $text))) -}}
{{- $problems = append $problems (printf "model-triton: triton.extraArgs has %q, which turns on gRPC TLS: Kubernetes' gRPC probes speak plaintext and would never see the pod ready. Terminate TLS in front of Triton (a service mesh or your gateway)." $text) -}}
{{- end -}}
{{- end -}}
{{- range .Values.triton.extraEnv -}}
{{- $name := toString .name -}}
{{- if eq $name "AIP_MODE" -}}
{{- $problems = append $problems "model-triton: triton.extraEnv sets AIP_MODE: AIP_MODE=PREDICTION makes Triton 23.05 serve the Vertex AI HTTP endpoint, which no restriction covers. Remove it." -}}
{{- else if eq $name (include "model-triton.adminTokenEnv" $) -}}
{{- $problems = append $problems (printf "model-triton: triton.extraEnv sets %s: the chart sets it from triton.security.adminSecret. Remove it." $name) -}}
{{- end -}}
{{- end -}}
{{- toJson $problems -}}
{{- end -}}

{{/*
model-triton.securityWarnings: NOTES lines for a release whose values loosen a security default.
*/}}
{{- define "model-triton.securityWarnings" -}}
{{- $s := .Values.triton.security -}}
{{- $open := list -}}
{{- range splitList " " (include "model-triton.adminProtocols" .) -}}
{{- if not (has . $s.restrictedGrpcProtocols) -}}
{{- $open = append $open . -}}
{{- end -}}
{{- end -}}
{{- if $open }}
WARNING: model-triton: the gRPC protocol(s) {{ join ", " $open }} answer without the admin header (triton.security.restrictedGrpcProtocols){{ if has "logging" $open }}: anyone who reaches port 8001 can make Triton 23.05 write its log to a file of their choosing (CVE-2024-0087){{ end }}. See SECURITY.md.
{{- end }}
{{- if eq $s.http "network" }}
WARNING: model-triton: HTTP (8000) listens on the pod's address (triton.security.http: network) and Triton 23.05 cannot restrict it: /v2/logging, /v2/trace/setting, shared-memory and repository endpoints answer every client the NetworkPolicy admits, without the admin header. See SECURITY.md.
{{- end }}
{{- if not .Values.networkPolicy.enabled }}
WARNING: model-triton: networkPolicy.enabled is false: every pod of the cluster can call Triton and scrape its metrics, and the loader can reach any address.
{{- end }}
{{- end -}}
