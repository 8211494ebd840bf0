"""Testing helpers for execbox and for backend authors.

- ``engine_missing(reason)``: a test that needs a real engine (docker, sshd, bubblewrap) calls it when the
  engine is absent: it skips with the reason on a laptop and FAILS when CI is set (``CI=true``) or
  ``EXECBOX_REQUIRE_ENGINES=1``, so a green CI never hides a skipped sandbox test.
- ``BackendConformance`` (in ``execbox.testing.conformance``): the conformance kit; subclass it in a test
  module and give it a ``runner`` fixture.
"""

from __future__ import annotations

import os
from typing import NoReturn


def engines_required() -> bool:
    return os.environ.get("CI", "").lower() in ("true", "1") or os.environ.get("EXECBOX_REQUIRE_ENGINES") == "1"


def engine_missing(reason: str) -> NoReturn:
    import pytest

    if engines_required():
        pytest.fail(f"a required engine is missing (CI must not skip this): {reason}", pytrace=False)
    pytest.skip(reason)


__all__ = ["engine_missing", "engines_required"]
