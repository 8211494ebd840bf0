"""What the three remote-SDK fakes share: the call record and putting a fake under the SDK's import name."""

from __future__ import annotations

import contextlib
import importlib.machinery
import sys
import threading
import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Call:
    """One call the code under test made into the fake SDK, with exactly the arguments it passed."""

    name: str
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    #: The sandbox an instance method was called on (its id or name), None for module/class-level calls.
    on: str | None = None


class Service:
    """The fake provider: its state (sandboxes, accepted credentials) and every call made to it."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.lock = threading.RLock()

    def record(self, call: str, /, *args: Any, **kwargs: Any) -> None:
        with self.lock:
            self.calls.append(Call(call, args, dict(kwargs)))

    def record_on(self, target: str, call: str, /, *args: Any, **kwargs: Any) -> None:
        with self.lock:
            self.calls.append(Call(call, args, dict(kwargs), on=target))

    def calls_to(self, name: str) -> list[Call]:
        return [c for c in self.calls if c.name == name]

    def sent(self, needle: str) -> list[Call]:
        """Every recorded call whose arguments contain ``needle`` anywhere (e.g. a credential value)."""
        return [c for c in self.calls if needle in repr((c.args, dict(c.kwargs)))]

    def close(self) -> None:
        """Tear down whatever the fake provider still runs (called when the fake is uninstalled)."""


def module(name: str, doc: str | None, members: Mapping[str, Any]) -> types.ModuleType:
    """A module object named like the SDK's, holding the fake's members."""
    mod = types.ModuleType(name, doc)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    mod.__path__ = []  # a package, so `import sdk.sub` finds the submodules we install
    for key, value in members.items():
        setattr(mod, key, value)
    return mod


@contextlib.contextmanager
def modules_installed(modules: Mapping[str, types.ModuleType]) -> Iterator[None]:
    """Put ``modules`` in sys.modules (so ``import modal`` gets the fake) and restore what was there after."""
    saved = {name: sys.modules.get(name) for name in modules}
    # Submodules of the real SDK that are already imported must not shadow the fake while it is installed.
    roots = {name.split(".")[0] for name in modules}
    shadowed = {n: m for n, m in sys.modules.items() if n.split(".")[0] in roots and n not in modules}
    for name in shadowed:
        del sys.modules[name]
    sys.modules.update(modules)
    try:
        yield
    finally:
        for name in modules:
            if saved[name] is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = saved[name]  # type: ignore[assignment]
        sys.modules.update(shadowed)
