"""The backend registry: pluggy, the entry-point group ``execbox``, loaded lazily and once.

Built-in backends register through the same hook as third-party ones. A plugin that fails to import is
a warning naming its distribution, never a crash of the host program.

A backend is registered as a class, or by name as ``register("package.module:Class", name="mine")``: then its
module is imported only when that backend is used (``get``) or every backend is listed (``backends``,
``names``), so naming one backend does not import the others (the built-ins register this way).

The command line asks for the plugins' commands (``execbox_register_commands``) only when it needs them: a
command it does not have itself, or the list of all (``execbox --help``).
"""

from __future__ import annotations

import importlib
import re
import warnings
from collections.abc import Collection
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

import pluggy

from execbox.contract import hookspecs
from execbox.contract.backend import ExecutionBackend
from execbox.contract.hookspecs import PluginWarning, Register
from execbox.errors import BackendUnavailableError, ConfigError, ExecboxError, PluginError

if TYPE_CHECKING:
    import click

ENTRY_POINT_GROUP = "execbox"
BUILTIN_DISTRIBUTION = "execbox"
#: The built-in backends' command modules, each a plugin of the hook ``execbox_register_commands``: imported only
#: when the command line asks for the plugins' commands.
BUILTIN_COMMANDS = ["execbox.backends.docker.cli"]
_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")
_REF_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")


@dataclass
class BackendEntry:
    """One registered backend: its class, or for one registered by name the "module:Class" that ``cls`` imports
    (and checks) on first use."""

    name: str
    ref: type[ExecutionBackend] | str
    distribution: str

    @property
    def cls(self) -> type[ExecutionBackend]:
        if not isinstance(self.ref, str):
            return self.ref
        module, _, attr = self.ref.partition(":")
        cls: type[ExecutionBackend] = getattr(importlib.import_module(module), attr)
        _check_class(cls, self.distribution)
        if cls.name != self.name:
            raise PluginError(f"distribution {self.distribution!r} registered backend {self.name!r} as {self.ref}, "
                              f"whose class is named {cls.name!r}")
        self.ref = cls
        return cls

    @property
    def loaded(self) -> bool:
        return not isinstance(self.ref, str)


