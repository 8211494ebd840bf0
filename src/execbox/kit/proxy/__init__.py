"""The egress proxy of network mode proxy: the host-side server per sandbox, and secrets at egress (the TLS
interceptor that swaps placeholders for values)."""
