"""A job as data: its parsed spec, what the operator remembers (round-tripped through .status), names of what it
creates."""
