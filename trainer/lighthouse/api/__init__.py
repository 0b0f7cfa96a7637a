"""The lighthouse's HTTP/WebSocket front end: server, authentication, the watch socket and its frames, JSON errors."""
