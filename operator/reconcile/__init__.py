"""The per-job reconcile loop: kopf's indexes and handlers wake one reconciler task per job, which observes, plans, acts
and writes status."""
