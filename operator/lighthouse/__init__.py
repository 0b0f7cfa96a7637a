"""The operator's side of a job's lighthouse: the typed client, the status view it reads, the per-job link and the audit
mirror."""