@dataclass
class Registry:
    #: Every backend, by name, some perhaps not imported yet: read ``backends`` (or ``get``) for loaded entries.
    entries: dict[str, BackendEntry] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    #: Backends registered by name whose class could not be loaded: the error ``get`` raises, every time.
    failed: dict[str, ExecboxError] = field(default_factory=dict)
    #: The plugin manager, for hooks other than backend registration (execbox_review_command).
    pm: pluggy.PluginManager | None = field(default=None, repr=False)
    #: The distribution of each registered plugin, by its name in the plugin manager.
    distributions: dict[str, str] = field(default_factory=dict)
    #: The plugins' commands, once ``commands`` has collected them.
    _commands: dict[str, click.Command] | None = field(default=None, init=False, repr=False)

    @property
    def backends(self) -> dict[str, BackendEntry]:
        """Every backend, each imported: one whose module fails to import is a warning and is left out."""
        for name in list(self.entries):
            self._load(name)
        return self.entries

    def get(self, name: str) -> BackendEntry:
        """The backend ``name``, imported (only it: the others stay as they are)."""
        if name in self.failed:
            raise self.failed[name].with_traceback(None)  # the stored error, its traceback not grown
        if name not in self.entries:
            known = ", ".join(sorted(self.entries)) or "(none)"
            raise ConfigError(
                f"unknown backend {name!r}; registered backends: {known}. "
                "Set CODE_EXEC_BACKEND (or --backend) to one of them, or install the plugin that provides it.",
                env_var="CODE_EXEC_BACKEND",
            )
        entry = self._load(name)
        if entry is None:
            raise self.failed[name].with_traceback(None)  # the stored error, its traceback not grown
        return entry

    def names(self) -> list[str]:
        return sorted(self.backends)

    def commands(self, taken: Collection[str]) -> dict[str, click.Command]:
        """The plugins' commands (hook ``execbox_register_commands``), by name, the built-in backends' first;
        collected once. A name in ``taken`` or already added, or a plugin that fails while adding its commands, is
        a warning and is left out."""
        if self._commands is not None:
            return self._commands
        import click

        self._commands = {}
        if self.pm is None:
            return self._commands
        for module in BUILTIN_COMMANDS:
            try:
                self.pm.register(importlib.import_module(module), name=module)
            except Exception as exc:  # e.g. a broken install: every other command still works
                _warn(self, f"execbox's own commands from {module} failed to load: {exc!r}")
                continue
            self.distributions[module] = BUILTIN_DISTRIBUTION
        impls = self.pm.hook.execbox_register_commands.get_hookimpls()
        for impl in sorted(impls, key=lambda impl: self.distributions.get(impl.plugin_name) != BUILTIN_DISTRIBUTION):
            dist = self.distributions.get(impl.plugin_name, impl.plugin_name)
            added = click.Group()  # one per plugin: what it adds is checked before the command line gets it
            try:
                impl.function(cli=added)
            except Exception as exc:
                _warn(self, f"execbox plugin from distribution {dist!r} failed while adding its commands: {exc!r}")
                continue
            for name, command in added.commands.items():
                if name in taken or name in self._commands:
                    _warn(self, f"execbox plugin from distribution {dist!r} adds the command {name!r}, which the "
                                "execbox command line already has: it is left out")
                    continue
                self._commands[name] = command
        return self._commands

    def _load(self, name: str) -> BackendEntry | None:
        entry = self.entries[name]
        if entry.loaded:
            return entry
        try:
            _ = entry.cls  # imports and checks the class
        except Exception as exc:  # one broken or misdeclared backend must not hide the others, nor crash a listing
            del self.entries[name]
            if isinstance(exc, PluginError):
                message = str(exc)
                self.failed[name] = exc
            else:
                message = (f"execbox backend {name!r} ({entry.ref}) from distribution {entry.distribution!r} failed to "
                           f"import: {exc!r}")
                self.failed[name] = BackendUnavailableError(f"backend {name!r} cannot be loaded: {message}",
                                                            backend=name,
                                                            fix="reinstall the distribution that provides it")
            _warn(self, message)
            return None
        return entry


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
    distributions = registry.distributions
    distributions[BUILTIN_DISTRIBUTION] = BUILTIN_DISTRIBUTION
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

        def register(backend: type[ExecutionBackend[Any]] | str, name: str | None = None, _dist: str = dist,
                     ) -> None:
            _add(registry, backend, _dist, name)

        typed: Register = register  # what the hook promises a plugin

        try:
            impl.function(register=typed)
        except PluginError:
            raise
        except Exception as exc:
            _warn(registry, f"execbox plugin from distribution {dist!r} failed while registering backends: {exc!r}")
    return registry


def _check_class(cls: object, dist: str) -> None:
    if not (isinstance(cls, type) and issubclass(cls, ExecutionBackend)):
        raise PluginError(f"distribution {dist!r} registered {cls!r}, which is not an ExecutionBackend subclass")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise PluginError(f"backend class {cls.__qualname__} from {dist!r} needs a class-level name like 'my_backend'")
    if not hasattr(cls, "capabilities"):
        raise PluginError(f"backend {name!r} from {dist!r} declares no class-level capabilities")


def _add(registry: Registry, backend: type[ExecutionBackend] | str, dist: str, name: str | None = None) -> None:
    if isinstance(backend, str):
        if not _REF_RE.match(backend):
            raise PluginError(f"distribution {dist!r} registered {backend!r}: give a class, or its "
                              "'package.module:Class' with name='backend_name'")
        if name is None or not _NAME_RE.match(name):
            raise PluginError(f"distribution {dist!r} registered {backend} without a name like 'my_backend': "
                              "give name= (the class's name) so it is known before the module is imported")
    else:
        _check_class(backend, dist)
        if name is not None and name != backend.name:
            raise PluginError(f"distribution {dist!r} registered {backend.__qualname__} as {name!r}, but the class is "
                              f"named {backend.name!r}")
        name = backend.name
    existing = registry.entries.get(name)
    if existing is not None:
        raise PluginError(
            f"two backends are named {name!r}: one from distribution {existing.distribution!r}, one from {dist!r}. "
            "Uninstall one, or disable one with EXECBOX_DISABLE_PLUGINS."
        )
    registry.entries[name] = BackendEntry(name, backend, dist)
