"""The agent-facing surface: an MCP server (``execbox mcp``), gated by CODE_EXEC_ENABLED.

The ``mcp`` SDK is imported lazily (``execbox[mcp]``): importing this package does not need it.
"""
