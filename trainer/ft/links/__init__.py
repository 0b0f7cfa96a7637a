"""How a rank reaches the lighthouse: the group's lighthouse client, its errors, the watch socket link and the in-group
link."""
