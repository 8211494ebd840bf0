"""A stand-in for the ``modal`` SDK (1.x), at the SDK's own boundary.

Use it in tests::

    with execbox.fakes.modal.installed() as service:
        os.environ.update(service.credentials)      # or monkeypatch.setenv
        import modal                                 # -> this fake
        ...
        service.calls_to("Sandbox.create")           # what the code under test sent

Same names, signatures and exceptions as the real SDK for what execbox's modal backend uses (checked
against the installed SDK by tests/fakes/test_fake_surfaces.py): ``Client.from_env``, ``App.lookup``,
``Image.debian_slim``/``from_registry``/``from_id`` (and an image's ``object_id``),
``Sandbox.create``/``from_id``/``list``, ``sb.snapshot_filesystem``, ``sb.exec`` (a
``ContainerProcess`` with streamed ``stdout``/``stderr``, ``stdin``, ``wait``), ``sb.filesystem``
(``read_bytes``/``write_bytes``/``make_directory``), ``sb.terminate``/``poll``/``get_tags``/``object_id``,
and ``modal.exception``. Each sandbox is a local box (``_box.py``): commands really run, so output and exit
codes are real, ``block_network=True`` really has no network, an outbound allowlist (either list given, as
Modal's own ``NetworkAccess.ALLOWLIST``) is modelled as no network either (nothing an allowlist could name is
reachable from the machines these tests run on; the lists are recorded), the lifetime (``timeout``) really ends it and
a ``(request, limit)`` memory tuple is really a limit. Behaviour copied from modal 1.6: an exec timeout makes
``wait()`` return -1 and ends the streams instead of raising; ``returncode`` raises before ``wait()``;
exec on a finished sandbox raises ``ConflictError``; a signal death is ``128 + signal``; filesystem paths
must be absolute; writes create parent directories. ``snapshot_filesystem`` keeps the sandbox's own files (all of
them: the workspace, /tmp, /root; the host's userland is no part of a fake image) as an image whose ``object_id``
``Image.from_id`` takes back, for ``Sandbox.create(image=)``; the image is gone after its ``ttl`` (Modal has no call
that deletes one), and a sandbox created from an unknown or expired one raises ``NotFoundError``.

Not modelled (raising NotImplementedError rather than pretending): entrypoint commands, secrets,
volumes, GPUs, ports/tunnels, PTYs, the ``.aio`` async forms. Credentials come from ``MODAL_TOKEN_ID`` /
``MODAL_TOKEN_SECRET`` only (not ``~/.modal.toml``).
"""

from __future__ import annotations

import contextlib
import enum
import os
import queue
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

from execbox.fakes import _box
from execbox.fakes._common import Service, module, modules_installed
from execbox.files.workspace import remove_tree

_service: FakeModal | None = None


def _svc() -> FakeModal:
    if _service is None:
        raise RuntimeError("the modal fake is not installed: use `with execbox.fakes.modal.installed():`")
    return _service


# --- modal.exception ----------------------------------------------------------------------------------


class Error(Exception):
    """Base class for all Modal errors."""


class AuthError(Error):
    """Raised when a client has missing or invalid authentication."""


class InvalidError(Error):
    """Raised when user does something invalid."""


class ConflictError(InvalidError):
    """Raised when a resource conflict occurs between the request and current system state."""


class NotFoundError(Error):
    """Raised when a requested resource was not found."""


class AlreadyExistsError(Error):
    """Raised when a resource creation conflicts with an existing resource."""


class TimeoutError(Error):  # noqa: A001 - modal's own class has this name
    """Base class for Modal timeouts."""


class SandboxTimeoutError(TimeoutError):
    """Raised when a Sandbox exceeds its execution duration limit and times out."""


class ExecTimeoutError(TimeoutError):
    """Raised when a container process exceeds its execution duration limit and times out."""


class SandboxTerminatedError(Error):
    """Raised when a Sandbox is terminated for an internal reason."""


class ClientClosed(Error):
    pass


class SandboxFilesystemError(Error):
    """Base class for sandbox filesystem errors."""


class SandboxFilesystemNotFoundError(SandboxFilesystemError):
    """Raised when a file or directory is not found in the sandbox."""


class SandboxFilesystemIsADirectoryError(SandboxFilesystemError):
    pass


class SandboxFilesystemNotADirectoryError(SandboxFilesystemError):
    pass


