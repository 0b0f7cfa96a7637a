{{/* What the operator does in the namespaces it watches: exactly the rows of docs/operations/rbac.md. */}}
{{- define "ftjob.jobRules" -}}
# kopf watches the jobs; ttlSecondsAfterFinished deletes finished ones. The operator never edits a job's spec.
- apiGroups: ["ftjob.dev"]
  resources: ["faulttoleranttrainingjobs"]
  verbs: ["get", "list", "watch", "delete"]
- apiGroups: ["ftjob.dev"]
  resources: ["faulttoleranttrainingjobs/status"]
  verbs: ["patch"]
# Children carry blockOwnerDeletion owner references: allowed where OwnerReferencesPermissionEnforcement is on.
- apiGroups: ["ftjob.dev"]
  resources: ["faulttoleranttrainingjobs/finalizers"]
  verbs: ["update"]
# Worker and lighthouse pods: indexed by a watch, created, deleted (grace 0 for pods on lost nodes). Never patched
# themselves (only one condition of a worker pod's status, below).
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch", "create", "delete"]
# One condition of a worker pod's status: its readiness gate (ftjob.dev/in-quorum), which the job's budget counts.
- apiGroups: [""]
  resources: ["pods/status"]
  verbs: ["patch"]
# One PodDisruptionBudget per job over its worker pods (a drain evicts none in the quorum); patched when it scales.
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["create", "patch"]
# Headless Services for the lighthouse and each group.
- apiGroups: [""]
  resources: ["services"]
  verbs: ["create", "delete"]
# The per-job Secrets: the workers' and the operator's lighthouse tokens and the TLS Secret (CA + certificates), each
# created once and read back by name. No list/watch: no other Secret is visible.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create", "get"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end }}

{{/* Read-only and cluster-scoped: node readiness (a group on a NotReady or deleted node is replaced at once). */}}
{{- define "ftjob.clusterReadRules" -}}
- apiGroups: [""]
  resources: ["nodes"]
  verbs: ["list", "watch"]
{{- if gt (int .Values.nodeHealth.cordonAfterFailures) 0 }}
# Opt-in (nodeHealth.cordonAfterFailures): cordon a node after K replica-group failures on it (spec.unschedulable only).
- apiGroups: [""]
  resources: ["nodes"]
  verbs: ["patch"]
{{- end }}
{{- end }}
