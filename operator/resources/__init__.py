"""What the operator writes to Kubernetes: manifests of pods, Services, Secrets and budgets, and the idempotent API
calls."""