EXCEPTIONS = {c.__name__: c for c in (
    Error, AuthError, InvalidError, ConflictError, NotFoundError, AlreadyExistsError, TimeoutError,
    SandboxTimeoutError, ExecTimeoutError, SandboxTerminatedError, ClientClosed, SandboxFilesystemError,
    SandboxFilesystemNotFoundError, SandboxFilesystemIsADirectoryError, SandboxFilesystemNotADirectoryError,
)}


class StreamType(enum.Enum):
    PIPE = "pipe"
    DEVNULL = "devnull"
    STDOUT = "stdout"


# --- the provider -------------------------------------------------------------------------------------


class FakeModal(Service):
    """The fake Modal service: the accepted token, the apps and sandboxes, and the call record."""

    def __init__(self) -> None:
        super().__init__()
        self.credentials = {"MODAL_TOKEN_ID": "ak-fake" + uuid.uuid4().hex[:12],
                            "MODAL_TOKEN_SECRET": "as-fake" + uuid.uuid4().hex}
        self.apps: dict[str, App] = {}
        self.sandboxes: dict[str, Sandbox] = {}
        # Filesystem snapshots: image id -> (its files, when it expires on time.monotonic(); None: never).
        self.images: dict[str, tuple[Path, float | None]] = {}
        self._image_dir: Path | None = None

    def authenticate(self, client: Client | None) -> Client:
        """What every networked call does first: resolve the client, and let the server judge its token."""
        client = client or Client.from_env()
        if client._credentials != (self.credentials["MODAL_TOKEN_ID"], self.credentials["MODAL_TOKEN_SECRET"]):
            raise AuthError("UNAUTHENTICATED: invalid token (the fake accepts only service.credentials)")
        return client

    def keep_image(self, box: _box.Box, ttl: int | None) -> str:
        """A new image of ``box``'s files, kept ``ttl`` seconds; its id."""
        with self.lock:
            if self._image_dir is None:
                self._image_dir = Path(tempfile.mkdtemp(prefix="execbox-fakemodal-images-"))
        image_id = "im-" + uuid.uuid4().hex[:22]
        box.save(self._image_dir / image_id)
        with self.lock:
            self.images[image_id] = (self._image_dir / image_id, None if ttl is None else time.monotonic() + ttl)
        return image_id

    def image_files(self, image_id: str) -> Path:
        """The files of a kept image, or NotFoundError (unknown, or past its ttl: then removed)."""
        with self.lock:
            kept = self.images.get(image_id)
            if kept is not None and kept[1] is not None and time.monotonic() >= kept[1]:
                del self.images[image_id]
                remove_tree(str(kept[0]))
                kept = None
        if kept is None:
            raise NotFoundError(f"Image {image_id} not found")
        return kept[0]

    def close(self) -> None:
        for sb in list(self.sandboxes.values()):
            sb._finish(137)
        if self._image_dir is not None:
            remove_tree(str(self._image_dir))


class Client:
    """A connection to Modal, authenticated in the calling process."""

    def __init__(self, credentials: tuple[str, str]) -> None:
        self._credentials = credentials

    @classmethod
    def from_env(cls, _override_config: Any = None) -> Client:
        svc = _svc()
        svc.record("Client.from_env")
        token_id, token_secret = os.environ.get("MODAL_TOKEN_ID"), os.environ.get("MODAL_TOKEN_SECRET")
        if not (token_id and token_secret):
            raise AuthError(
                "Token missing. Could not authenticate client. If you have token credentials, see "
                "modal.com/docs/sdk/py/latest/config for setup help. If you are a new user, register an "
                "account at modal.com, then run `modal token new`."
            )
        return cls((token_id, token_secret))


class App:
    def __init__(self, name: str | None = None, **kwargs: Any) -> None:
        self.name = name
        self._app_id: str | None = None

    @property
    def app_id(self) -> str:
        if self._app_id is None:
            raise InvalidError("App has not been initialized yet: look it up with App.lookup")
        return self._app_id

    @staticmethod
    def lookup(name: str, *, client: Client | None = None, environment_name: str | None = None,
               create_if_missing: bool = False) -> App:
        svc = _svc()
        svc.record("App.lookup", name, client=client, environment_name=environment_name,
                   create_if_missing=create_if_missing)
        svc.authenticate(client)
        with svc.lock:
            if name not in svc.apps:
                if not create_if_missing:
                    raise NotFoundError(f"App '{name}' not found")
                app = App(name)
                app._app_id = "ap-" + uuid.uuid4().hex[:22]
                svc.apps[name] = app
            return svc.apps[name]


