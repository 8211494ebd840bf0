"""The remote-SDK fakes against the REAL SDKs (installed by the extras): every member our backends use exists
in the real SDK with a compatible signature, and every exception has the same name and bases.

When Modal, Daytona or Vercel change their API, this is the test that fails. Compatible means: each
parameter the fake declares exists in the real member with the same kind and the same default, and each
parameter the real member requires is declared by the fake, so a call that works against the fake binds
against the real SDK too (each backend's test_recorded_calls_bind_against_the_real_sdk, in
tests/backends/test_{modal,daytona,vercel_sandbox}.py, binds the calls our backends really made).
"""

from __future__ import annotations

import enum
import importlib
import importlib.util
import inspect
from typing import Any

import pytest

from execbox.testing import engine_missing

# (fake member, real member as "module:qualname"). The fake's member is looked up in its module by the
# same dotted path. Only what execbox's backends use (or what the fakes use to emulate them).
MEMBERS: dict[str, list[tuple[str, str]]] = {
    "modal": [
        ("Client.from_env", "modal:Client.from_env"),
        ("App.lookup", "modal:App.lookup"),
        ("Image.debian_slim", "modal:Image.debian_slim"),
        ("Image.from_registry", "modal:Image.from_registry"),
        ("Image.from_id", "modal:Image.from_id"),
        ("Sandbox.create", "modal:Sandbox.create"),
        ("Sandbox.from_id", "modal:Sandbox.from_id"),
        ("Sandbox.list", "modal:Sandbox.list"),
        ("Sandbox.exec", "modal:Sandbox.exec"),
        ("Sandbox.terminate", "modal:Sandbox.terminate"),
        ("Sandbox.poll", "modal:Sandbox.poll"),
        ("Sandbox.wait", "modal:Sandbox.wait"),
        ("Sandbox.get_tags", "modal:Sandbox.get_tags"),
        ("Sandbox.snapshot_filesystem", "modal:Sandbox.snapshot_filesystem"),
        ("SandboxFilesystem.read_bytes", "modal.sandbox.sandbox:SandboxFilesystem.read_bytes"),
        ("SandboxFilesystem.write_bytes", "modal.sandbox.sandbox:SandboxFilesystem.write_bytes"),
        ("SandboxFilesystem.make_directory", "modal.sandbox.sandbox:SandboxFilesystem.make_directory"),
        ("ContainerProcess.wait", "modal.container_process:ContainerProcess.wait"),
        ("ContainerProcess.poll", "modal.container_process:ContainerProcess.poll"),
        ("StreamReader.read", "modal.io_streams:StreamReader.read"),
        ("StreamWriter.write", "modal.io_streams:StreamWriter.write"),
        ("StreamWriter.write_eof", "modal.io_streams:StreamWriter.write_eof"),
        ("StreamWriter.drain", "modal.io_streams:StreamWriter.drain"),
    ],
    "daytona": [
        ("Daytona", "daytona:Daytona"),
        ("Daytona.create", "daytona:Daytona.create"),
        ("Daytona.get", "daytona:Daytona.get"),
        ("Daytona.list", "daytona:Daytona.list"),
        ("DaytonaConfig", "daytona:DaytonaConfig"),
        ("Resources", "daytona:Resources"),
        ("ListSandboxesQuery", "daytona:ListSandboxesQuery"),
        ("FileUpload", "daytona:FileUpload"),
        ("FileDownloadRequest", "daytona:FileDownloadRequest"),
        ("Sandbox.start", "daytona:Sandbox.start"),
        ("Sandbox.stop", "daytona:Sandbox.stop"),
        ("Sandbox.delete", "daytona:Sandbox.delete"),
        ("Sandbox.get_work_dir", "daytona:Sandbox.get_work_dir"),
        ("Sandbox.refresh_data", "daytona:Sandbox.refresh_data"),
        ("Sandbox.create_snapshot", "daytona:Sandbox.create_snapshot"),
        ("SnapshotService.get", "daytona._sync.snapshot:SnapshotService.get"),
        ("SnapshotService.delete", "daytona._sync.snapshot:SnapshotService.delete"),
        ("Process.exec", "daytona._sync.process:Process.exec"),
        ("FileSystem.upload_file", "daytona._sync.filesystem:FileSystem.upload_file"),
        ("FileSystem.upload_files", "daytona._sync.filesystem:FileSystem.upload_files"),
        ("FileSystem.download_file", "daytona._sync.filesystem:FileSystem.download_file"),
        ("FileSystem.download_files", "daytona._sync.filesystem:FileSystem.download_files"),
        ("DaytonaError", "daytona:DaytonaError"),
    ],
    "vercel": [
        ("create_sandbox", "vercel.sandbox.sync:create_sandbox"),
        ("get_sandbox", "vercel.sandbox.sync:get_sandbox"),
        ("query_sandboxes", "vercel.sandbox.sync:query_sandboxes"),
        ("NetworkPolicy.deny_all", "vercel.sandbox.sync:NetworkPolicy.deny_all"),
        ("NetworkPolicy.allow_all", "vercel.sandbox.sync:NetworkPolicy.allow_all"),
        ("NetworkPolicy.custom", "vercel.sandbox.sync:NetworkPolicy.custom"),
        ("NetworkPolicySubnets", "vercel.sandbox.sync:NetworkPolicySubnets"),
        ("SandboxResources", "vercel.sandbox.sync:SandboxResources"),
        ("TagFilter", "vercel.sandbox.sync:TagFilter"),
        ("SandboxQueryByCreatedAt", "vercel.sandbox.sync:SandboxQueryByCreatedAt"),
        ("CompletedProcess", "vercel.sandbox.sync:CompletedProcess"),
        ("SyncSandbox.run_process", "vercel.sandbox.sync:SyncSandbox.run_process"),
        ("SyncSandbox.stop", "vercel.sandbox.sync:SyncSandbox.stop"),
        ("SyncSandbox.destroy", "vercel.sandbox.sync:SyncSandbox.destroy"),
        ("SyncSandboxFilesystem.read_bytes", "vercel.sandbox.sync:SyncSandboxFilesystem.read_bytes"),
        ("SyncSandboxFilesystem.write_bytes", "vercel.sandbox.sync:SyncSandboxFilesystem.write_bytes"),
        ("SandboxApiError", "vercel.sandbox.sync:SandboxApiError"),
        ("SandboxPathNotFoundError", "vercel.sandbox.sync:SandboxPathNotFoundError"),
    ],
}

