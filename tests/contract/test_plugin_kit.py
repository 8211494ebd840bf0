"""The plugin kit's surface: ``execbox.plugin.__all__`` is every name a third party may use, each a class, function
or constant that explains itself without a module (no whole modules handed out)."""

from __future__ import annotations

import types

import execbox.plugin as plugin


def test_every_name_in_all_resolves() -> None:
    missing = [name for name in plugin.__all__ if not hasattr(plugin, name)]
    assert not missing, f"execbox.plugin.__all__ names what the module does not define: {missing}"
    assert len(set(plugin.__all__)) == len(plugin.__all__), "a name is listed twice in __all__"


def test_the_kit_hands_out_no_module() -> None:
    modules = sorted(name for name, value in vars(plugin).items()
                     if isinstance(value, types.ModuleType) and not name.startswith("_") and name != "annotations")
    assert modules == [], f"execbox.plugin hands out whole modules: {modules}; export their names instead"


def test_every_public_name_is_in_all() -> None:
    public = {name for name, value in vars(plugin).items()
              if not name.startswith("_") and not isinstance(value, types.ModuleType) and name != "annotations"}
    assert public - set(plugin.__all__) == set(), "public names of execbox.plugin missing from __all__"
