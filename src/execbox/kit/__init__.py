"""The backend toolkit: what backends share - processes and their reaper, host and remote sessions, the egress
proxy and its TLS interceptor, ownership for gc, the probe cache, packages, and the moves of files between this
host and a session. Plugins reach it through execbox.plugin."""
