"""The operator process: command line, settings, leader election, health and metrics endpoints, kopf start-up."""
