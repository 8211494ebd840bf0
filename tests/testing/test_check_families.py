"""CHECKS is put together from one Family per module of execbox.testing.checks: none may be left out or shadowed."""

from __future__ import annotations

import importlib
import pkgutil

import execbox.testing.checks as checks
from execbox.testing.framework import Family


def test_every_family_module_is_listed_and_every_check_runs_once() -> None:
    modules = [info.name for info in pkgutil.iter_modules(checks.__path__)]
    families = {name: importlib.import_module(f"{checks.__name__}.{name}").family for name in modules}
    assert all(isinstance(family, Family) and family.checks for family in families.values()), families
    # A family module missing from FAMILIES would have its checks silently never run.
    assert sorted(map(id, checks.FAMILIES)) == sorted(map(id, families.values())), modules
    names = [one.name for family in checks.FAMILIES for one in family.checks]
    assert sorted(names) == sorted(set(names)), "two checks share a name: one would shadow the other in CHECKS"
    assert list(checks.CHECKS) == names
