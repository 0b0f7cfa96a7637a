{{/* The chart's short name. */}}
{{- define "ftjob.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Release-unique name for every object; cluster-scoped objects (ClusterRole...) get it too, so two releases never clash. */}}
{{- define "ftjob.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "ftjob.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "ftjob.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ftjob.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "ftjob.labels" -}}
helm.sh/chart: {{ include "ftjob.chart" . }}
{{ include "ftjob.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: ftjob
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "ftjob.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "ftjob.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name must name an existing ServiceAccount when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "ftjob.leaseName" -}}
{{- default (printf "%s-leader" (include "ftjob.fullname" .)) .Values.leaderElection.leaseName }}
{{- end }}

{{- define "ftjob.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* Namespaces that get a NetworkPolicy for lighthouse pods: explicit list, else the watched ones, else the release's. */}}
{{- define "ftjob.networkPolicyNamespaces" -}}
{{- $ns := .Values.networkPolicy.namespaces | default .Values.watchNamespaces | default (list .Release.Namespace) }}
{{- toJson $ns }}
{{- end }}

{{/* Refuses combinations the schema cannot express, with what to change. */}}
{{- define "ftjob.validate" -}}
{{- if and (gt (int .Values.replicaCount) 1) (not .Values.leaderElection.enabled) }}
{{- fail (printf "replicaCount=%d needs leaderElection.enabled=true: without a Lease every replica would act on the same jobs. Set leaderElection.enabled=true or replicaCount=1." (int .Values.replicaCount)) }}
{{- end }}
{{- if eq (int .Values.metrics.port) (int .Values.health.port) }}
{{- fail (printf "metrics.port and health.port are both %d: give them different ports." (int .Values.health.port)) }}
{{- end }}
{{- end }}
