"""execbox where its users already are: an inspect_ai sandbox environment, agent-framework executors.

Each module is a page of code over execbox's public API (``import execbox``) and needs its own extra; importing
one without it raises MissingExtraError with the ``pip install`` line (``missing_extra``).
"""

from __future__ import annotations

from execbox.errors import MissingExtraError


def missing_extra(module: str, framework: str, extra: str, exc: ImportError) -> MissingExtraError:
    """What importing ``module`` without its framework raises: the error a backend without its SDK gives."""
    return MissingExtraError(f"{module} needs {framework} ({exc.name} is not installed)", extra=extra,
                             fix=f"pip install 'execbox[{extra}]'")
