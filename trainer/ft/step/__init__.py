"""The step protocol: the per-rank Manager, the session a process belongs to, what a group's ranks tell each other,
SIGTERM."""
