{{/* Names and labels shared by every template. */}}
{{- define "lmqtt.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "lmqtt.fullname" -}}
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

{{- define "lmqtt.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "lmqtt.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "lmqtt.selectorLabels" -}}
app.kubernetes.io/name: {{ include "lmqtt.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "lmqtt.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "lmqtt.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{ include "lmqtt.fullname" . }}
{{- else -}}
{{ default "default" .Values.serviceAccount.name }}
{{- end -}}
{{- end -}}

{{- define "lmqtt.secretName" -}}
{{- default (printf "%s-auth" (include "lmqtt.fullname" .)) .Values.auth.existingSecret -}}
{{- end -}}

{{/* How many store groups (docs/groups.md): each first-level topic belongs to one; 1 = one group. */}}
{{- define "lmqtt.storeGroups" -}}
{{- $n := int (ternary .Values.store.groups 1 (hasKey .Values.store "groups")) -}}
{{- if lt $n 1 -}}
{{- fail (printf "store.groups must be at least 1, not %d" $n) -}}
{{- end -}}
{{- $n -}}
{{- end -}}

{{/* The StatefulSet of store group `storeGroupIndex` (the root context merged with that
key): <fullname>-store for one group (as before groups), <fullname>-store-g<i> for several. */}}
{{- define "lmqtt.storeSet" -}}
{{- if eq (include "lmqtt.storeGroups" .) "1" -}}
{{- printf "%s-store" (include "lmqtt.fullname" .) -}}
{{- else -}}
{{- printf "%s-store-g%d" (include "lmqtt.fullname" .) (int .storeGroupIndex) -}}
{{- end -}}
{{- end -}}

{{/* The name group `storeGroupIndex` is started with (--group): store.group.name (default the
release's full name), with -g<i> when there are several. */}}
{{- define "lmqtt.storeGroupName" -}}
{{- $base := .Values.store.group.name | default (include "lmqtt.fullname" .) -}}
{{- if eq (include "lmqtt.storeGroups" .) "1" -}}
{{- $base -}}
{{- else -}}
{{- printf "%s-g%d" $base (int .storeGroupIndex) -}}
{{- end -}}
{{- end -}}

{{/* One group's members (its stable DNS names through the headless Service), comma-separated:
the group's --peers. */}}
{{- define "lmqtt.groupMembers" -}}
{{- $n := int (include "lmqtt.seedReplicas" .) -}}
{{- $full := include "lmqtt.fullname" . -}}
{{- $set := include "lmqtt.storeSet" . -}}
{{- $out := list -}}
{{- range $i := until $n -}}
{{- $out = append $out (printf "%s-%d.%s-store-headless.%s.svc:%d" $set $i $full $.Release.Namespace (int $.Values.store.port)) -}}
{{- end -}}
{{- join "," $out -}}
{{- end -}}

{{/* Every store member's address, what gateways dial (they find each group's primary among its
members): one group's members comma-separated, groups separated by ';' (docs/groups.md). One
member: the only store. */}}
{{- define "lmqtt.storeAddress" -}}
{{- $groups := list -}}
{{- range $g := until (int (include "lmqtt.storeGroups" $)) -}}
{{- $groups = append $groups (include "lmqtt.groupMembers" (merge (dict "storeGroupIndex" $g) (omit $ "storeGroupIndex"))) -}}
{{- end -}}
{{- join ";" $groups -}}
{{- end -}}

{{/* The members a group was installed with, which --peers names: store.group.seedReplicas, or
store.replicas while it is unset. Pods past them join the running group (--join). */}}
{{- define "lmqtt.seedReplicas" -}}
{{- $n := int .Values.store.replicas -}}
{{- if lt $n 1 -}}
{{- fail (printf "store.replicas must be at least 1, not %d" $n) -}}
{{- end -}}
{{- $seed := .Values.store.group.seedReplicas -}}
{{- if kindIs "invalid" $seed -}}
{{- $n -}}
{{- else if lt (int $seed) 2 -}}
{{- fail (printf "store.group.seedReplicas must be at least 2 (the members a group is installed with; a single store is store.replicas 1), not %v" $seed) -}}
{{- else -}}
{{- int $seed -}}
{{- end -}}
{{- end -}}

{{/* Whether seedReplicas is set: the group is scaled online (pods past the seed join it). */}}
{{- define "lmqtt.scalesOnline" -}}
{{- if not (kindIs "invalid" .Values.store.group.seedReplicas) -}}true{{- end -}}
{{- end -}}

{{/* Whether the store runs as a replicated group (more than one member). */}}
{{- define "lmqtt.storeGroup" -}}
{{- if or (gt (int .Values.store.replicas) 1) (gt (int (include "lmqtt.seedReplicas" .)) 1) -}}true{{- end -}}
{{- end -}}

{{/* Whether the release runs with Redis: notify.mode broadcast or precise; native needs none. */}}
{{- define "lmqtt.usesRedis" -}}
{{- if not (has .Values.notify.mode (list "broadcast" "precise" "native")) -}}
{{- fail (printf "notify.mode must be broadcast, precise or native, not %q" .Values.notify.mode) -}}
{{- end -}}
{{- if and (ne (include "lmqtt.storeGroups" .) "1") (ne .Values.notify.mode "native") -}}
{{- fail "store.groups above 1 needs notify.mode=native: a gateway over several store groups hears each group's new data from its stores, not over Redis (docs/groups.md \"The gateway\")" -}}
{{- end -}}
{{- if ne .Values.notify.mode "native" -}}true{{- end -}}
{{- end -}}

{{- define "lmqtt.redisUrl" -}}
{{- if .Values.redis.enabled -}}
redis://{{ include "lmqtt.fullname" . }}-redis.{{ .Release.Namespace }}.svc:6379/0
{{- else -}}
{{- required "redis.url is required when redis.enabled is false (an external Redis for notify and the session registry)" .Values.redis.url -}}
{{- end -}}
{{- end -}}

{{- define "lmqtt.podAnnotations" -}}
checksum/config: {{ include (print .Template.BasePath "/configmap.yaml") . | sha256sum }}
{{- end -}}
