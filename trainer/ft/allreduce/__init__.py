"""The cross-group gradient all-reduce: the quorum's process group, gradient buckets and the overlapped average."""
