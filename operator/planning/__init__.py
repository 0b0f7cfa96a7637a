"""The pure planner (no I/O): failure rules and budgets, restarts, migration off degrading nodes, why groups cannot
start, goodput."""
