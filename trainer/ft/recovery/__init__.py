"""Getting state back: live recovery from a healthy peer (transport, codec, checks) and durable checkpoints of a
session."""
