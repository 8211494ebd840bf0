"""execbox where its users already are: an inspect_ai sandbox environment, agent-framework executors.

Each module is a page of code over execbox's public API (``import execbox``) and needs its own extra; importing
one without it raises an ExecboxError with the ``pip install`` line.
"""
