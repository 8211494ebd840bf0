"""The backend toolkit: the pieces backends share (files and transfers, processes and their reaper, ownership
for gc, the probe cache, host and remote sessions, the egress proxy, packages). Plugins reach it through
execbox.plugin."""
