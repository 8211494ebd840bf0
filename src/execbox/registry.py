"""The backend registry: pluggy, the entry-point group ``execbox``, loaded lazily and once.

Built-in backends register through the same hook as third-party ones. A plugin that fails to import is
a warning naming its distribution, never a crash of the host program.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from importlib.metadata import entry_points

import pluggy

from execbox.core import hookspecs
from execbox.core.backend import ExecutionBackend
from execbox.core.errors import ConfigError, PluginError
from execbox.core.hookspecs import PluginWarning

ENTRY_POINT_GROUP = "execbox"
BUILTIN_DISTRIBUTION = "execbox"
_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")


@dataclass(frozen=True)
class BackendEntry:
    name: str
    cls: type[ExecutionBackend]
    distribution: str


@dataclass
class Registry:
    backends: dict[str, BackendEntry] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    #: The plugin manager, for hooks other than backend registration (execbox_review_command).
    pm: pluggy.PluginManager | None = field(default=None, repr=False)

    def get(self, name: str) -> BackendEntry:
        try:
            return self.backends[name]
        except KeyError:
            known = ", ".join(sorted(self.backends)) or "(none)"
            raise ConfigError(
                f"unknown backend {name!r}; registered backends: {known}. "
                "Set CODE_EXEC_BACKEND (or --backend) to one of them, or install the plugin that provides it.",
                env_var="CODE_EXEC_BACKEND",
            ) from None

    def names(self) -> list[str]:
        return sorted(self.backends)


_cache: dict[tuple[tuple[str, ...] | None, tuple[str, ...]], Registry] = {}


def get_registry(load: list[str] | None = None, disable: list[str] | None = None) -> Registry:
    """The registry for this plugin selection, built on first use."""
    key = (tuple(load) if load is not None else None, tuple(disable or ()))
    if key not in _cache:
        _cache[key] = _build(load, disable or [])
    return _cache[key]


def _selected(ep_name: str, dist: str, load: list[str] | None, disable: list[str]) -> bool:
    names = {ep_name, dist}
    if names & set(disable):
        return False
    return load is None or bool(names & set(load))


def _warn(registry: Registry, message: str) -> None:
    registry.problems.append(message)
    warnings.warn(message, PluginWarning, stacklevel=3)


def _build(load: list[str] | None, disable: list[str]) -> Registry:
    from execbox import backends as builtin

    registry = Registry()
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    registry.pm = pm
    distributions = {BUILTIN_DISTRIBUTION: BUILTIN_DISTRIBUTION}
    pm.register(builtin, name=BUILTIN_DISTRIBUTION)

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist.name if ep.dist else "unknown distribution"
        if not _selected(ep.name, dist, load, disable):
            continue
        plugin_name = f"{dist}:{ep.name}"
        try:
            plugin = ep.load()
        except Exception as exc:  # a broken plugin must not take the host program down
            _warn(registry, f"execbox plugin {ep.name!r} from distribution {dist!r} failed to import: {exc!r}")
            continue
        try:
            pm.register(plugin, name=plugin_name)
            pm.check_pending()  # a misspelled hook name is an error, not a silent no-op
            if not pm.get_hookcallers(plugin):
                raise PluginError("it implements no execbox hook (is @execbox.hookimpl missing on "
                                  "execbox_register_backends?)")
        except Exception as exc:
            if pm.is_registered(plugin):
                pm.unregister(plugin)
            _warn(registry, f"execbox plugin {ep.name!r} from distribution {dist!r} is invalid: {exc}")
            continue
        distributions[plugin_name] = dist

    if load:
        seen = {name for ep in entry_points(group=ENTRY_POINT_GROUP)
                for name in (ep.name, ep.dist.name if ep.dist else "")}
        for name in sorted(set(load) - seen):
            _warn(registry, f"EXECBOX_LOAD_PLUGINS names {name!r}, but no installed plugin has that entry-point "
                            "or distribution name")

    for impl in pm.hook.execbox_register_backends.get_hookimpls():
        dist = distributions.get(impl.plugin_name, impl.plugin_name)

        def register(cls: type[ExecutionBackend], _dist: str = dist) -> None:
            _add(registry, cls, _dist)

        try:
            impl.function(register=register)
        except PluginError:
            raise
        except Exception as exc:
            _warn(registry, f"execbox plugin from distribution {dist!r} failed while registering backends: {exc!r}")
    return registry


def _add(registry: Registry, cls: type[ExecutionBackend], dist: str) -> None:
    if not (isinstance(cls, type) and issubclass(cls, ExecutionBackend)):
        raise PluginError(f"distribution {dist!r} registered {cls!r}, which is not an ExecutionBackend subclass")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise PluginError(f"backend class {cls.__qualname__} from {dist!r} needs a class-level name like 'my_backend'")
    if not hasattr(cls, "capabilities"):
        raise PluginError(f"backend {name!r} from {dist!r} declares no class-level capabilities")
    existing = registry.backends.get(name)
    if existing is not None:
        raise PluginError(
            f"two backends are named {name!r}: one from distribution {existing.distribution!r}, one from {dist!r}. "
            "Uninstall one, or disable one with EXECBOX_DISABLE_PLUGINS."
        )
    registry.backends[name] = BackendEntry(name, cls, dist)