class Image:
    """An image description. The fake runs every image on the host's userland; a filesystem snapshot's image
    (``object_id``) adds the snapshotted sandbox's own files to it."""

    def __init__(self, description: str, object_id: str | None = None) -> None:
        self.description = description
        self._object_id = object_id

    @property
    def object_id(self) -> str:
        if self._object_id is None:  # as in modal: only a hydrated image (built, snapshotted, from_id) has one
            raise AttributeError(f"Attempting to get object_id of unhydrated {self.description}")
        return self._object_id

    @classmethod
    def from_id(cls, image_id: str, client: Client | None = None) -> Image:
        # Lazy, as in modal: an unknown id fails when a sandbox is created from it.
        _svc().record("Image.from_id", image_id, client=client)
        return cls(f"Image.from_id({image_id!r})", image_id)

    @staticmethod
    def debian_slim(python_version: str | None = None, force_build: bool = False) -> Image:
        _svc().record("Image.debian_slim", python_version=python_version, force_build=force_build)
        return Image(f"debian_slim(python_version={python_version!r})")

    @staticmethod
    def from_registry(tag: str, secret: Any = None, *, setup_dockerfile_commands: list[str] = [],  # noqa: B006
                      force_build: bool = False, add_python: str | None = None, **kwargs: Any) -> Image:
        _svc().record("Image.from_registry", tag, secret=secret, setup_dockerfile_commands=setup_dockerfile_commands,
                      force_build=force_build, add_python=add_python, **kwargs)
        return Image(f"from_registry({tag!r})")


# --- processes ----------------------------------------------------------------------------------------

_EOF = object()


class StreamReader:
    """The stdout or stderr of an exec: iterate for chunks as they arrive, or ``read()`` to EOF.

    As in modal, the stream ends at the exec's deadline (``timeout``) instead of raising."""

    def __init__(self, pipe: Any, fd: int, text: bool, deadline: float | None) -> None:
        self._fd = fd
        self._text = text
        self._deadline = deadline
        # Bounded: a reader that never reads makes the command block on a full pipe, not this process grow.
        self._chunks: queue.Queue[Any] = queue.Queue(maxsize=64)
        self._done = pipe is None
        if pipe is not None:
            threading.Thread(target=self._pump, args=(pipe,), daemon=True).start()

    def _pump(self, pipe: Any) -> None:
        with pipe:
            while chunk := os.read(pipe.fileno(), 65536):
                self._chunks.put(chunk)
        self._chunks.put(_EOF)

    @property
    def file_descriptor(self) -> int:
        return self._fd

    def __iter__(self) -> Iterator[Any]:
        import codecs

        decoder = codecs.getincrementaldecoder("utf-8")(errors="strict") if self._text else None
        while not self._done:
            wait = None if self._deadline is None else self._deadline - time.monotonic()
            if wait is not None and wait <= 0:
                return
            try:
                chunk = self._chunks.get(timeout=wait)
            except queue.Empty:
                return
            if chunk is _EOF:
                self._done = True
                return
            yield decoder.decode(chunk) if decoder else chunk

    def read(self) -> Any:
        parts = list(self)
        return "".join(parts) if self._text else b"".join(parts)


class StreamWriter:
    """The stdin of an exec. ``write`` only buffers; ``drain`` sends; ``write_eof`` closes after the data."""

    MAX_BUFFER_SIZE = 2 * 1024 * 1024

    def __init__(self, pipe: Any) -> None:
        self._buffer = bytearray()
        self._closed = False
        self._sent_eof = False
        # Like modal's server, the fake accepts the data without waiting for the command to read it.
        self._outbox: queue.Queue[Any] = queue.Queue()
        threading.Thread(target=self._pump, args=(pipe,), daemon=True).start()

    def _pump(self, pipe: Any) -> None:
        broken = False
        while (item := self._outbox.get()) is not _EOF:
            if not broken:
                try:
                    pipe.write(item)
                    pipe.flush()
                except (BrokenPipeError, ValueError, OSError):
                    broken = True  # the command exited without reading it all: not an error in modal either
        with contextlib.suppress(OSError):
            pipe.close()

    def write(self, data: bytes | bytearray | memoryview | str) -> None:
        if self._closed:
            raise ValueError("Stdin is closed. Cannot write to it.")
        if not isinstance(data, (bytes, bytearray, memoryview, str)):
            raise TypeError(f"data argument must be a bytes-like object, not {type(data).__name__}")
        data = data.encode("utf-8") if isinstance(data, str) else bytes(data)
        if len(self._buffer) + len(data) > self.MAX_BUFFER_SIZE:
            raise BufferError("Buffer size exceed limit. Call drain to flush the buffer.")
        self._buffer.extend(data)

    def write_eof(self) -> None:
        self._closed = True

    def drain(self) -> None:
        if self._buffer:
            self._outbox.put(bytes(self._buffer))
            self._buffer.clear()
        if self._closed and not self._sent_eof:
            self._sent_eof = True
            self._outbox.put(_EOF)


