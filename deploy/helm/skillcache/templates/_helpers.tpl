{{/* Names */}}
{{- define "skillcache.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "skillcache.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "skillcache.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "skillcache.selectorLabels" -}}
app.kubernetes.io/name: {{ include "skillcache.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "skillcache.labels" -}}
helm.sh/chart: {{ include "skillcache.chart" . }}
{{ include "skillcache.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "skillcache.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "skillcache.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "skillcache.image" -}}
{{- $variant := ternary "cuda" "cpu" (.Values.gpu.enabled | default false) }}
{{- $tag := .Values.image.tag | default (printf "%s-%s" .Chart.AppVersion $variant) }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}

{{/* Redis: "true" when the chart runs its own Redis. */}}
{{- define "skillcache.redis.bundled" -}}
{{- if and (eq .Values.store "redis") .Values.redis.enabled (not .Values.redis.external.url) (not .Values.redis.external.existingSecret) -}}
true
{{- end }}
{{- end }}

{{- define "skillcache.redis.fullname" -}}
{{- printf "%s-redis" (include "skillcache.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "skillcache.redis.selectorLabels" -}}
app.kubernetes.io/name: {{ include "skillcache.name" . }}-redis
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "skillcache.redis.labels" -}}
helm.sh/chart: {{ include "skillcache.chart" . }}
{{ include "skillcache.redis.selectorLabels" . }}
app.kubernetes.io/component: store
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* The Redis URL when it is not a secret (bundled Redis or redis.external.url); empty otherwise. */}}
{{- define "skillcache.redis.url" -}}
{{- if include "skillcache.redis.bundled" . -}}
redis://{{ include "skillcache.redis.fullname" . }}:6379/0
{{- else if .Values.redis.external.url -}}
{{ .Values.redis.external.url }}
{{- end }}
{{- end }}

{{/* API keys: the Secret name to mount, or empty when no keys file is configured. */}}
{{- define "skillcache.apiKeys.secretName" -}}
{{- if .Values.apiKeys.existingSecret -}}
{{ .Values.apiKeys.existingSecret }}
{{- else if .Values.apiKeys.keys -}}
{{ include "skillcache.fullname" . }}-api-keys
{{- end }}
{{- end }}

{{/* Replicas the PDB can count on: the HPA floor when autoscaling, else replicaCount. */}}
{{- define "skillcache.minReplicas" -}}
{{- if .Values.autoscaling.enabled -}}
{{ .Values.autoscaling.minReplicas | int }}
{{- else -}}
{{ .Values.replicaCount | int }}
{{- end }}
{{- end }}

{{/* vLLM's topology (vllm.enabled): "true" for the one in use, empty for the other. */}}
{{- define "skillcache.vllm.sidecar" -}}
{{- if and .Values.vllm.enabled (eq (toString .Values.vllm.topology) "sidecar") -}}
true
{{- end }}
{{- end }}

{{- define "skillcache.vllm.statefulset" -}}
{{- if and .Values.vllm.enabled (eq (toString .Values.vllm.topology) "statefulset") -}}
true
{{- end }}
{{- end }}

{{/* The vLLM tier (vllm.topology=statefulset): the StatefulSet's and its headless Service's name. */}}
{{- define "skillcache.vllm.fullname" -}}
{{- printf "%s-vllm" (include "skillcache.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Not skillcache's selector labels: the Deployment, its Service and its PDB must not select vLLM's pods. */}}
{{- define "skillcache.vllm.selectorLabels" -}}
app.kubernetes.io/name: {{ include "skillcache.name" . }}-vllm
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "skillcache.vllm.labels" -}}
helm.sh/chart: {{ include "skillcache.chart" . }}
{{ include "skillcache.vllm.selectorLabels" . }}
app.kubernetes.io/component: engine
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* SKILLCACHE_VLLM_URL: the sidecar on the pod's loopback, or every replica of the tier by its own DNS name (pod
i of the StatefulSet under its headless Service), 0..N-1. skillcache routes each composition to one replica by a
rendezvous hash of its digest and fails over to the next one, so each replica must be addressable on its own: a
load-balancing Service in front of them would undo the routing. */}}
{{- define "skillcache.vllm.url" -}}
{{- if include "skillcache.vllm.statefulset" . -}}
{{- $name := include "skillcache.vllm.fullname" . }}
{{- $urls := list }}
{{- range $i := until (.Values.vllm.replicas | int) }}
{{- $urls = append $urls (printf "http://%s-%d.%s.%s.svc.%s:%d" $name $i $name $.Release.Namespace $.Values.vllm.clusterDomain ($.Values.vllm.port | int)) }}
{{- end }}
{{- join "," $urls }}
{{- else -}}
{{ printf "http://127.0.0.1:%d" (.Values.vllm.port | int) }}
{{- end }}
{{- end }}

{{/* vLLM's initContainer `connector` (both topologies): skillcache's service package, copied from its image. */}}
{{- define "skillcache.vllm.connectorInit" -}}
# vLLM imports skillcache's KV connector (service.vllm.connector and the service modules it imports, which
# need only vLLM's own dependencies: torch, transformers, safetensors, pydantic): the service package is
# copied from this image, so vLLM runs the connector of the same release.
- name: connector
  image: {{ include "skillcache.image" . | quote }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command:
    - python
    - -c
    - |
      import pathlib, shutil, service
      src, dst = pathlib.Path(service.__file__).parent, pathlib.Path("/connector/service")
      shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
  resources:
    requests:
      cpu: 50m
      memory: 64Mi
    limits:
      memory: 256Mi
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
  volumeMounts:
    - name: connector
      mountPath: /connector
{{- end }}

{{/*
The vllm container, one spec for both topologies. Called with a dict:
  root:  the chart's context
  host:  what vLLM listens on. Sidecar: 127.0.0.1, the pod's loopback (skillcache is in the same pod, and vLLM's API
         has no keys). StatefulSet: 0.0.0.0, the pod IP, which skillcache's pods reach (its NetworkPolicy admits only
         them).
  serve: StatefulSet: a named container port (the headless Service's target) and a readiness probe (the StatefulSet's
         rollout and the PDB count Ready pods; in a sidecar skillcache's /readyz covers vLLM).
The model: vllm.model when set, else the one folder under <persistence.mountPath>/models of the `data` volume, which
skillcache converts (sidecar: the pod's data volume, shared) or the initContainer `model` converts (StatefulSet: the
vLLM pod's own volume).
*/}}
{{- define "skillcache.vllm.container" -}}
{{- $root := .root }}
{{- $v := $root.Values.vllm }}
{{- $vllmHealth := printf "import urllib.request; urllib.request.urlopen('http://127.0.0.1:%d/health', timeout=4)" ($v.port | int) -}}
- name: vllm
  image: "{{ $v.image.repository }}:{{ $v.image.tag }}"
  imagePullPolicy: {{ $v.image.pullPolicy }}
  command:
    - /bin/sh
    - -c
    - |
      set -eu
      m="${MODEL_DIR:-}"
      if [ -z "$m" ]; then
        until ls "$MODELS_ROOT"/*/config.json >/dev/null 2>&1; do
          echo "vllm: waiting for skillcache to convert the model into $MODELS_ROOT"; sleep 5
        done
        n=0
        for f in "$MODELS_ROOT"/*/config.json; do n=$((n + 1)); m="${f%/config.json}"; done
        if [ "$n" -gt 1 ]; then
          echo "vllm: $n models in $MODELS_ROOT; set vllm.model to the one SKILLCACHE_MODEL names" >&2; exit 1
        fi
      fi
      until [ -f "$m/config.json" ]; do echo "vllm: waiting for $m/config.json"; sleep 5; done
      exec python3 -m vllm.entrypoints.openai.api_server --model "$m" "$@"
    - vllm
  args:
    - --served-model-name
    - skillcache
    - --host
    - {{ .host }}
    - --port
    - {{ $v.port | quote }}
    - --dtype
    - {{ $v.dtype | quote }}
    - --enable-prompt-tokens-details
    - --disable-uvicorn-access-log
    # service/vllm/launch.py, connector_config() and command(): the connector, its spans on the spans
    # emptyDir, a failed load recomputed; priority scheduling puts skillcache's background work last
    - --kv-transfer-config
    - {{ dict "kv_connector" "SkillcacheConnector" "kv_connector_module_path" "service.vllm.connector" "kv_role" "kv_both" "kv_load_failure_policy" "recompute" "kv_connector_extra_config" (dict "spans_dir" "/spans") | toJson | quote }}
    - --scheduling-policy
    - priority
    {{- range $v.extraArgs }}
    - {{ . | quote }}
    {{- end }}
  {{- if .serve }}
  ports:
    - name: http
      containerPort: {{ $v.port | int }}
      protocol: TCP
  {{- end }}
  env:
    - name: PYTHONPATH
      value: /opt/skillcache
    - name: HOME
      value: /home/vllm
    - name: MODEL_DIR
      value: {{ $v.model | quote }}
    - name: MODELS_ROOT
      value: {{ printf "%s/models" $root.Values.persistence.mountPath | quote }}
    {{- if $v.sharedSpans }}
    # the connector's shared tier (service/vllm/spans.py, remote_tier): the store's Redis, as skillcache's
    - name: SPANS_REDIS_URL
      {{- if $root.Values.redis.external.existingSecret }}
      valueFrom:
        secretKeyRef:
          name: {{ $root.Values.redis.external.existingSecret }}
          key: {{ $root.Values.redis.external.existingSecretKey }}
      {{- else }}
      value: {{ include "skillcache.redis.url" $root | quote }}
      {{- end }}
    {{- end }}
    {{- with $v.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  startupProbe:
    exec:
      command: ["python3", "-c", {{ $vllmHealth | quote }}]
    periodSeconds: {{ $v.probes.startup.periodSeconds }}
    timeoutSeconds: {{ $v.probes.startup.timeoutSeconds }}
    failureThreshold: {{ $v.probes.startup.failureThreshold }}
  {{- if .serve }}
  readinessProbe:
    exec:
      command: ["python3", "-c", {{ $vllmHealth | quote }}]
    periodSeconds: {{ $v.probes.readiness.periodSeconds }}
    timeoutSeconds: {{ $v.probes.readiness.timeoutSeconds }}
    failureThreshold: {{ $v.probes.readiness.failureThreshold }}
  {{- end }}
  livenessProbe:
    exec:
      command: ["python3", "-c", {{ $vllmHealth | quote }}]
    periodSeconds: {{ $v.probes.liveness.periodSeconds }}
    timeoutSeconds: {{ $v.probes.liveness.timeoutSeconds }}
    failureThreshold: {{ $v.probes.liveness.failureThreshold }}
  lifecycle:
    preStop:
      # Outlive skillcache's drain: its in-flight requests are generated here.
      exec:
        command: ["sleep", {{ $v.drainSeconds | toString | quote }}]
  {{- with $v.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- toYaml $v.securityContext | nindent 4 }}
  volumeMounts:
    - name: data
      mountPath: {{ $root.Values.persistence.mountPath }}
      readOnly: true
    - name: spans
      mountPath: /spans
    - name: connector
      mountPath: /opt/skillcache
      readOnly: true
    - name: vllm-home
      mountPath: /home/vllm
    - name: dshm
      mountPath: /dev/shm
    {{- with $v.extraVolumeMounts }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end }}

{{/* The vllm container's own volumes (both topologies; `data` is the pod's). */}}
{{- define "skillcache.vllm.volumes" -}}
# the spans vLLM's connector saves and loads: memory-backed, the vllm container's only
- name: spans
  emptyDir:
    medium: Memory
    {{- with .Values.vllm.spansSizeLimit }}
    sizeLimit: {{ . }}
    {{- end }}
- name: connector
  emptyDir: {}
- name: vllm-home
  emptyDir: {}
- name: dshm
  emptyDir:
    medium: Memory
    {{- with .Values.vllm.shmSizeLimit }}
    sizeLimit: {{ . }}
    {{- end }}
{{- end }}

{{/* The GPU toleration's condition for vLLM's pods: vllm.resources asks for gpu.resourceName. */}}
{{- define "skillcache.vllm.gpu" -}}
{{- if hasKey (dig "limits" (dict) (.Values.vllm.resources | default dict)) .Values.gpu.resourceName -}}
true
{{- end }}
{{- end }}
