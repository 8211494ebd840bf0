"""Secrets: what a secret is, how it reaches the command (env, file, stdin) and how its value is redacted from
everything that comes back; secrets at egress as a caller gives them (destinations checked, placeholders made).
"""