# Attributes read on instances: (fake class, attribute, real "module:Class"). Properties, pydantic fields,
# dataclass fields or slots all count.
ATTRIBUTES: dict[str, list[tuple[str, str, str]]] = {
    "modal": [
        *(("Sandbox", a, "modal:Sandbox") for a in ("object_id", "filesystem", "returncode")),
        ("App", "app_id", "modal:App"),
        ("Image", "object_id", "modal:Image"),
        *(("ContainerProcess", a, "modal.container_process:ContainerProcess")
          for a in ("stdout", "stderr", "stdin", "returncode")),
        ("StreamReader", "__iter__", "modal.io_streams:StreamReader"),
    ],
    "daytona": [
        *(("Sandbox", a, "daytona:Sandbox") for a in (
            "id", "name", "labels", "state", "network_block_all", "network_allow_list", "domain_allow_list", "cpu",
            "memory", "env", "process", "fs")),
        *(("ExecuteResponse", a, "daytona:ExecuteResponse") for a in ("exit_code", "result")),
        ("Daytona", "snapshot", "daytona:Daytona"),
        *(("Snapshot", a, "daytona.common.snapshot:Snapshot") for a in ("id", "name", "state", "cpu", "mem", "disk")),
        *(("FileDownloadResponse", a, "daytona:FileDownloadResponse") for a in ("source", "result", "error")),
    ],
    "vercel": [
        *(("SyncSandbox", a, "vercel.sandbox.sync:SyncSandbox") for a in (
            "name", "status", "tags", "cwd", "fs", "persistent", "vcpus", "memory", "network_policy",
            "execution_time_limit")),
        *(("CompletedProcess", a, "vercel.sandbox.sync:CompletedProcess")
          for a in ("returncode", "stdout", "stderr")),
        *(("NetworkPolicy", a, "vercel.sandbox.sync:NetworkPolicy") for a in ("mode",)),
    ],
}

# Exceptions: the fake's name -> where the real class lives.
EXCEPTIONS: dict[str, tuple[str, list[str]]] = {
    "modal": ("modal.exception", [
        "Error", "AuthError", "InvalidError", "ConflictError", "NotFoundError", "AlreadyExistsError",
        "TimeoutError", "SandboxTimeoutError", "ExecTimeoutError", "SandboxTerminatedError", "ClientClosed",
        "SandboxFilesystemError", "SandboxFilesystemNotFoundError", "SandboxFilesystemIsADirectoryError",
        "SandboxFilesystemNotADirectoryError",
    ]),
    "daytona": ("daytona", [
        "DaytonaError", "DaytonaNotFoundError", "DaytonaAuthenticationError", "DaytonaConflictError",
        "DaytonaBadRequestError", "DaytonaTimeoutError", "DaytonaFileNotFoundError", "DaytonaValidationError",
    ]),
    "vercel": ("vercel.sandbox.sync", [
        "SandboxError", "SandboxApiError", "SandboxCredentialsError", "SandboxTimeoutError",
        "SandboxTerminalStateError", "SandboxFilesystemError", "SandboxFilesystemWriteError",
        "SandboxPathNotFoundError",
    ]),
}

