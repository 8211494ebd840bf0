"""Shared fixtures: every test starts from a clean execbox environment."""

from __future__ import annotations

import os

import pytest

_KEEP = {"EXECBOX_REQUIRE_ENGINES"}


@pytest.fixture(autouse=True)
def _clean_execbox_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No CODE_EXEC_* / EXECBOX_* knob of the developer's shell leaks into a test."""
    for name in list(os.environ):
        if (name.startswith(("CODE_EXEC_", "EXECBOX_")) or name == "SHELL_BACKEND") and name not in _KEEP:
            monkeypatch.delenv(name)


@pytest.fixture(autouse=True)
def _private_audit_log(_clean_execbox_env: None, tmp_path_factory: pytest.TempPathFactory,
                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The audit log (and its failure notes) of every test go to a fresh state dir, never the developer's."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path_factory.mktemp("state")))
