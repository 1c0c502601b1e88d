{{/* Object names: "<release>-vgrpo", or the release name when it already contains "vgrpo". */}}
{{- define "vgrpo.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "vgrpo.labels" -}}
app.kubernetes.io/name: {{ default .Chart.Name .Values.nameOverride }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Labels on Ray pods; the PodMonitor and the Redis NetworkPolicy select on them. */}}
{{- define "vgrpo.rayPodLabels" -}}
app.kubernetes.io/name: {{ default .Chart.Name .Values.nameOverride }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: ray
{{- end -}}

{{- define "vgrpo.redisSelector" -}}
app.kubernetes.io/name: {{ default .Chart.Name .Values.nameOverride }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: redis
{{- end -}}

{{- define "vgrpo.rayTokenSecret" -}}
{{- default (printf "%s-ray-token" (include "vgrpo.fullname" .)) .Values.ray.auth.existingSecret -}}
{{- end -}}

{{- define "vgrpo.redisPasswordSecret" -}}
{{- default (printf "%s-redis" (include "vgrpo.fullname" .)) .Values.redis.auth.existingSecret -}}
{{- end -}}

{{/* Fail on a Service type reachable from outside the cluster unless allowed on purpose. */}}
{{- define "vgrpo.checkServiceType" -}}
{{- $type := index . 0 -}}{{- $allowed := index . 1 -}}{{- $field := index . 2 -}}
{{- if not (has $type (list "ClusterIP" "NodePort" "LoadBalancer")) -}}
{{- fail (printf "%s: %q is not a Service type; use ClusterIP" $field $type) -}}
{{- end -}}
{{- if and (ne $type "ClusterIP") (not $allowed) -}}
{{- fail (printf "%s=%s would expose it outside the cluster; keep ClusterIP and use kubectl port-forward, or set %s.allowPublicService=true on purpose" $field $type (trimSuffix ".type" (trimSuffix ".serviceType" $field))) -}}
{{- end -}}
{{- end -}}

{{/* Env for every Ray container: the pool name for metrics and the Redis URL from a Secret. */}}
{{- define "vgrpo.rayEnv" -}}
{{- $root := index . 0 -}}{{- $pool := index . 1 -}}
- name: VGRPO_POOL
  value: {{ $pool | quote }}
{{- if eq $root.Values.redis.mode "external" }}
- name: VGRPO_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ required "redis.external.existingSecret is required when redis.mode=external" $root.Values.redis.external.existingSecret }}
      key: {{ $root.Values.redis.external.urlKey }}
{{- else }}
- name: VGRPO_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "vgrpo.redisPasswordSecret" $root }}
      key: {{ $root.Values.redis.auth.passwordKey }}
- name: VGRPO_REDIS_URL
  value: {{ printf "redis://:$(VGRPO_REDIS_PASSWORD)@%s-redis.%s.svc:6379/0" (include "vgrpo.fullname" $root) $root.Release.Namespace | quote }}
{{- end }}
{{- if include "vgrpo.objectStore" $root }}
{{- $o := $root.Values.objectStorage }}
- name: VGRPO_CACHE_DIR
  value: /tmp/vgrpo-cache
{{- with $o.existingSecret }}
- name: AWS_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $o.accessKeyIdKey }}
- name: AWS_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $o.secretAccessKeyKey }}
{{- end }}
{{- with $o.endpoint }}
- name: AWS_ENDPOINT_URL
  value: {{ . | quote }}
{{- end }}
{{- with $o.region }}
- name: AWS_DEFAULT_REGION
  value: {{ . | quote }}
{{- end }}
{{- end }}
{{- with $root.Values.ray.env }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* "true" when config.run.root is an object-store URI (s3://…): no run-storage PVC then. */}}
{{- define "vgrpo.objectStore" -}}
{{- if regexMatch "^[a-zA-Z][a-zA-Z0-9+.-]*://" (.Values.config.run.root | default "") -}}
{{- if not (hasPrefix "s3://" .Values.config.run.root) -}}
{{- fail (printf "config.run.root: %q: the chart wires s3:// object storage (objectStorage.*); for another store set its credentials through ray.env" .Values.config.run.root) -}}
{{- end -}}
true
{{- end -}}
{{- end -}}

{{/* The run-directory PVC: the user's, or the one this chart creates. */}}
{{- define "vgrpo.runsClaim" -}}
{{- default (printf "%s-runs" (include "vgrpo.fullname" .)) .Values.runStorage.existingClaim -}}
{{- end -}}

{{/* Where run directories live in every Ray container: config.run.root, an absolute path. */}}
{{- define "vgrpo.runRoot" -}}
{{- $root := .Values.config.run.root | default "/var/lib/vgrpo/runs" -}}
{{- if not (hasPrefix "/" $root) -}}
{{- fail (printf "config.run.root: %q must be an absolute path (the runStorage PVC is mounted there) or an s3:// URI (objectStorage.*)" $root) -}}
{{- end -}}
{{- $root -}}
{{- end -}}

{{/* Volumes and mounts shared by head and workers. Every Ray pod mounts the run storage:
     the driver (head) and the learner ranks (any group) all write run directories; with an
     s3:// run.root they write to the object store instead (staging under /tmp). */}}
{{- define "vgrpo.rayVolumes" -}}
- name: config
  configMap:
    name: {{ include "vgrpo.fullname" . }}-config
{{- if not (include "vgrpo.objectStore" .) }}
- name: runs
  persistentVolumeClaim:
    claimName: {{ include "vgrpo.runsClaim" . }}
{{- end }}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.ray.shmSize }}
- name: tmp
  emptyDir: {}
{{- with .Values.ray.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "vgrpo.rayMounts" -}}
- name: config
  mountPath: /etc/vgrpo
  readOnly: true
{{- if not (include "vgrpo.objectStore" .) }}
- name: runs
  mountPath: {{ include "vgrpo.runRoot" . }}
{{- end }}
- name: dshm
  mountPath: /dev/shm
- name: tmp
  mountPath: /tmp
{{- with .Values.ray.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end -}}