class ContainerProcess:
    """A command started by ``Sandbox.exec``."""

    def __init__(self, proc: subprocess.Popen[bytes], *, text: bool, timeout: int | None) -> None:
        self._proc = proc
        self._returncode: int | None = None
        self._timed_out = threading.Event()
        deadline = None if not timeout else time.monotonic() + int(timeout)
        self._stdout = StreamReader(proc.stdout, 1, text, deadline)
        self._stderr = StreamReader(proc.stderr, 2, text, deadline)
        self._stdin = StreamWriter(proc.stdin)
        if deadline is not None:
            timer = threading.Timer(int(timeout or 0), self._expire)
            timer.daemon = True
            timer.start()

    def _expire(self) -> None:
        if self._proc.poll() is None:
            self._timed_out.set()
            _box.Box.kill(self._proc)

    @property
    def stdout(self) -> StreamReader:
        return self._stdout

    @property
    def stderr(self) -> StreamReader:
        return self._stderr

    @property
    def stdin(self) -> StreamWriter:
        return self._stdin

    @property
    def returncode(self) -> int:
        if self._returncode is None:
            raise InvalidError("You must call wait() before accessing the returncode. "
                               "To poll for the status of a running process, use poll() instead.")
        return self._returncode

    def _code(self, raw: int) -> int:
        if self._timed_out.is_set():
            return -1  # modal: an exec that outlived its timeout reports -1 and raises nothing
        return 128 - raw if raw < 0 else raw

    def poll(self) -> int | None:
        if self._returncode is None and (raw := self._proc.poll()) is not None:
            self._returncode = self._code(raw)
        return self._returncode

    def wait(self) -> int:
        if self._returncode is None:
            self._returncode = self._code(self._proc.wait())
        return self._returncode


# --- sandboxes ----------------------------------------------------------------------------------------


def _not_modelled(what: str) -> NotImplementedError:
    return NotImplementedError(f"the modal fake does not model {what}; extend execbox/fakes/modal.py first")


class SandboxFilesystem:
    """``sb.filesystem``: absolute paths only; writes create parents and overwrite."""

    def __init__(self, sandbox: Sandbox) -> None:
        self._sb = sandbox

    def _check(self, remote_path: str, op: str) -> _box.Box:
        if not str(remote_path).startswith("/"):
            raise InvalidError(f"Sandbox.filesystem.{op}() currently only supports absolute remote_path values")
        return self._sb._live_box()

    def read_bytes(self, remote_path: str) -> bytes:
        _svc().record_on(self._sb.object_id, "SandboxFilesystem.read_bytes", remote_path)
        rc, data = _box.read_file(self._check(remote_path, "read_bytes"), remote_path)
        if rc == 2:
            raise SandboxFilesystemNotFoundError(f"{remote_path}: No such file or directory")
        if rc == 21:
            raise SandboxFilesystemIsADirectoryError(f"{remote_path}: Is a directory")
        if rc:
            raise SandboxFilesystemError(f"read_bytes({remote_path}) failed with status {rc}")
        return data

    def write_bytes(self, data: bytes | bytearray | memoryview, remote_path: str) -> None:
        _svc().record_on(self._sb.object_id, "SandboxFilesystem.write_bytes", f"<{len(data)} bytes>", remote_path)
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"write_bytes() expects bytes-like data, got {type(data).__name__}")
        rc = _box.write_file(self._check(remote_path, "write_bytes"), remote_path, bytes(data))
        if rc == 21:
            raise SandboxFilesystemIsADirectoryError(f"{remote_path}: Is a directory")
        if rc == 20:
            raise SandboxFilesystemNotADirectoryError(f"{remote_path}: Not a directory")
        if rc:
            raise SandboxFilesystemError(f"write_bytes({remote_path}) failed with status {rc}")

    def make_directory(self, remote_path: str, *, create_parents: bool = True) -> None:
        _svc().record_on(self._sb.object_id, "SandboxFilesystem.make_directory", remote_path,
                         create_parents=create_parents)
        box = self._check(remote_path, "make_directory")
        argv = ["mkdir", *(["-p"] if create_parents else []), "--", remote_path]
        done = box.run(argv, cwd="/")
        if done.returncode:
            raise SandboxFilesystemError(done.stderr.decode(errors="replace").strip())