# Enum members the backends and fakes use: (fake enum, member names, real "module:Enum").
ENUMS = {
    "modal": [("StreamType", ("PIPE", "DEVNULL", "STDOUT"), "modal.stream_type:StreamType")],
    "daytona": [("SandboxState", ("STARTED", "STOPPED", "STARTING", "STOPPING", "DESTROYED", "ERROR", "CREATING",
                                  "SNAPSHOTTING"),
                 "daytona:SandboxState")],
    "vercel": [("SandboxStatus", ("PENDING", "RUNNING", "STOPPING", "STOPPED", "FAILED", "ABORTED", "SNAPSHOTTING"),
                "vercel.sandbox.sync:SandboxStatus")],
}

SDK_MODULE = {"modal": "modal", "daytona": "daytona", "vercel": "vercel.sandbox.sync"}
EXTRA = {"modal": "modal", "daytona": "daytona", "vercel": "vercel"}


def real_sdk(sdk: str) -> None:
    """Skip (laptop) or fail (CI) when the real SDK is not installed."""
    top = SDK_MODULE[sdk].split(".")[0]
    if importlib.util.find_spec(top) is None:
        engine_missing(f"the real {sdk} SDK is not installed: pip install 'execbox[{EXTRA[sdk]}]'")
    importlib.import_module(SDK_MODULE[sdk])


def fake_module(sdk: str) -> Any:
    return importlib.import_module(f"execbox.fakes.{sdk}")


def resolve(root: Any, dotted: str) -> Any:
    obj = root
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def real_member(spec: str) -> Any:
    mod, _, qual = spec.partition(":")
    return resolve(importlib.import_module(mod), qual)


def params(obj: Any) -> list[inspect.Parameter]:
    sig = inspect.signature(obj)
    ps = list(sig.parameters.values())
    if ps and ps[0].name in ("self", "cls"):
        ps = ps[1:]
    return ps


def comparable(value: Any) -> Any:
    """A default reduced to something two SDKs' values can be compared by (enums by member name)."""
    if isinstance(value, enum.Enum):
        return ("enum", value.name)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple, dict)) and not value:
        return type(value).__name__
    return ("opaque",)


def incompatibilities(fake: Any, real: Any) -> list[str]:
    problems = []
    fake_ps, real_ps = params(fake), params(real)
    real_by_name = {p.name: p for p in real_ps}
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    real_pos = [p.name for p in real_ps if p.kind in positional]
    fake_pos = [p.name for p in fake_ps if p.kind in positional]
    if real_pos[:len(fake_pos)] != fake_pos:
        problems.append(f"positional parameters are {fake_pos} in the fake, {real_pos} in the SDK")
    for p in fake_ps:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            twin = next((r for r in real_ps if r.kind is p.kind), None)
            if twin is None and p.kind is p.VAR_POSITIONAL:
                problems.append(f"the fake takes *{p.name}, the real SDK does not")
            continue
        r = real_by_name.get(p.name)
        if r is None:  # even if the SDK takes **kwargs: vercel's refuses names it does not know
            problems.append(f"parameter {p.name!r} does not exist in the real SDK")
            continue
        if r.kind is not p.kind:
            problems.append(
                f"parameter {p.name!r} is {p.kind.description} in the fake, {r.kind.description} in the SDK")
        if (p.default is p.empty) != (r.default is r.empty):
            problems.append(f"parameter {p.name!r} has a default in only one of fake and SDK")
        elif p.default is not p.empty:
            fd, rd = comparable(p.default), comparable(r.default)
            if ("opaque",) not in (fd, rd) and fd != rd:
                problems.append(f"parameter {p.name!r} defaults to {p.default!r} in the fake, {r.default!r} in the SDK")
    fake_names = {p.name for p in fake_ps}
    for r in real_ps:
        if r.default is r.empty and r.kind not in (r.VAR_POSITIONAL, r.VAR_KEYWORD) and r.name not in fake_names:
            problems.append(f"the SDK requires parameter {r.name!r}, which the fake does not take")
    return problems


def _cases(table: dict[str, list[Any]]) -> list[Any]:
    return [pytest.param(sdk, *row, id=f"{sdk}:{row[0]}" + (f".{row[1]}" if len(row) == 3 else ""))
            for sdk, rows in table.items() for row in rows]


