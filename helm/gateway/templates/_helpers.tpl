{{/*
Names, labels and value checks. Every define is namespaced by the chart name ("gateway.").
*/}}

{{/* The chart name, or nameOverride. */}}
{{- define "gateway.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The name of the objects: release-chart, unless the release name already contains the chart name. */}}
{{- define "gateway.fullname" -}}
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

{{/* The admin Service's name: the full name (cut to leave room) plus "-admin". */}}
{{- define "gateway.adminFullname" -}}
{{- printf "%s-admin" (include "gateway.fullname" . | trunc 57 | trimSuffix "-") -}}
{{- end -}}

{{/* The Secret holding the admin token: admin.existingSecret, or the one the chart keeps. */}}
{{- define "gateway.adminSecretName" -}}
{{- if .Values.admin.existingSecret -}}
{{- .Values.admin.existingSecret -}}
{{- else -}}
{{- printf "%s-admin-token" (include "gateway.fullname" . | trunc 51 | trimSuffix "-") -}}
{{- end -}}
{{- end -}}

{{/* The key of the token in that Secret. */}}
{{- define "gateway.adminSecretKey" -}}
{{- if .Values.admin.existingSecret -}}{{ .Values.admin.existingSecretKey }}{{- else -}}token{{- end -}}
{{- end -}}

{{- define "gateway.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels that select the pods; never change them after a release exists (selectors are immutable). */}}
{{- define "gateway.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gateway.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "gateway.labels" -}}
helm.sh/chart: {{ include "gateway.chart" . }}
{{ include "gateway.selectorLabels" . }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: ratelimit-gateway
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/*
metadata.annotations: commonAnnotations merged with the ones given in "extra" (they win), or
nothing at all. Called with (dict "context" $ "extra" $moreAnnotations) inside a `with`, so that
an empty result leaves no line behind.
*/}}
{{- define "gateway.annotations" -}}
{{- $all := merge (dict) (.extra | default dict) (.context.Values.commonAnnotations | default dict) -}}
{{- with $all -}}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end -}}
{{- end -}}

{{- define "gateway.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "gateway.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* registry/repository:tag@digest */}}
{{- define "gateway.image" -}}
{{- $repository := .Values.image.repository -}}
{{- if .Values.image.registry -}}
{{- $repository = printf "%s/%s" .Values.image.registry .Values.image.repository -}}
{{- end -}}
{{- $ref := printf "%s:%s" $repository (.Values.image.tag | default .Chart.AppVersion | toString) -}}
{{- if .Values.image.digest -}}
{{- $ref = printf "%s@%s" $ref .Values.image.digest -}}
{{- end -}}
{{- $ref -}}
{{- end -}}

{{/* The routes.yaml document as text: the routes value verbatim, or a mapping rendered as YAML. */}}
{{- define "gateway.routesText" -}}
{{- if kindIs "string" .Values.routes -}}
{{- .Values.routes -}}
{{- else -}}
{{- toYaml .Values.routes -}}
{{- end -}}
{{- end -}}

{{/* The environment variable an upstreams value becomes: shop-api -> UPSTREAM_SHOP_API. */}}
{{- define "gateway.upstreamEnv" -}}
{{- printf "UPSTREAM_%s" (. | upper | replace "-" "_") -}}
{{- end -}}

{{/* True (non-empty) when the pods share an external Redis instead of each running its own. */}}
{{- define "gateway.sharedRedis" -}}
{{- if or .Values.redis.url .Values.redis.existingSecret -}}true{{- end -}}
{{- end -}}

{{/*
Value checks. Every problem found is listed in one `fail`, each saying what to change.
Types and ranges (replicaCount >= 0, ports 1-65535, redis.mode one of three ...) are checked
before this by values.schema.json.
*/}}
{{- define "gateway.validateValues" -}}
{{- $problems := list -}}
{{- $shared := include "gateway.sharedRedis" . -}}
{{- $redis := .Values.redis -}}
{{- if and $redis.url $redis.existingSecret -}}
{{- $problems = append $problems "redis: set redis.url or redis.existingSecret, not both (both would become GATEWAY_REDIS_URL)" -}}
{{- end -}}
{{- if and $redis.url (or (regexMatch "^[a-zA-Z][a-zA-Z0-9+.-]*://[^/@?#]*:[^/@?#]*@" $redis.url) (regexMatch "[?&]password=" $redis.url)) -}}
{{- $problems = append $problems "redis.url: it holds a password, and values are stored in plain text in the release (helm get values shows them). Put the whole URL in a Secret and set redis.existingSecret (and redis.existingSecretKey)" -}}
{{- end -}}
{{- if and (not $shared) (or .Values.autoscaling.enabled (gt (int .Values.replicaCount) 1)) -}}
{{- $problems = append $problems (printf "redis: %s needs a shared Redis: set redis.url or redis.existingSecret. Without one every pod runs its own embedded Redis and each pod would admit the full limit" (ternary "autoscaling.enabled" (printf "replicaCount %d" (int .Values.replicaCount)) .Values.autoscaling.enabled)) -}}
{{- end -}}
{{- if and (not $shared) (ne $redis.mode "standalone") -}}
{{- $problems = append $problems (printf "redis.mode: %s needs redis.url or redis.existingSecret (the embedded Redis is standalone)" $redis.mode) -}}
{{- end -}}
{{- if and .Values.autoscaling.enabled (gt (int .Values.autoscaling.minReplicas) (int .Values.autoscaling.maxReplicas)) -}}
{{- $problems = append $problems (printf "autoscaling: minReplicas (%d) is larger than maxReplicas (%d)" (int .Values.autoscaling.minReplicas) (int .Values.autoscaling.maxReplicas)) -}}
{{- end -}}
{{- if and .Values.autoscaling.enabled (not .Values.autoscaling.targetCPUUtilizationPercentage) (not .Values.autoscaling.targetMemoryUtilizationPercentage) -}}
{{- $problems = append $problems "autoscaling: set targetCPUUtilizationPercentage or targetMemoryUtilizationPercentage (the HPA needs a metric)" -}}
{{- end -}}
{{- $base := list (int .Values.containerPorts.proxy) (int .Values.containerPorts.admin) -}}
{{- $extra := list -}}
{{- if .Values.check.enabled -}}{{- $extra = append $extra (int .Values.check.containerPort) -}}{{- end -}}
{{- if .Values.rls.enabled -}}{{- $extra = append $extra (int .Values.rls.containerPort) -}}{{- end -}}
{{- $clash := ne (len $extra) (len (uniq $extra)) -}}
{{- range $extra -}}{{- if has . $base -}}{{- $clash = true -}}{{- end -}}{{- end -}}
{{- if $clash -}}
{{- $problems = append $problems "check.containerPort and rls.containerPort: each port must differ from the others and from containerPorts.proxy and containerPorts.admin" -}}
{{- end -}}
{{- if and .Values.rls.files (not .Values.rls.enabled) -}}
{{- $problems = append $problems "rls.files: they are only read by the rate limit service; set rls.enabled" -}}
{{- end -}}
{{- if eq (int .Values.containerPorts.proxy) (int .Values.containerPorts.admin) -}}
{{- $problems = append $problems "containerPorts: proxy and admin must differ (the admin API is never served on the proxy port)" -}}
{{- end -}}
{{- $shutdown := add (int .Values.preStopSleepSeconds) (int .Values.drainTimeoutSeconds) -}}
{{- if le (int .Values.terminationGracePeriodSeconds) (int $shutdown) -}}
{{- $problems = append $problems (printf "terminationGracePeriodSeconds (%d) must be longer than preStopSleepSeconds + drainTimeoutSeconds (%d), or the kubelet kills requests that are still draining" (int .Values.terminationGracePeriodSeconds) (int $shutdown)) -}}
{{- end -}}
{{- $text := include "gateway.routesText" . -}}
{{- $doc := fromYaml $text -}}
{{- if not $text -}}
{{- $problems = append $problems "routes: is empty; it must hold the routes.yaml document" -}}
{{- else if hasKey $doc "Error" -}}
{{- $problems = append $problems (printf "routes: not a YAML mapping: %s" (get $doc "Error")) -}}
{{- else -}}
{{- $docRedis := get $doc "redis" | default dict -}}
{{- if not (kindIs "map" $docRedis) -}}
{{- $problems = append $problems "routes: redis must be a mapping" -}}
{{- else -}}
{{- $url := get $docRedis "url" | default "" | toString -}}
{{- if and $url (not (hasPrefix "${" $url)) -}}
{{- $problems = append $problems "routes: redis.url is written in routes.yaml, which lands in a ConfigMap; leave it out and set the chart's redis.url or redis.existingSecret (passed as GATEWAY_REDIS_URL)" -}}
{{- end -}}
{{- $mode := get $docRedis "mode" | default "standalone" | toString -}}
{{- if not (or (hasPrefix "${REDIS_MODE" $mode) (eq $mode $redis.mode)) -}}
{{- $problems = append $problems (printf "routes: redis.mode is %q but the chart's redis.mode is %q; write `mode: ${REDIS_MODE:-standalone}` under redis: in routes (the chart sets REDIS_MODE)" $mode $redis.mode) -}}
{{- end -}}
{{- end -}}
{{- $docAdmin := get $doc "admin" | default dict -}}
{{- $token := "" -}}
{{- if kindIs "map" $docAdmin -}}
{{- $token = get $docAdmin "token" | default "" | toString -}}
{{- end -}}
{{- if and $token (not (hasPrefix "${" $token)) -}}
{{- $problems = append $problems "routes: admin.token is a literal token in a ConfigMap; put it in a Secret, set admin.existingSecret and write `token: ${ADMIN_TOKEN:-}` under admin: in routes" -}}
{{- end -}}
{{- if not (contains "${ADMIN_TOKEN" $token) -}}
{{- $problems = append $problems (printf "routes: %s but routes does not read it; write `token: ${ADMIN_TOKEN:-}` under admin: in routes (the admin port listens on the pod network, for probes and Prometheus)" (ternary "admin.existingSecret is set" "the chart passes the admin token as ADMIN_TOKEN" (not (empty .Values.admin.existingSecret)))) -}}
{{- end -}}
{{- $given := dict -}}
{{- range $name, $url := .Values.upstreams -}}
{{- if $url -}}{{- $_ := set $given (include "gateway.upstreamEnv" $name) true -}}{{- end -}}
{{- end -}}
{{- range .Values.extraEnv -}}{{- $_ := set $given .name true -}}{{- end -}}
{{- range $ref := regexFindAll "\\$\\{UPSTREAM_[A-Za-z0-9_]+\\}" $text -1 | uniq -}}
{{- $var := $ref | trimPrefix "${" | trimSuffix "}" -}}
{{- if not (hasKey $given $var) -}}
{{- $problems = append $problems (printf "routes reads %s, which no value sets: add `upstreams: {%s: URL}` (rendered as %s), or give it a default (`${%s:-URL}`)" $ref ($var | trimPrefix "UPSTREAM_" | lower | replace "_" "-") $var $var) -}}
{{- end -}}
{{- end -}}
{{- if and .Values.admin.token .Values.admin.existingSecret -}}
{{- $problems = append $problems "admin: set admin.token or admin.existingSecret, not both" -}}
{{- end -}}
{{- end -}}
{{- if $problems -}}
{{- fail (printf "\n\nVALUES VALIDATION (ratelimit-gateway):\n  - %s\n" (join "\n  - " $problems)) -}}
{{- end -}}
{{- end -}}
