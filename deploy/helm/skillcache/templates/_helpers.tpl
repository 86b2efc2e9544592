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