class Sandbox:
    """A running Modal sandbox (a local box in the fake)."""

    def __init__(self, *, app: App, name: str | None, tags: dict[str, str], env: dict[str, str],
                 workdir: str | None, box: _box.Box, timeout: int) -> None:
        self.object_id = "sb-" + uuid.uuid4().hex[:22]
        self.app = app
        self.name = name
        self.tags = dict(tags)
        self.env = env
        self.workdir = workdir
        self.box = box
        self._returncode: int | None = None
        self._finished_by: str | None = None
        self._lock = threading.Lock()
        # The lifetime is real: when it runs out, every process in the sandbox dies (returncode 124).
        self._timer = threading.Timer(timeout, self._finish, args=(124, "timeout"))
        self._timer.daemon = True
        self._timer.start()

    @staticmethod
    def create(
        *args: str,
        app: App | None = None,
        name: str | None = None,
        tags: dict[str, str] | None = None,
        image: Image | None = None,
        env: dict[str, str | None] | None = None,
        secrets: Collection[Any] | None = None,
        network_file_systems: dict[Any, Any] = {},  # noqa: B006 - modal's own default
        timeout: int | None = 300,
        idle_timeout: int | None = None,
        workdir: str | None = None,
        gpu: str | None = None,
        cloud: str | None = None,
        region: str | Sequence[str] | None = None,
        cpu: float | tuple[float, float] | None = None,
        memory: int | tuple[int, int] | None = None,
        runtime: str | None = None,
        block_network: bool = False,
        outbound_cidr_allowlist: Sequence[str] | None = None,
        outbound_domain_allowlist: Sequence[str] | None = None,
        _experimental_outbound_policy: Any = None,
        inbound_cidr_allowlist: Sequence[str] | None = None,
        volumes: dict[Any, Any] = {},  # noqa: B006
        pty: bool = False,
        encrypted_ports: Sequence[int] = [],  # noqa: B006
        h2_ports: Sequence[int] = [],  # noqa: B006
        unencrypted_ports: Sequence[int] = [],  # noqa: B006
        custom_domain: str | None = None,
        proxy: Any = None,
        include_oidc_identity_token: bool = False,
        readiness_probe: Any = None,
        verbose: bool = False,
        experimental_options: dict[str, Any] | None = None,
        _experimental_enable_snapshot: bool = False,
        _experimental_persistent: bool = False,
        client: Client | None = None,
        environment_name: str | None = None,
        pty_info: Any = None,
        cidr_allowlist: Sequence[str] | None = None,
    ) -> Sandbox:
        svc = _svc()
        svc.record("Sandbox.create", *args, app=app, name=name, tags=tags, image=image, env=env, secrets=secrets,
                   timeout=timeout, idle_timeout=idle_timeout, workdir=workdir, gpu=gpu, cloud=cloud, region=region,
                   cpu=cpu, memory=memory, runtime=runtime, block_network=block_network,
                   outbound_cidr_allowlist=outbound_cidr_allowlist, outbound_domain_allowlist=outbound_domain_allowlist,
                   inbound_cidr_allowlist=inbound_cidr_allowlist, volumes=volumes, pty=pty,
                   encrypted_ports=encrypted_ports, unencrypted_ports=unencrypted_ports, h2_ports=h2_ports,
                   include_oidc_identity_token=include_oidc_identity_token, experimental_options=experimental_options,
                   client=client, cidr_allowlist=cidr_allowlist)
        # Client-side validation, as in modal 1.6.
        if app is None:
            raise InvalidError("Sandboxes require an App when created outside of a Modal container.")
        if app._app_id is None:
            raise ValueError("App has not been initialized yet. Use App.lookup() to get a hydrated app.")
        if any(not isinstance(a, str) for a in args):
            raise InvalidError("Sandbox entrypoint arguments must be strings")
        if block_network and (outbound_cidr_allowlist or outbound_domain_allowlist or inbound_cidr_allowlist
                              or cidr_allowlist or encrypted_ports or h2_ports or unencrypted_ports):
            raise InvalidError("`block_network` cannot be combined with allowlists or ports")
        if workdir is not None and not workdir.startswith("/"):
            raise InvalidError(f"workdir must be an absolute path, got: {workdir}")
        if timeout is None:
            raise InvalidError("timeout=None is only allowed for persistent sandboxes")
        if runtime not in (None, "gvisor", "vm"):
            raise InvalidError(f"runtime must be one of 'gvisor', 'vm', got {runtime!r}")
        for what, value in (("entrypoint commands", args), ("secrets", secrets), ("volumes", volumes),
                            ("network file systems", network_file_systems), ("GPUs", gpu), ("PTYs", pty),
                            ("ports", list(encrypted_ports) + list(h2_ports) + list(unencrypted_ports)),
                            ("the deprecated cidr_allowlist", cidr_allowlist), ("idle_timeout", idle_timeout)):
            if value:
                raise _not_modelled(what)
        limit_mb = None
        if isinstance(memory, tuple):
            request_mb, limit_mb = memory
            if limit_mb < request_mb:
                raise InvalidError(f"Cannot specify a memory limit lower than request: {limit_mb} < {request_mb}")
        if isinstance(cpu, tuple) and cpu[1] < cpu[0]:
            raise InvalidError(f"Cannot specify a CPU limit lower than request: {cpu[1]} < {cpu[0]}")
        svc.authenticate(client)
        if name is not None and any(s.name == name and s.app is app and s.poll() is None
                                    for s in svc.sandboxes.values()):
            raise AlreadyExistsError(f"Sandbox with name '{name}' already exists in the app")
        for listed in (outbound_cidr_allowlist, outbound_domain_allowlist):
            if listed is not None and (isinstance(listed, str) or not all(isinstance(x, str) for x in listed)):
                raise InvalidError("outbound allowlists are sequences of str")
        allowlist = outbound_cidr_allowlist is not None or outbound_domain_allowlist is not None
        seed = svc.image_files(image._object_id) if image is not None and image._object_id is not None else None
        box = _box.Box(network="none" if block_network or allowlist else "allow", dirs=(workdir or "/",),
                       memory_mb=limit_mb, seed=seed)
        sb = Sandbox(app=app, name=name, tags=tags or {}, env={k: v for k, v in (env or {}).items() if v is not None},
                     workdir=workdir, box=box, timeout=int(timeout))
        with svc.lock:
            svc.sandboxes[sb.object_id] = sb
        return sb

    @staticmethod
    def from_id(sandbox_id: str, client: Client | None = None) -> Sandbox:
        svc = _svc()
        svc.record("Sandbox.from_id", sandbox_id, client=client)
        svc.authenticate(client)
        if sandbox_id not in svc.sandboxes:
            raise NotFoundError(f"Sandbox {sandbox_id} not found")
        return svc.sandboxes[sandbox_id]

    @staticmethod
    def list(*, app_id: str | None = None, tags: dict[str, str] | None = None,
             client: Client | None = None) -> Iterator[Sandbox]:
        svc = _svc()
        svc.record("Sandbox.list", app_id=app_id, tags=tags, client=client)
        svc.authenticate(client)
        for sb in list(svc.sandboxes.values()):
            if sb.poll() is not None:
                continue  # modal lists running sandboxes
            if app_id is not None and sb.app.app_id != app_id:
                continue
            if all(sb.tags.get(k) == v for k, v in (tags or {}).items()):
                yield sb

    # --- instance ---

    def _live_box(self) -> _box.Box:
        if self.poll() is not None:
            raise ConflictError("Sandbox already finished")
        return self.box

    def _finish(self, code: int, how: str = "terminated") -> None:
        with self._lock:
            if self._returncode is not None:
                return
            self._returncode = code
            self._finished_by = how
        self._timer.cancel()
        self.box.destroy()

    @property
    def filesystem(self) -> SandboxFilesystem:
        return SandboxFilesystem(self)

    @property
    def returncode(self) -> int | None:
        return self._returncode

    def poll(self) -> int | None:
        return self._returncode

    def get_tags(self) -> dict[str, str]:
        _svc().record_on(self.object_id, "Sandbox.get_tags")
        return dict(self.tags)

    def exec(self, *args: str, stdout: StreamType = StreamType.PIPE, stderr: StreamType = StreamType.PIPE,
             timeout: int | None = None, workdir: str | None = None, env: dict[str, str | None] | None = None,
             secrets: Collection[Any] | None = None, text: bool = True, bufsize: int = -1, pty: bool = False,
             _pty_info: Any = None, pty_info: Any = None) -> ContainerProcess:
        _svc().record_on(self.object_id, "Sandbox.exec", *args, stdout=stdout, stderr=stderr, timeout=timeout,
                      workdir=workdir, env=env, secrets=secrets, text=text, bufsize=bufsize, pty=pty)
        if workdir is not None and not workdir.startswith("/"):
            raise InvalidError(f"workdir must be an absolute path, got: {workdir}")
        if any(not isinstance(a, str) for a in args):
            raise InvalidError("exec arguments must be strings")
        if secrets or pty or pty_info or _pty_info:
            raise _not_modelled("exec secrets and PTYs")
        if StreamType.STDOUT in (stdout, stderr):
            raise _not_modelled("StreamType.STDOUT (printing locally)")
        box = self._live_box()
        full_env = {"PATH": _box.PATH, "HOME": "/root", **self.env,
                    **{k: v for k, v in (env or {}).items() if v is not None}}
        if timeout is not None and (not isinstance(timeout, int) or isinstance(timeout, bool)):
            raise InvalidError(f"timeout must be an integer number of seconds, got {timeout!r}")
        pipe = subprocess.PIPE
        proc = box.popen(list(args), cwd=workdir or self.workdir or "/", env=full_env, stdin=pipe,
                         stdout=pipe if stdout == StreamType.PIPE else subprocess.DEVNULL,
                         stderr=pipe if stderr == StreamType.PIPE else subprocess.DEVNULL)
        return ContainerProcess(proc, text=text, timeout=timeout)

    def snapshot_filesystem(self, timeout: int = 55, *, ttl: int | None = 2592000) -> Image:
        svc = _svc()
        svc.record_on(self.object_id, "Sandbox.snapshot_filesystem", timeout=timeout, ttl=ttl)
        if ttl is not None and ttl <= 0:
            raise InvalidError("ttl must be a positive number of seconds, or None")
        image_id = svc.keep_image(self._live_box(), ttl)
        return Image(f"snapshot_filesystem({self.object_id})", image_id)

    def terminate(self, *, wait: bool = False) -> int | None:
        _svc().record_on(self.object_id, "Sandbox.terminate", wait=wait)
        self._finish(137)
        return self._returncode if wait else None

    def wait(self, raise_on_termination: bool = True) -> None:
        while self._returncode is None:
            time.sleep(0.05)
        if self._finished_by == "timeout":
            raise SandboxTimeoutError("Sandbox hit its timeout")
        if self._finished_by == "terminated" and raise_on_termination:
            raise SandboxTerminatedError("Sandbox was terminated")

    def detach(self) -> None:
        pass



@contextlib.contextmanager
def installed() -> Iterator[FakeModal]:
    """Make ``import modal`` (and ``modal.exception``, ``modal.stream_type``) return this fake."""
    global _service
    if _service is not None:
        raise RuntimeError("the modal fake is already installed")
    service = FakeModal()
    exception = module("modal.exception", "Fake modal.exception", EXCEPTIONS)
    stream_type = module("modal.stream_type", None, {"StreamType": StreamType})
    container_process = module("modal.container_process", None, {"ContainerProcess": ContainerProcess})
    root = module("modal", __doc__, {
        "App": App, "Client": Client, "Image": Image, "Sandbox": Sandbox, "Error": Error,
        "exception": exception, "stream_type": stream_type, "container_process": container_process,
        "__version__": "1.6.4+execbox-fake",
    })
    _service = service
    try:
        with modules_installed({"modal": root, "modal.exception": exception, "modal.stream_type": stream_type,
                                "modal.container_process": container_process}):
            yield service
    finally:
        _service = None
        service.close()


__all__ = ["FakeModal", "installed"]