@pytest.mark.parametrize(("sdk", "fake_name", "real_spec"), _cases(MEMBERS))
def test_member_exists_with_compatible_signature(sdk: str, fake_name: str, real_spec: str) -> None:
    real_sdk(sdk)
    real = real_member(real_spec)
    fake = resolve(fake_module(sdk), fake_name)
    problems = incompatibilities(fake, real)
    assert not problems, f"{sdk} {real_spec} changed:\n  " + "\n  ".join(problems)


@pytest.mark.parametrize(("sdk", "fake_cls", "attr", "real_spec"), _cases(ATTRIBUTES))
def test_attribute_exists(sdk: str, fake_cls: str, attr: str, real_spec: str) -> None:
    real_sdk(sdk)
    real_cls = real_member(real_spec)
    fields = set(getattr(real_cls, "model_fields", {})) | set(getattr(real_cls, "__dataclass_fields__", {}))
    fields |= set(getattr(real_cls, "__slots__", ())) | _assigned_in_init(real_cls)  # a service the client makes
    assert attr in fields or inspect.getattr_static(real_cls, attr, None) is not None, (
        f"{real_spec} no longer has {attr!r}")
    fake = resolve(fake_module(sdk), fake_cls)
    fake_fields = set(getattr(fake, "__dataclass_fields__", {})) | set(getattr(fake, "__slots__", ()))
    assert attr in fake_fields or hasattr(fake, attr) or attr in inspect.signature(fake.__init__).parameters or (
        attr in _assigned_in_init(fake)), f"the fake {fake_cls} lacks {attr!r}"


def _assigned_in_init(cls: type) -> set[str]:
    import ast
    import textwrap

    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if not inspect.isfunction(init):
            continue
        try:
            source = inspect.getsource(init)
        except OSError:  # generated (a dataclass's, say): it assigns only its fields, looked at already
            continue
        tree = ast.parse(textwrap.dedent(source))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
                names.add(node.attr)
    return names


@pytest.mark.parametrize(("sdk", "name"), [pytest.param(sdk, name, id=f"{sdk}:{name}")
                                           for sdk, (_, names) in EXCEPTIONS.items() for name in names])
def test_exception_exists_with_compatible_bases(sdk: str, name: str) -> None:
    real_sdk(sdk)
    where, _ = EXCEPTIONS[sdk]
    real = getattr(importlib.import_module(where), name, None)
    assert isinstance(real, type) and issubclass(real, BaseException), f"{where}.{name} is gone"
    fake = getattr(fake_module(sdk), name)
    # The fake's ancestry must be a sub-sequence of the real one (it may skip e.g. modal's grpclib wrapper):
    # code that catches a base class catches the same errors from both.
    real_mro = [c.__name__ for c in real.__mro__]
    fake_mro = [c.__name__ for c in fake.__mro__]
    it = iter(real_mro)
    assert all(n in it for n in fake_mro), f"{name}: fake bases {fake_mro} vs real {real_mro}"
    assert real.__name__ == fake.__name__


@pytest.mark.parametrize(("sdk", "fake_enum", "members", "real_spec"), _cases(ENUMS))
def test_enum_members(sdk: str, fake_enum: str, members: tuple[str, ...], real_spec: str) -> None:
    real_sdk(sdk)
    real = real_member(real_spec)
    fake = resolve(fake_module(sdk), fake_enum)
    for m in members:
        assert m in real.__members__, f"{real_spec}.{m} is gone"
        assert m in fake.__members__
        if isinstance(real[m].value, str):
            assert real[m].value == fake[m].value


def test_daytona_create_params_match_fields() -> None:
    """The fake rejects unknown parameter names (the real models drop them silently): its list must be the
    real list, field for field, or a real parameter would be refused / a removed one accepted."""
    real_sdk("daytona")
    import daytona

    from execbox.fakes import daytona as fake

    for cls in ("CreateSandboxFromImageParams", "CreateSandboxFromSnapshotParams"):
        real_fields = set(getattr(daytona, cls).model_fields)
        fake_fields = set(fake._BASE_FIELDS) | set(getattr(fake, cls)._extra)
        assert fake_fields == real_fields, (
            f"{cls}: only in the fake {fake_fields - real_fields}, only in the SDK {real_fields - fake_fields}")


def test_vercel_policy_and_extras() -> None:
    """What the vercel backend relies on beyond signatures: deny_all's mode, and that unknown keyword
    arguments are refused (the fake refuses them the same way)."""
    real_sdk("vercel")
    from vercel.sandbox import sync

    assert sync.NetworkPolicy.deny_all().mode == "deny-all"
    assert sync.NetworkPolicy.allow_all().mode == "allow-all"
    with pytest.raises(TypeError):
        sync.create_sandbox(timeout=5)  # refused before any credential lookup or HTTP request
    with pytest.raises(Exception):  # noqa: B017 - pydantic's ValidationError: extra fields are forbidden
        sync.SandboxResources(cpu=1)
