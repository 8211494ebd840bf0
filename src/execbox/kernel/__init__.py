"""The persistent interpreter of run_cell: the host-side client, and the payload it sends into the sandbox."""
