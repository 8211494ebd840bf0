"""Policy: the rules a run is held to that are not a backend's business - network egress allowlists, the
environment a sandboxed command may see, the syscall deny list."""
