"""An integration imported without its framework says which extra to install, as an ExecboxError."""

from __future__ import annotations

import importlib
import sys

import pytest

from execbox import MissingExtraError


@pytest.mark.parametrize(("module", "framework", "extra"), [
    ("execbox.integrations.smolagents", "smolagents", "smolagents"),
    ("execbox.integrations.pydantic_ai", "pydantic_ai", "pydantic-ai"),
    ("execbox.integrations.inspect_ai", "inspect_ai", "inspect"),
])
def test_without_the_framework_the_error_names_the_extra(module: str, framework: str, extra: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in sys.modules if n == framework or n.startswith(f"{framework}.")] + [framework]:
        monkeypatch.setitem(sys.modules, name, None)  # None: "not installed" to the import system
    monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(MissingExtraError, match=rf"pip install 'execbox\[{extra}\]'") as raised:
        importlib.import_module(module)
    assert raised.value.extra == extra and raised.value.present is None  # a backend's missing SDK says the same
