{{/* What the operator does in the namespaces it watches (see operator/RBAC.md). */}}
{{- define "ftjob.jobRules" -}}
- apiGroups: ["ftjob.dev"]
  resources: ["faulttoleranttrainingjobs"]
  verbs: ["get", "list", "watch", "patch", "update", "delete"]
- apiGroups: ["ftjob.dev"]
  resources: ["faulttoleranttrainingjobs/status"]
  verbs: ["get", "patch", "update"]
# Owner references with blockOwnerDeletion need this where OwnerReferencesPermissionEnforcement is on.
- apiGroups: ["ftjob.dev"]
  resources: ["faulttoleranttrainingjobs/finalizers"]
  verbs: ["update"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "create", "delete", "patch"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "list", "watch", "create", "delete"]
# The per-job lighthouse token: created by the operator, read back to call the lighthouse. No list/watch.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "create", "delete"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
- apiGroups: ["events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end }}

{{/* Read-only, cluster-scoped, nothing secret. */}}
{{- define "ftjob.clusterReadRules" -}}
# Node readiness: a group on a NotReady or lost node is replaced.
- apiGroups: [""]
  resources: ["nodes"]
  verbs: ["get", "list", "watch"]
# kopf observes namespaces and CRDs (it degrades with a warning without them).
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
{{- end }}
