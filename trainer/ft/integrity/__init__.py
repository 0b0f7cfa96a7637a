"""Integrity: the gradient guard and its sketches, state digests, the Manager's integrity duties, and test fault
injection."""
