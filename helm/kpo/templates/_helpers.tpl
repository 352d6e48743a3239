{{/*
Names, labels and the pieces several templates share. A template that needs a name, a label
set, an image reference or a pod fragment takes it from here, so the resources cannot drift apart.
*/}}

{{/* The chart name, or nameOverride. */}}
{{- define "kpo.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The prefix of every resource name: <release>-<chart>, or the release name alone when it already
contains the chart name, or fullnameOverride. 40 characters at most, so that every name derived
from it (KubeRay's `<cluster>-head-svc`, `-control-plane`, ...) stays within Kubernetes' 63.
*/}}
{{- define "kpo.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* The name of one component's resources: (dict "ctx" $ "component" "redis") -> <fullname>-redis. */}}
{{- define "kpo.componentName" -}}
{{- printf "%s-%s" (include "kpo.fullname" .ctx) .component | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* chart label value: <name>-<version>. */}}
{{- define "kpo.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels of one component: (dict "ctx" $ "component" "control-plane"). */}}
{{- define "kpo.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kpo.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Every label of one component's resources: (dict "ctx" $ "component" "redis"). */}}
{{- define "kpo.labels" -}}
helm.sh/chart: {{ include "kpo.chart" .ctx }}
{{ include "kpo.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: kpo-rl
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* metadata.name and metadata.labels of one component's resource. */}}
{{- define "kpo.metadata" -}}
name: {{ include "kpo.componentName" . }}
labels:
  {{- include "kpo.labels" . | nindent 2 }}
{{- end }}

{{/* The control plane's ServiceAccount. */}}
{{- define "kpo.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kpo.componentName" (dict "ctx" . "component" "control-plane")) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
An image reference: (dict "image" .Values.x.image "ctx" $). With a digest, `repository@digest`
(the tag is not used: the digest alone names the content); else `repository:tag`, the tag
defaulting to appVersion.
*/}}
{{- define "kpo.image" -}}
{{- if .image.digest }}
{{- printf "%s@%s" .image.repository .image.digest }}
{{- else }}
{{- printf "%s:%s" .image.repository (.image.tag | default .ctx.Chart.AppVersion) }}
{{- end }}
{{- end }}

{{/*
The pod-level settings every pod of the chart has: imagePullSecrets, the pod securityContext and
the scheduling constraints. (dict "ctx" $ "securityContext" <podSecurityContext>
"scheduling" <a map with nodeSelector, tolerations, affinity>)
*/}}
{{- define "kpo.podSettings" -}}
securityContext:
  {{- toYaml .securityContext | nindent 2 }}
{{- with .ctx.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .scheduling.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .scheduling.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .scheduling.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/*
A random secret value, base64-encoded, that survives upgrades: the value already in the Secret
when there is one (`lookup`; `helm template`, Argo CD and Flux see none and make a new one every
time: `secrets.requireExisting`). Made once per render: the value is kept in
`.Values._kpoGenerated` (one map for every template of a render), so that the Secret and the
checksum annotations of the pods that use it (`kpo.secretChecksum`) agree.
(dict "ctx" $ "secret" NAME "key" KEY)
*/}}
{{- define "kpo.generatedSecretValue" -}}
{{- $cache := .ctx.Values._kpoGenerated | default dict }}
{{- $_ := set .ctx.Values "_kpoGenerated" $cache }}
{{- $id := printf "%s/%s" .secret .key }}
{{- if not (hasKey $cache $id) }}
{{- $existing := lookup "v1" "Secret" .ctx.Release.Namespace .secret }}
{{- $_ := set $cache $id (dig "data" .key "" ($existing | default dict) | default (randAlphaNum 40 | b64enc)) }}
{{- end }}
{{- get $cache $id }}
{{- end }}

{{/*
The checksum annotation value of one secret, for the pods that read it, so that they roll
together when it changes: the sha256 of `<Secret>/<key>:<value, base64>` for a Secret the chart
generates (its value is known to the render), of `<Secret>/<key>` for an existing Secret (whose
content the chart does not read: change its name to roll the pods).
(dict "ctx" $ "secret" NAME "key" KEY "existing" <whether it is an existing Secret>)
*/}}
{{- define "kpo.secretChecksum" -}}
{{- if .existing }}
{{- printf "%s/%s" .secret .key | sha256sum }}
{{- else }}
{{- printf "%s/%s:%s" .secret .key (include "kpo.generatedSecretValue" .) | sha256sum }}
{{- end }}
{{- end }}

{{/*
The checksum annotations of the secrets a pod reads, one `checksum/secret-<name>` each:
(dict "ctx" $ "secrets" (list "api-token" "redis" "ray-auth")); a secret the release does not
use (Redis without a password, Ray without token auth) is left out.
*/}}
{{- define "kpo.secretChecksums" -}}
{{- $ctx := .ctx }}
{{- $v := $ctx.Values }}
{{- range $which := .secrets }}
{{- if eq $which "api-token" }}
checksum/secret-api-token: {{ include "kpo.secretChecksum" (dict "ctx" $ctx "secret" (include "kpo.apiTokenSecretName" $ctx) "key" $v.apiToken.secretKey "existing" $v.apiToken.existingSecret) }}
{{- else if and (eq $which "redis") $v.redis.auth.enabled }}
checksum/secret-redis: {{ include "kpo.secretChecksum" (dict "ctx" $ctx "secret" (include "kpo.redisSecretName" $ctx) "key" $v.redis.auth.secretKey "existing" $v.redis.auth.existingSecret) }}
{{- else if and (eq $which "ray-auth") $v.ray.auth.enabled }}
checksum/secret-ray-auth: {{ include "kpo.secretChecksum" (dict "ctx" $ctx "secret" (include "kpo.rayAuthSecretName" $ctx) "key" $v.ray.auth.secretKey "existing" $v.ray.auth.existingSecret) }}
{{- else if and (eq $which "sandbox-token") $v.sandbox.enabled }}
checksum/secret-sandbox-token: {{ include "kpo.secretChecksum" (dict "ctx" $ctx "secret" (include "kpo.sandboxTokenSecretName" $ctx) "key" $v.sandbox.token.secretKey "existing" $v.sandbox.token.existingSecret) }}
{{- else if and (eq $which "alert-token") $v.alerting.enabled }}
checksum/secret-alert-token: {{ include "kpo.secretChecksum" (dict "ctx" $ctx "secret" (include "kpo.alertTokenSecretName" $ctx) "key" $v.alerting.token.secretKey "existing" $v.alerting.token.existingSecret) }}
{{- end }}
{{- end }}
{{- end }}

{{/* The Secret holding the API token. */}}
{{- define "kpo.apiTokenSecretName" -}}
{{- .Values.apiToken.existingSecret | default (include "kpo.componentName" (dict "ctx" . "component" "api-token")) }}
{{- end }}

{{/* The Secret holding the Redis password. */}}
{{- define "kpo.redisSecretName" -}}
{{- .Values.redis.auth.existingSecret | default (include "kpo.componentName" (dict "ctx" . "component" "redis")) }}
{{- end }}

{{/* The Secret holding Ray's auth token. */}}
{{- define "kpo.rayAuthSecretName" -}}
{{- .Values.ray.auth.existingSecret | default (include "kpo.componentName" (dict "ctx" . "component" "ray-auth")) }}
{{- end }}

{{/* The Secret holding the sandbox server's bearer token. */}}
{{- define "kpo.sandboxTokenSecretName" -}}
{{- .Values.sandbox.token.existingSecret | default (include "kpo.componentName" (dict "ctx" . "component" "sandbox-token")) }}
{{- end }}

{{/* The Secret holding the bearer token of Alertmanager's webhook (alerting.enabled). */}}
{{- define "kpo.alertTokenSecretName" -}}
{{- .Values.alerting.token.existingSecret | default (include "kpo.componentName" (dict "ctx" . "component" "alert-token")) }}
{{- end }}

{{/* The API's Service, inside the cluster: http://<service>.<namespace>.svc:<port>. */}}
{{- define "kpo.apiServiceUrl" -}}
{{- printf "http://%s.%s.svc:%v" (include "kpo.componentName" (dict "ctx" . "component" "control-plane")) .Release.Namespace .Values.controlPlane.service.port }}
{{- end }}

{{/*
The alerts of deploy/prometheus/rules.yaml (files/rules.yaml) about one run, comma-separated:
those whose summary names the run (`$labels.run_id`), which alerting.ruleActions may give an
action. The others (the control plane, its store) name no run, and the webhook has no run to act on.
*/}}
{{- define "kpo.runAlertNames" -}}
{{- $names := list }}
{{- range $group := (.Files.Get "files/rules.yaml" | fromYaml).groups }}
{{- range $rule := $group.rules }}
{{- if and $rule.alert (contains "$labels.run_id" (toString (dig "annotations" "summary" "" $rule))) }}
{{- $names = append $names $rule.alert }}
{{- end }}
{{- end }}
{{- end }}
{{- join "," $names }}
{{- end }}

{{/* The actions a firing alert may ask of its run (services/api/alerts.py, ALERT_ACTIONS). */}}
{{- define "kpo.alertActions" -}}
warn,checkpoint,pause,cancel
{{- end }}

{{/* Checks of alerting.* that need more than the schema. */}}
{{- define "kpo.validateAlerting" -}}
{{- $alerting := .Values.alerting }}
{{- $actions := splitList "," (include "kpo.alertActions" .) }}
{{- if not (has $alerting.defaultAction $actions) }}
{{- fail (printf "alerting.defaultAction: unknown action %q; valid: %s" (toString $alerting.defaultAction) (join ", " $actions)) }}
{{- end }}
{{- with $alerting.ruleActions }}
{{- if not $alerting.enabled }}
{{- fail "alerting.ruleActions: the actions are for the webhook of alerting.enabled=true, which is off; set it (or leave alerting.ruleActions empty)" }}
{{- end }}
{{- if not $.Values.monitoring.prometheusRule.enabled }}
{{- fail "alerting.ruleActions labels the alerts of the chart's PrometheusRule, which monitoring.prometheusRule.enabled=false leaves out: set it, or leave alerting.ruleActions empty and add the `kpo_action` label to the rules you load yourself" }}
{{- end }}
{{- $known := splitList "," (include "kpo.runAlertNames" $) }}
{{- range $name, $action := . }}
{{- if not (has $name $known) }}
{{- fail (printf "alerting.ruleActions: unknown alert %q; the alerts about one run are %s" $name (join ", " $known)) }}
{{- end }}
{{- if not (has $action $actions) }}
{{- fail (printf "alerting.ruleActions.%s: unknown action %q; valid: %s" $name (toString $action) (join ", " $actions)) }}
{{- end }}
{{- end }}
{{- end }}
{{- if $alerting.enabled }}
{{- $secret := include "kpo.alertTokenSecretName" . }}
{{- $key := $alerting.token.secretKey }}
{{- $others := list (list "API token" (include "kpo.apiTokenSecretName" .) .Values.apiToken.secretKey) }}
{{- if .Values.redis.auth.enabled }}{{ $others = append $others (list "Redis password" (include "kpo.redisSecretName" .) .Values.redis.auth.secretKey) }}{{ end }}
{{- if .Values.ray.auth.enabled }}{{ $others = append $others (list "Ray token" (include "kpo.rayAuthSecretName" .) .Values.ray.auth.secretKey) }}{{ end }}
{{- if .Values.sandbox.enabled }}{{ $others = append $others (list "sandbox token" (include "kpo.sandboxTokenSecretName" .) .Values.sandbox.token.secretKey) }}{{ end }}
{{- range $other := $others }}
{{- if and (eq $secret (index $other 1)) (eq $key (index $other 2)) }}
{{- fail (printf "alerting.token names the %s (Secret %s, key %s): Alertmanager holds the webhook's token, so it must be a token of its own: give it a key of its own (alerting.token.secretKey: alert-token)" (index $other 0) $secret $key) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The sandbox server's bearer token from its Secret, as `KPO_SANDBOX_TOKEN`: on the sandbox
container (the server checks it) and on every Ray container (the generation workers send it;
`tools.sandbox_token_env` names this variable by default). Empty without sandbox.enabled.
*/}}
{{- define "kpo.sandboxTokenEnv" -}}
{{- if .Values.sandbox.enabled -}}
- name: KPO_SANDBOX_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "kpo.sandboxTokenSecretName" . }}
      key: {{ .Values.sandbox.token.secretKey }}
{{- end }}
{{- end }}

{{/*
The sandbox servers runs sent over the API may name (`KPO_SANDBOX_URLS`): the chart's own
Service when sandbox.enabled, then `controlPlane.sandboxUrls`.
*/}}
{{- define "kpo.sandboxUrls" -}}
{{- $urls := list -}}
{{- if .Values.sandbox.enabled }}{{ $urls = append $urls (include "kpo.sandboxUrl" .) }}{{ end -}}
{{- join "," (concat $urls .Values.controlPlane.sandboxUrls) -}}
{{- end }}

{{/* The names the sandbox's Service is reached by inside the cluster, comma-separated. */}}
{{- define "kpo.sandboxHostNames" -}}
{{- $name := include "kpo.componentName" (dict "ctx" . "component" "sandbox") -}}
{{- $ns := .Release.Namespace -}}
{{- join "," (list $name (printf "%s.%s" $name $ns) (printf "%s.%s.svc" $name $ns) (printf "%s.%s.svc.cluster.local" $name $ns)) -}}
{{- end }}

{{/* The sandbox server's URL inside the cluster, for a run's `tools.sandbox_url`. */}}
{{- define "kpo.sandboxUrl" -}}
{{- printf "http://%s.%s.svc:%v" (include "kpo.componentName" (dict "ctx" . "component" "sandbox")) .Release.Namespace .Values.sandbox.port }}
{{- end }}

{{/*
Environment entries of Ray's token authentication, for every Ray container and the control
plane: `RAY_AUTH_MODE=token` and the token from the Secret (`RAY_AUTH_TOKEN`, read by Ray itself
and by the launcher's job client); `RAY_AUTH_MODE=disabled` with ray.auth.enabled=false.
*/}}
{{- define "kpo.rayAuthEnv" -}}
{{- if .Values.ray.auth.enabled -}}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "kpo.rayAuthSecretName" . }}
      key: {{ .Values.ray.auth.secretKey }}
{{- else -}}
- name: RAY_AUTH_MODE
  value: disabled
{{- end }}
{{- end }}

{{/* The Redis URL without credentials: the built-in Redis' Service, or redis.external.url. */}}
{{- define "kpo.redisUrl" -}}
{{- if .Values.redis.builtin.enabled }}
{{- printf "redis://%s:6379/0" (include "kpo.componentName" (dict "ctx" . "component" "redis")) }}
{{- else }}
{{- .Values.redis.external.url }}
{{- end }}
{{- end }}

{{/*
Environment entries that give a container KPO_STORE_URL. The password goes into the URL through
Kubernetes' $(VAR) expansion, so it is read from the Secret and never written into a manifest.
*/}}
{{- define "kpo.storeEnv" -}}
{{- $url := include "kpo.redisUrl" . }}
{{- if .Values.redis.auth.enabled -}}
- name: KPO_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "kpo.redisSecretName" . }}
      key: {{ .Values.redis.auth.secretKey }}
- name: KPO_STORE_URL
  value: {{ regexReplaceAll "^(rediss?://)" $url "${1}:$(KPO_REDIS_PASSWORD)@" | quote }}
{{- else -}}
- name: KPO_STORE_URL
  value: {{ $url | quote }}
{{- end }}
{{- end }}

{{/* The RayCluster's name; KubeRay names the head's Service `<name>-head-svc`. */}}
{{- define "kpo.rayClusterName" -}}
{{- include "kpo.componentName" (dict "ctx" . "component" "ray") }}
{{- end }}

{{/* Where the control plane submits runs: the job server of the chart's RayCluster, or ray.address. */}}
{{- define "kpo.rayAddress" -}}
{{- if .Values.ray.cluster.enabled }}
{{- printf "http://%s-head-svc.%s.svc:8265" (include "kpo.rayClusterName" .) .Release.Namespace }}
{{- else }}
{{- .Values.ray.address }}
{{- end }}
{{- end }}

{{/* The claim of ray.runsVolume: an existing one, or the chart's. */}}
{{- define "kpo.runsClaimName" -}}
{{- .Values.ray.runsVolume.existingClaim | default (include "kpo.componentName" (dict "ctx" . "component" "runs")) }}
{{- end }}

{{/* The claim of ray.models (volume: claim): an existing one, or the chart's. */}}
{{- define "kpo.modelsClaimName" -}}
{{- .Values.ray.models.existingClaim | default (include "kpo.componentName" (dict "ctx" . "component" "models")) }}
{{- end }}

{{/*
Where every Ray pod mounts the model directory: ray.models.mountPath, or `<dataDir>/inputs/models`
(the API reads the paths of specs sent over HTTP from `<dataDir>/inputs`,
services/api/spec_paths.py).
*/}}
{{- define "kpo.modelsPath" -}}
{{- .Values.ray.models.mountPath | default (printf "%s/inputs/models" (trimSuffix "/" .Values.dataDir)) }}
{{- end }}

{{/*
Bytes of a Kubernetes quantity that is a whole number with an optional unit (16Gi, 500M, 1073741824);
empty for any other form (1.5Ti, 5e9), which callers then leave alone.
*/}}
{{- define "kpo.quantityBytes" -}}
{{- $quantity := toString . }}
{{- if regexMatch "^[0-9]+(k|Ki|M|Mi|G|Gi|T|Ti)?$" $quantity }}
{{- $units := dict "" 1 "k" 1000 "Ki" 1024 "M" 1000000 "Mi" 1048576 "G" 1000000000 "Gi" 1073741824 "T" 1000000000000 "Ti" 1099511627776 }}
{{- mul (regexReplaceAll "[^0-9].*$" $quantity "" | int64) (get $units (regexReplaceAll "^[0-9]+" $quantity "")) }}
{{- end }}
{{- end }}

{{/*
Fills in a merged worker group's sizes from its `perGpu` where `resources` and `shmSize` leave them
unset, so that a group of N GPUs gets N times one GPU's CPU, memory and /dev/shm (a group without
GPUs, one GPU's worth). Changes the group in place; renders nothing.
*/}}
{{- define "kpo.sizeWorkerGroup" -}}
{{- $n := max 1 (int .gpus) }}
{{- $per := .perGpu }}
{{- $resources := deepCopy (.resources | default dict) }}
{{- $requests := get $resources "requests" | default dict }}
{{- $limits := get $resources "limits" | default dict }}
{{- $memory := get $limits "memory" | default (printf "%dGi" (mul $n (int $per.memoryGi))) }}
{{- $_ := set $limits "memory" $memory }}
{{- if not (hasKey $requests "memory") }}{{ $_ := set $requests "memory" $memory }}{{ end }}
{{- if not (hasKey $requests "cpu") }}{{ $_ := set $requests "cpu" (toString (mul $n (int $per.cpu))) }}{{ end }}
{{- $_ := set $resources "requests" $requests }}
{{- $_ := set $resources "limits" $limits }}
{{- $_ := set . "resources" $resources }}
{{- if not .shmSize }}{{ $_ := set . "shmSize" (printf "%dGi" (mul $n (int $per.shmGi))) }}{{ end }}
{{- end }}

{{/*
Caps Ray's object store at ray.objectStoreShmPercent of a Ray pod's /dev/shm, by setting
`object-store-memory` in its `ray start` parameters (in place), unless they set it themselves. Ray's
default takes up to 95% of /dev/shm, and NCCL and vLLM's tensor-parallel workers, which need some
of it too, then fail. Fails when /dev/shm would not fit in the pod's memory limit (it is memory of
the pod). Renders nothing.
(dict "params" <rayStartParams, changed> "shmSize" <quantity> "memory" <the memory limit>
      "where" <the values' key, for the message> "percent" <ray.objectStoreShmPercent>)
*/}}
{{- define "kpo.capObjectStore" -}}
{{- $shm := include "kpo.quantityBytes" .shmSize }}
{{- $memory := include "kpo.quantityBytes" (.memory | default "") }}
{{- if and $shm $memory (ge (int64 $shm) (int64 $memory)) }}
{{- fail (printf "%s: /dev/shm (%s) must be smaller than the memory limit (%s): a memory-backed /dev/shm counts against it" .where .shmSize .memory) }}
{{- end }}
{{- if and $shm (not (hasKey .params "object-store-memory")) }}
{{- $_ := set .params "object-store-memory" (toString (div (mul (int64 $shm) (int64 .percent)) 100)) }}
{{- end }}
{{- end }}

{{/*
The writable directories of a container whose root filesystem is read-only: /tmp, and the home
directory of the images' user `kpo` (deploy/docker/Dockerfile), where Python libraries keep their
caches (torch, Triton, vLLM, matplotlib). `kpo.writableVolumes` are the pod's volumes for them.
*/}}
{{- define "kpo.homeDir" -}}
/home/kpo
{{- end }}

{{- define "kpo.writableMounts" -}}
- name: tmp
  mountPath: /tmp
- name: home
  mountPath: {{ include "kpo.homeDir" . }}
{{- end }}

{{- define "kpo.writableVolumes" -}}
- name: tmp
  emptyDir: {}
- name: home
  emptyDir: {}
{{- end }}

{{/*
A Ray pod template's spec, for the head and for every worker group alike.
(dict "ctx" $ "group" <head or sized worker group> "container" "ray-head"|"ray-worker"
      "gpus" <nvidia.com/gpu per pod> "ports" <list of ContainerPort>
      "kubeApi" <whether the pod talks to the Kubernetes API: the head, for the autoscaler>
      "fillsModels" <whether this pod's init containers download ray.models.prefetch>)
*/}}
{{- define "kpo.rayPodSpec" -}}
{{- $ray := .ctx.Values.ray }}
{{- $modelsPath := include "kpo.modelsPath" .ctx }}
{{- $resources := deepCopy (.group.resources | default dict) }}
{{- if gt (int .gpus) 0 }}
{{- range $kind := list "requests" "limits" }}
{{- $_ := set $resources $kind (set (deepCopy (get $resources $kind | default dict)) "nvidia.com/gpu" (int $.gpus)) }}
{{- end }}
{{- end -}}
{{ include "kpo.podSettings" (dict "ctx" .ctx "securityContext" $ray.podSecurityContext "scheduling" .group) }}
{{- if not .kubeApi }}
# Nothing in this pod calls the Kubernetes API.
automountServiceAccountToken: false
{{- end }}
{{- if and .fillsModels $ray.models.prefetch }}
# The models of ray.models.prefetch, one init container each, before Ray starts: the same files
# at the same path in every pod that reads them.
initContainers:
  {{- range $index, $model := $ray.models.prefetch }}
  - name: prefetch-{{ $index }}
    image: {{ include "kpo.image" (dict "image" $ray.image "ctx" $.ctx) }}
    imagePullPolicy: {{ $ray.image.pullPolicy }}
    # Exec form, no shell: the values are arguments, never parsed as a command line.
    command: ["hf"]
    args:
      - download
      - {{ $model.repo | quote }}
      - --revision
      - {{ $model.revision | default "main" | quote }}
      - --local-dir
      - {{ printf "%s/%s" $modelsPath $model.repo | quote }}
    env:
      - name: HF_HOME
        value: /tmp/huggingface
      - name: HF_HUB_DISABLE_TELEMETRY
        value: "1"
      {{- with $ray.models.hfToken.existingSecret }}
      - name: HF_TOKEN
        valueFrom:
          secretKeyRef:
            name: {{ . }}
            key: {{ $ray.models.hfToken.secretKey }}
      {{- end }}
    resources:
      {{- toYaml $ray.models.prefetchResources | nindent 6 }}
    securityContext:
      {{- toYaml $ray.securityContext | nindent 6 }}
    volumeMounts:
      {{- include "kpo.writableMounts" $.ctx | nindent 6 }}
      - name: models
        mountPath: {{ $modelsPath }}
  {{- end }}
{{- end }}
containers:
  - name: {{ .container }}
    image: {{ include "kpo.image" (dict "image" $ray.image "ctx" .ctx) }}
    imagePullPolicy: {{ $ray.image.pullPolicy }}
    env:
      - name: KPO_DATA_DIR
        value: {{ .ctx.Values.dataDir | quote }}
      # The store the runs' drivers and actors report to, from the pod's environment (the
      # password through a secretKeyRef), so that no job's runtime environment carries it.
      {{- include "kpo.storeEnv" .ctx | nindent 6 }}
      {{- include "kpo.rayAuthEnv" .ctx | nindent 6 }}
      {{- with include "kpo.sandboxTokenEnv" .ctx }}
      # The sandbox server's token, which the generation workers send (tools.sandbox_url).
      {{- . | nindent 6 }}
      {{- end }}
      {{- with $ray.extraEnv }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
    ports:
      {{- toYaml .ports | nindent 6 }}
    resources:
      {{- toYaml $resources | nindent 6 }}
    securityContext:
      {{- toYaml $ray.securityContext | nindent 6 }}
    lifecycle:
      preStop:
        exec:
          command: ["/bin/sh", "-c", "ray stop"]
    volumeMounts:
      {{- include "kpo.writableMounts" . | nindent 6 }}
      # Ray's session directory (logs, sockets, runtime environments). KubeRay mounts the volume
      # mounted here into the autoscaler sidecar too.
      - name: ray-logs
        mountPath: /tmp/ray
      - name: shm
        mountPath: /dev/shm
      - name: data
        mountPath: {{ .ctx.Values.dataDir }}
      # Read-only for Ray's processes: only the prefetch init containers write models.
      - name: models
        mountPath: {{ $modelsPath }}
        readOnly: true
volumes:
  {{- include "kpo.writableVolumes" . | nindent 2 }}
  - name: ray-logs
    emptyDir: {}
  - name: shm
    emptyDir:
      medium: Memory
      sizeLimit: {{ .group.shmSize }}
  - name: data
    {{- if $ray.runsVolume.enabled }}
    persistentVolumeClaim:
      claimName: {{ include "kpo.runsClaimName" .ctx }}
    {{- else }}
    emptyDir: {}
    {{- end }}
  - name: models
    {{- if eq $ray.models.volume "claim" }}
    persistentVolumeClaim:
      claimName: {{ include "kpo.modelsClaimName" .ctx }}
    {{- else }}
    emptyDir:
      sizeLimit: {{ $ray.models.size }}
    {{- end }}
{{- end }}

{{/*
The label selector of the release's Ray pods (head and workers): the labels the chart gives their
templates, which KubeRay keeps on the pods it creates.
*/}}
{{- define "kpo.rayPodSelector" -}}
matchLabels:
  app.kubernetes.io/name: {{ include "kpo.name" . }}
  app.kubernetes.io/instance: {{ .Release.Name }}
matchExpressions:
  - key: app.kubernetes.io/component
    operator: In
    values: ["ray-head", "ray-worker"]
{{- end }}

{{/* A NetworkPolicy `from` list holding the release's Ray pods. */}}
{{- define "kpo.rayPodsPeer" -}}
- podSelector:
    {{- include "kpo.rayPodSelector" . | nindent 4 }}
{{- end }}

{{/*
A NetworkPolicy `from` list of one peer from a map with namespaceSelector and podSelector (label
selectors): the pods matching both; only podSelector: those pods in the release's namespace; only
namespaceSelector: every pod of those namespaces; neither: nothing (no peer, so no rule).
*/}}
{{- define "kpo.networkPolicyPeer" -}}
{{- $peer := dict }}
{{- with .namespaceSelector }}{{ $_ := set $peer "namespaceSelector" . }}{{ end }}
{{- with .podSelector }}{{ $_ := set $peer "podSelector" . }}{{ end }}
{{- if $peer }}
{{- list $peer | toYaml }}
{{- end }}
{{- end }}

{{/*
The `resources` rayStartParam of a worker group: its rayResources (an empty amount is the
group's gpus) as compact JSON in single quotes, `'{"learner_gpu":8}'`, the form KubeRay writes
itself. KubeRay puts it as it is into the pod's `ray start --resources=...` shell command, and
both KubeRay >= 1.3 (which trims the quotes) and Ray's autoscaler (which drops the first and
last character) read the JSON back. Not the escaped '"{\"a\": 1}"' of KubeRay's older samples,
which KubeRay >= 1.3 fails to parse; not the group field `resources` of KubeRay >= 1.5, which
older operators lack and which turns any name ending in "gpu" (learner_gpu) into `num-gpus`.
Empty without rayResources. Takes the merged worker group (rayResources, gpus).
*/}}
{{- define "kpo.rayResourcesParam" -}}
{{- $amounts := dict }}
{{- range $name, $amount := .rayResources }}
{{- $_ := set $amounts $name (kindIs "invalid" $amount | ternary $.gpus $amount) }}
{{- end }}
{{- if $amounts }}
{{- printf "'%s'" (toJson $amounts) }}
{{- end }}
{{- end }}

{{/* `ray start` parameters: the chart's defaults, then the group's own (strings, as KubeRay wants). */}}
{{- define "kpo.rayStartParams" -}}
{{- $params := dict }}
{{- range $key, $value := merge (dict) .params .defaults }}
{{- /* Helm reads numbers of values files as floats: 1000000000 would print as 1e+09. */}}
{{- if and (kindIs "float64" $value) (eq $value (float64 (int64 $value))) }}
{{- $value = int64 $value }}
{{- end }}
{{- $_ := set $params $key (toString $value) }}
{{- end }}
{{- toYaml $params }}
{{- end }}

{{/*
A `helm test` pod: runs a Python script in the control-plane image against the release's
Service, with the API token mounted. (dict "ctx" $ "name" "connection" "script" "...")
*/}}
{{- define "kpo.testPod" -}}
{{- $ctx := .ctx }}
apiVersion: v1
kind: Pod
metadata:
  name: {{ include "kpo.componentName" (dict "ctx" $ctx "component" (printf "test-%s" .name)) }}
  labels:
    {{- include "kpo.labels" (dict "ctx" $ctx "component" "test") | nindent 4 }}
  annotations:
    helm.sh/hook: test
    helm.sh/hook-delete-policy: before-hook-creation,hook-succeeded
spec:
  restartPolicy: Never
  automountServiceAccountToken: false
  {{- include "kpo.podSettings" (dict "ctx" $ctx "securityContext" $ctx.Values.controlPlane.podSecurityContext "scheduling" $ctx.Values.controlPlane) | nindent 2 }}
  containers:
    - name: test
      image: {{ include "kpo.image" (dict "image" $ctx.Values.controlPlane.image "ctx" $ctx) }}
      imagePullPolicy: {{ $ctx.Values.controlPlane.image.pullPolicy }}
      env:
        - name: KPO_URL
          value: {{ printf "http://%s:%v" (include "kpo.componentName" (dict "ctx" $ctx "component" "control-plane")) $ctx.Values.controlPlane.service.port | quote }}
        - name: KPO_METRICS_URL
          value: {{ printf "http://%s:%v/metrics" (include "kpo.componentName" (dict "ctx" $ctx "component" "control-plane")) $ctx.Values.controlPlane.metrics.port | quote }}
        - name: KPO_AUTH_READS
          value: {{ $ctx.Values.controlPlane.authReads | quote }}
        - name: KPO_API_TOKEN_FILE
          value: /etc/kpo/token/{{ $ctx.Values.apiToken.secretKey }}
      command: ["python", "-c"]
      args:
        - |
          {{- .script | trim | nindent 10 }}
      resources:
        requests:
          cpu: 50m
          memory: 64Mi
        limits:
          memory: 128Mi
      securityContext:
        {{- toYaml $ctx.Values.controlPlane.securityContext | nindent 8 }}
      volumeMounts:
        - name: api-token
          mountPath: /etc/kpo/token
          readOnly: true
  volumes:
    - name: api-token
      secret:
        secretName: {{ include "kpo.apiTokenSecretName" $ctx }}
{{- end }}

{{/*
Checks across values that values.schema.json cannot express well, failing with the fix.
Included by the control plane's Deployment, which every release renders.
*/}}
{{- define "kpo.validate" -}}
{{- $redis := .Values.redis }}
{{- if and $redis.builtin.enabled $redis.external.url }}
{{- fail "redis: set either redis.builtin.enabled=true or redis.external.url, not both (set redis.builtin.enabled=false to use an external Redis)" }}
{{- end }}
{{- if and (not $redis.builtin.enabled) (not $redis.external.url) }}
{{- fail "redis: redis.builtin.enabled is false, so set redis.external.url (redis://HOST:PORT/DB)" }}
{{- end }}
{{- if and (not $redis.builtin.enabled) $redis.auth.enabled (not $redis.auth.existingSecret) }}
{{- fail "redis: an external Redis' password must come from your Secret: set redis.auth.existingSecret (or redis.auth.enabled=false)" }}
{{- end }}
{{- if and (not .Values.ray.cluster.enabled) (not .Values.ray.address) }}
{{- fail "ray: ray.cluster.enabled is false, so set ray.address (the job server, http://HOST:8265)" }}
{{- end }}
{{- if and .Values.ray.cluster.enabled .Values.ray.address }}
{{- fail "ray: set either ray.cluster.enabled=true or ray.address, not both" }}
{{- end }}
{{- if and .Values.networkPolicy.enabled $redis.builtin.enabled (not .Values.ray.cluster.enabled) (not .Values.networkPolicy.externalRay.from) }}
{{- fail "networkPolicy: the runs on the Ray cluster at ray.address report to the built-in Redis, so set networkPolicy.externalRay.from to the peers of that cluster's pods (or networkPolicy.enabled=false)" }}
{{- end }}
{{- include "kpo.validateSecrets" . }}
{{- if eq (int .Values.controlPlane.metrics.port) (int .Values.controlPlane.port) }}
{{- fail "controlPlane.metrics.port: /metrics needs a port of its own, not controlPlane.port (the Ingress routes that one)" }}
{{- end }}
{{- if and .Values.ray.auth.enabled (not .Values.ray.cluster.enabled) (not .Values.ray.auth.existingSecret) }}
{{- fail "ray: the Ray cluster at ray.address has a token of its own: set ray.auth.existingSecret to a Secret holding it (or ray.auth.enabled=false if that cluster has no token authentication)" }}
{{- end }}
{{- if hasKey (.Values.ray.head.rayStartParams | default dict) "resources" }}
{{- fail "ray.head: remove rayStartParams.resources; the chart sets the head's Ray resources ({kpo_driver: ray.head.driverSlots})" }}
{{- end }}
{{- /* More active runs than driver slots: the extra jobs wait in Ray's queue, and Ray fails a job
that waits past RAY_JOB_START_TIMEOUT_SECONDS (15 minutes), so runs the API accepted would fail. */}}
{{- $maxRuns := int .Values.controlPlane.maxActiveRuns }}
{{- if and .Values.ray.cluster.enabled (or (eq $maxRuns 0) (gt $maxRuns (int .Values.ray.head.driverSlots))) }}
{{- fail (printf "controlPlane.maxActiveRuns (%d; 0 is no cap) must be between 1 and ray.head.driverSlots (%d): each active run's driver holds a slot, and a job waiting for one fails after 15 minutes" $maxRuns (int .Values.ray.head.driverSlots)) }}
{{- end }}
{{- include "kpo.validateEgress" . }}
{{- include "kpo.validateSandbox" . }}
{{- include "kpo.validateAlerting" . }}
{{- range $name, $overrides := .Values.ray.workerGroups }}
{{- $group := mergeOverwrite (deepCopy $.Values.ray.workerDefaults) ($overrides | default dict) }}
{{- if or (gt (int $group.minReplicas) (int $group.replicas)) (gt (int $group.replicas) (int $group.maxReplicas)) }}
{{- fail (printf "ray.workerGroups.%s: need minReplicas <= replicas <= maxReplicas (got %v, %v, %v)" $name $group.minReplicas $group.replicas $group.maxReplicas) }}
{{- end }}
{{- if and $group.rayResources (hasKey ($group.rayStartParams | default dict) "resources") }}
{{- fail (printf "ray.workerGroups.%s: declare custom Ray resources in rayResources only; remove rayStartParams.resources (the chart renders it from rayResources)" $name) }}
{{- end }}
{{- end }}
{{- end }}

{{/* Checks of sandbox.* that need more than the schema. */}}
{{- define "kpo.validateSandbox" -}}
{{- $sandbox := .Values.sandbox }}
{{- if $sandbox.enabled }}
{{- if and (not $sandbox.hostUsers) (not (semverCompare ">=1.33.0-0" .Capabilities.KubeVersion.Version)) }}
{{- fail (printf "sandbox: the sandbox pods run in a user namespace (sandbox.hostUsers=false, so that bubblewrap can mount a fresh /proc: procMount Unmasked), which Kubernetes turns on by default from 1.33; this render is for %s (docs/deploy.md, the sandbox)" .Capabilities.KubeVersion.Version) }}
{{- end }}
{{- if and (not .Values.ray.cluster.enabled) (not .Values.networkPolicy.externalRay.from) (not $sandbox.extraFrom) }}
{{- fail "sandbox: the runs on the Ray cluster at ray.address call the sandbox, so set networkPolicy.externalRay.from or sandbox.extraFrom to the peers of that cluster's pods (the sandbox's NetworkPolicy admits no one else)" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
secrets.requireExisting (GitOps): every secret the release uses must come from an existing
Secret, since a render without the cluster (helm template, Argo CD, Flux) cannot `lookup` the
generated ones and would make new ones each time.
*/}}
{{- define "kpo.validateSecrets" -}}
{{- if .Values.secrets.requireExisting }}
{{- $missing := list }}
{{- if not .Values.apiToken.existingSecret }}{{ $missing = append $missing "apiToken.existingSecret" }}{{ end }}
{{- if and .Values.redis.auth.enabled (not .Values.redis.auth.existingSecret) }}{{ $missing = append $missing "redis.auth.existingSecret" }}{{ end }}
{{- if and .Values.ray.auth.enabled (not .Values.ray.auth.existingSecret) }}{{ $missing = append $missing "ray.auth.existingSecret" }}{{ end }}
{{- if and .Values.sandbox.enabled (not .Values.sandbox.token.existingSecret) }}{{ $missing = append $missing "sandbox.token.existingSecret" }}{{ end }}
{{- if and .Values.alerting.enabled (not .Values.alerting.token.existingSecret) }}{{ $missing = append $missing "alerting.token.existingSecret" }}{{ end }}
{{- /* The webhook's token (alerting.enabled) is one key more. */}}
{{- $alertKey := ternary " --from-literal=alert-token=\"$(openssl rand -hex 32)\"" "" .Values.alerting.enabled }}
{{- if $missing }}
{{- fail (printf "secrets.requireExisting is true, so set %s: rendered without the cluster (helm template, Argo CD, Flux), the chart cannot read back the secrets it generates and would make new ones on every render. Create them first, each value distinct, with one command: kubectl -n %s create secret generic kpo-secrets --from-literal=token=\"$(openssl rand -hex 32)\" --from-literal=redis-password=\"$(openssl rand -hex 32)\" --from-literal=auth_token=\"$(openssl rand -hex 32)\" --from-literal=sandbox-token=\"$(openssl rand -hex 32)\"%s, and set each of those values to kpo-secrets (the keys are the chart's defaults; docs/deploy.md, step 3); or set secrets.requireExisting=false to have the chart generate them" (join ", " $missing) .Release.Namespace $alertKey) }}
{{- end }}
{{- end }}
{{- if .Values.sandbox.enabled }}
{{- $apiSecret := include "kpo.apiTokenSecretName" . }}
{{- if and (eq (include "kpo.sandboxTokenSecretName" .) $apiSecret) (eq .Values.sandbox.token.secretKey .Values.apiToken.secretKey) }}
{{- fail (printf "sandbox.token names the API token (Secret %s, key %s): every Ray pod carries the sandbox token, so the API token would be on them too; give the sandbox a key of its own (sandbox.token.secretKey: sandbox-token)" $apiSecret .Values.apiToken.secretKey) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The 32-bit number of a dotted IPv4 address, e.g. 169.254.0.0 -> 2851995648.
*/}}
{{- define "kpo.ipv4Number" -}}
{{- $n := 0 }}
{{- range $octet := splitList "." . }}
{{- $n = add (mul $n 256) (int $octet) }}
{{- end }}
{{- $n }}
{{- end }}

{{/*
How an IPv4 CIDR relates to 169.254.0.0/16 (link-local: the cloud metadata endpoint at
169.254.169.254): "contains" (the CIDR holds more than all of it: an ipBlock must except it),
"inside" (the CIDR lies in it, or is it: never allowed) or "apart".
*/}}
{{- define "kpo.linkLocalRelation" -}}
{{- $parts := splitList "/" . }}
{{- $bits := int (index $parts 1) }}
{{- $address := int64 (include "kpo.ipv4Number" (index $parts 0)) }}
{{- $linkLocal := int64 (include "kpo.ipv4Number" "169.254.0.0") }}
{{- $prefix := min $bits 16 }}
{{- $block := 1 }}
{{- range until (sub 32 $prefix | int) }}{{ $block = mul $block 2 }}{{ end }}
{{- if ne (div $address $block) (div $linkLocal $block) }}apart
{{- else if lt $bits 16 }}contains
{{- else }}inside
{{- end }}
{{- end }}

{{/*
NetworkPolicy `to` peers for a list of IPv4 CIDRs, each an ipBlock that excepts 169.254.0.0/16
where it holds it. (dict "cidrs" <list> "where" <the values' key, for the message>)
*/}}
{{- define "kpo.ipBlockPeers" -}}
{{- $where := .where }}
{{- range $cidr := .cidrs }}
{{- $relation := include "kpo.linkLocalRelation" $cidr }}
{{- if eq $relation "inside" }}
{{- fail (printf "%s: %s is link-local (169.254.0.0/16, the cloud metadata endpoint), which the chart never allows" $where $cidr) }}
{{- end }}
- ipBlock:
    cidr: {{ $cidr }}
    {{- if eq $relation "contains" }}
    except: ["169.254.0.0/16"]
    {{- end }}
{{- end }}
{{- end }}

{{/* NetworkPolicy `ports` for a list of TCP port numbers. */}}
{{- define "kpo.tcpPorts" -}}
{{- range $port := . }}
- port: {{ $port }}
  protocol: TCP
{{- end }}
{{- end }}

{{/* Checks of networkPolicy.egress that need more than the schema. */}}
{{- define "kpo.validateEgress" -}}
{{- $np := .Values.networkPolicy }}
{{- if and $np.enabled $np.egress.enabled }}
{{- if and .Values.ray.cluster.enabled .Values.ray.models.prefetch (not $np.egress.internet.cidrs) }}
{{- fail "networkPolicy.egress: ray.models.prefetch downloads from the Hugging Face Hub, so set networkPolicy.egress.internet.cidrs (e.g. [0.0.0.0/0]; link-local stays excepted) or networkPolicy.egress.enabled=false" }}
{{- end }}
{{- range $key := list "internet" "kubernetesApi" "externalRedis" }}
{{- /* Rendered for its checks only (a link-local CIDR fails). */}}
{{- $_ := include "kpo.ipBlockPeers" (dict "cidrs" ((get $np.egress $key).cidrs | default list) "where" (printf "networkPolicy.egress.%s.cidrs" $key)) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The egress rule to the cluster's DNS server (networkPolicy.dns), UDP and TCP 53; none when the
values name no server (a rule without peers would open port 53 to every address).
*/}}
{{- define "kpo.dnsEgressRule" -}}
{{- $dns := .Values.networkPolicy.dns }}
{{- $peers := include "kpo.networkPolicyPeer" $dns }}
{{- if or $peers $dns.extraTo }}
- to:
    {{- with $peers }}
    {{- . | nindent 4 }}
    {{- end }}
    {{- with $dns.extraTo }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  ports:
    - port: 53
      protocol: UDP
    - port: 53
      protocol: TCP
{{- end }}
{{- end }}

{{/*
The port of redis.external.url (6379 when it names none), for the egress rules to it.
*/}}
{{- define "kpo.externalRedisPort" -}}
{{- $hostPort := regexReplaceAll "^rediss?://([^/]*).*$" .Values.redis.external.url "${1}" }}
{{- if regexMatch ":[0-9]+$" $hostPort }}
{{- regexReplaceAll "^.*:([0-9]+)$" $hostPort "${1}" }}
{{- else }}6379
{{- end }}
{{- end }}

{{/*
The egress rule to the store: the built-in Redis' pods, or redis.external.url's port on
networkPolicy.egress.externalRedis.cidrs (default any address, link-local excepted).
*/}}
{{- define "kpo.storeEgressRule" -}}
{{- if .Values.redis.builtin.enabled }}
- to:
    - podSelector:
        matchLabels:
          {{- include "kpo.selectorLabels" (dict "ctx" . "component" "redis") | nindent 10 }}
  ports:
    - port: 6379
      protocol: TCP
{{- else }}
- to:
    {{- include "kpo.ipBlockPeers" (dict "cidrs" (.Values.networkPolicy.egress.externalRedis.cidrs | default (list "0.0.0.0/0")) "where" "networkPolicy.egress.externalRedis.cidrs") | trim | nindent 4 }}
  ports:
    - port: {{ include "kpo.externalRedisPort" . }}
      protocol: TCP
{{- end }}
{{- end }}

{{/*
The port of the Ray job server the control plane submits to: 8265 (the chart's head), or
ray.address's port (80 or 443 by its scheme when it names none).
*/}}
{{- define "kpo.rayJobServerPort" -}}
{{- if .Values.ray.cluster.enabled }}8265
{{- else }}
{{- $hostPort := regexReplaceAll "^https?://([^/]*).*$" .Values.ray.address "${1}" }}
{{- if regexMatch ":[0-9]+$" $hostPort }}
{{- regexReplaceAll "^.*:([0-9]+)$" $hostPort "${1}" }}
{{- else if hasPrefix "https://" .Values.ray.address }}443
{{- else }}80
{{- end }}
{{- end }}
{{- end }}
