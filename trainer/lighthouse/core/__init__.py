"""The lighthouse's quorum logic, pure (no I/O, no clock): members, formation, hand-overs, stalls, integrity checks,
state."""
