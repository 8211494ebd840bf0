"""The sync facades: Runner and Sandbox, each call run in an event-loop thread (loop_thread)."""

from __future__ import annotations

import concurrent.futures
import functools
import os
import threading
import weakref
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from execbox.audit import log as audit_log
from execbox.config.settings import Settings
from execbox.contract.backend import ExecutionBackend
from execbox.contract.models import CellResult, ExecRequest, ExecResult, Language, Limits, Mount, NetworkMode
from execbox.contract.output import LiveOutput, OnText
from execbox.errors import (
    SandboxError,
)
from execbox.files.transfer import FileInfo, Transfer
from execbox.runner.async_runner import AsyncRunner
from execbox.runner.batch import Batch, Item
from execbox.runner.loop_thread import _OPEN_FACADES, _Closing, _LoopThread, run_blocking
from execbox.runner.pipeline import Uploads
from execbox.runner.sandbox import AsyncSandbox
from execbox.runner.snapshots import Snapshot
from execbox.secrets.egress import Given
from execbox.secrets.values import Secret

T = TypeVar("T")


class Runner:
    """The sync facade of AsyncRunner: same methods, blocking; ``with Runner() as runner:`` closes its backends.

    Its first call starts an event-loop thread that its later calls reuse (a thread per call cost ~1-2 ms);
    ``close``, or the runner's garbage collection, or the interpreter's exit ends it."""

    def __init__(self, settings: Settings | None = None, *,
                 options: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        self.aio = AsyncRunner(settings, options=options)
        self._loop: _LoopThread | None = None
        self._closing: _Closing | None = None
        self._pool_task: concurrent.futures.Future[None] | None = None
        self._lock = threading.Lock()
        #: The sandboxes open in this runner's loop thread: closed before it, when the runner closes.
        self._sandboxes: weakref.WeakSet[Sandbox] = weakref.WeakSet()

    def __enter__(self) -> Runner:
        # With a warm pool, the pool refills in the background in the runner's event loop for its life.
        loop = self._loop_thread()
        with self._lock:
            if self.aio.settings.pool_size and self._pool_task is None:
                self._pool_task, _ = loop.portal.start_task(self.aio.serve_pool)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _loop_thread(self) -> _LoopThread:
        with self._lock:
            if self._loop is None:
                self._loop = _LoopThread()
                self._closing = _Closing(self, self._loop, self.aio.aclose)
            return self._loop

    def _forget(self) -> None:
        if self._closing is not None:
            self._closing.forget()
        self._loop = self._closing = self._pool_task = None
        self._lock = threading.Lock()  # held by the parent's thread at the fork, maybe

    def close(self) -> None:
        with self._lock:
            closing, pool_task = self._closing, self._pool_task
            self._loop = self._closing = self._pool_task = None
        _OPEN_FACADES.discard(self)
        if closing is None:
            run_blocking(self.aio.aclose)
            return
        for sandbox in list(self._sandboxes):  # they run in this loop, which is about to stop
            sandbox.close()
        closing.now()
        if pool_task is not None:
            pool_task.result()  # what went wrong in the pool's background work, if anything

    def _call(self, fn: Callable[[], Awaitable[T]]) -> T:
        return self._loop_thread().call(fn)

    def warm(self, backend: str | None = None, *, network: NetworkMode | None = None, limits: Limits | None = None,
             timeout: float | None = None) -> int:
        return self._call(functools.partial(self.aio.warm, backend, network=network, limits=limits, timeout=timeout))

    @property
    def settings(self) -> Settings:
        return self.aio.settings

    @property
    def audit(self) -> audit_log.AuditLog:
        return self.aio.audit

    def run(self, command: str | Sequence[str], *, backend: str | None = None, network: NetworkMode | None = None,
            timeout: float | None = None, env: Mapping[str, str] | None = None, stdin: bytes | str | None = None,
            files: Mapping[str, bytes | str] | None = None, workdir: str | None = None,
            max_output_bytes: int | None = None, limits: Limits | None = None, mounts: Sequence[Mount] | None = None,
            tmpfs: Sequence[str] | None = None,
            collect: Sequence[str] | None = None, secrets: Mapping[str, Secret | str] | None = None,
            secrets_at_egress: Given | None = None, on_stdout: OnText | None = None, on_stderr: OnText | None = None,
            upload: Uploads | None = None, download: Uploads | None = None,
            options: Mapping[str, Any] | None = None) -> ExecResult:
        return self._call(functools.partial(
            self.aio.run, command,
            backend=backend, network=network, timeout=timeout, env=env, stdin=stdin, files=files, workdir=workdir,
            max_output_bytes=max_output_bytes, limits=limits, mounts=mounts,
            tmpfs=tmpfs, collect=collect, secrets=secrets,
            secrets_at_egress=secrets_at_egress, on_stdout=on_stdout, on_stderr=on_stderr, upload=upload,
            download=download, options=options))

    def run_code(self, code: str, language: Language = "python", *, backend: str | None = None,
                 network: NetworkMode | None = None, timeout: float | None = None, env: Mapping[str, str] | None = None,
                 stdin: bytes | str | None = None, files: Mapping[str, bytes | str] | None = None,
                 workdir: str | None = None, max_output_bytes: int | None = None, limits: Limits | None = None,
                 mounts: Sequence[Mount] | None = None,
                 tmpfs: Sequence[str] | None = None, collect: Sequence[str] | None = None,
                 secrets: Mapping[str, Secret | str] | None = None, secrets_at_egress: Given | None = None,
                 on_stdout: OnText | None = None, on_stderr: OnText | None = None, upload: Uploads | None = None,
                 download: Uploads | None = None, options: Mapping[str, Any] | None = None) -> ExecResult:
        return self._call(functools.partial(
            self.aio.run_code, code, language,
            backend=backend, network=network, timeout=timeout, env=env, stdin=stdin, files=files, workdir=workdir,
            max_output_bytes=max_output_bytes, limits=limits, mounts=mounts,
            tmpfs=tmpfs, collect=collect, secrets=secrets,
            secrets_at_egress=secrets_at_egress, on_stdout=on_stdout, on_stderr=on_stderr, upload=upload,
            download=download, options=options))

    def execute(self, request: ExecRequest, *, backend: str | None = None, output: LiveOutput | None = None,
                upload: Uploads | None = None, download: Uploads | None = None,
                options: Mapping[str, Any] | None = None) -> ExecResult:
        return self._call(functools.partial(self.aio.execute, request, backend=backend, output=output, options=options,
                                            upload=upload, download=download))

    def map(self, items: Iterable[Item], *, concurrency: int | None = None, ordered: bool = True,
            progress: bool | None = None, backend: str | None = None) -> Batch:
        """See AsyncRunner.map: ``for item in runner.map(items)``; leaving a ``with`` block, ``close()``, or Ctrl-C
        stops the batch and leaves nothing behind."""
        return Batch(self.aio.map(items, concurrency=concurrency, ordered=ordered, progress=progress,
                                  backend=backend), self._call)

    def sandbox(self, backend: str | None = None, *, network: NetworkMode | None = None, limits: Limits | None = None,
                name: str | None = None, lifetime_s: float = 3600.0, mounts: Sequence[Mount] | None = None,
                tmpfs: Sequence[str] | None = None,
                package_cache: bool = False, pip: Sequence[str] | None = None,
                secrets: Mapping[str, Secret | str] | None = None, secrets_at_egress: Given | None = None,
                from_snapshot: Snapshot | str | None = None, **options: Any) -> Sandbox:
        """See AsyncRunner.sandbox; keywords beyond these are the backend's own options."""
        return Sandbox(self.aio.sandbox(
            backend,
            network=network, limits=limits, name=name, lifetime_s=lifetime_s, mounts=mounts, tmpfs=tmpfs,
            package_cache=package_cache, pip=pip, secrets=secrets, secrets_at_egress=secrets_at_egress,
            from_snapshot=from_snapshot, **options), runner=self)

    def snapshots(self) -> list[Snapshot]:
        """See AsyncRunner.snapshots."""
        return self._call(self.aio.snapshots)

    def delete_snapshot(self, snapshot: Snapshot | str) -> None:
        """See AsyncRunner.delete_snapshot."""
        self._call(functools.partial(self.aio.delete_snapshot, snapshot))

    def gc_snapshots(self, backend: str | None = None) -> list[str]:
        """See AsyncRunner.gc_snapshots."""
        return self._call(functools.partial(self.aio.gc_snapshots, backend))


class Sandbox:
    """The sync facade of AsyncSandbox; use it as a context manager."""

    def __init__(self, inner: AsyncSandbox, *, runner: Runner | None = None) -> None:
        self.aio = inner
        # The facade of the runner it came from, kept alive: collected, it would close the backends this uses.
        self._runner = runner
        self._loop: _LoopThread | None = None
        self._closing: _Closing | None = None

    def __enter__(self) -> Sandbox:
        return self.open()

    def open(self) -> Sandbox:
        """Open the sandbox: what ``with`` does on entering, for an owner that holds it longer than a block
        (``sb = execbox.sandbox().open()`` ... ``sb.close()``). An open sandbox is returned as it is."""
        if self._loop is not None:
            return self
        # One loop thread per runner: a sandbox a Runner opened runs in that runner's loop, and only one made
        # without one (execbox.sandbox) starts its own.
        runner = self._runner
        loop = runner._loop_thread() if runner is not None else _LoopThread()
        try:
            loop.call(self.aio.open)  # as every call: the caller's trace context goes along
        except BaseException:
            if runner is None:
                loop.stop(cancel=True)
            raise
        self._held(loop, owns_loop=runner is None)
        return self

    def _held(self, loop: _LoopThread, *, owns_loop: bool) -> None:
        """This open sandbox's calls go to ``loop``; closing it (or collecting it) closes it there."""
        self._loop = loop
        self._closing = _Closing(self, loop, self.aio.close, owns_loop=owns_loop)  # and its own runner
        if self._runner is not None:
            self._runner._sandboxes.add(self)

    def __exit__(self, *exc: Any) -> None:
        self.close(*exc)

    def _forget(self) -> None:
        if self._closing is not None:
            self._closing.forget()
        self._loop = self._closing = None

    def close(self, *exc: Any) -> None:
        """Close the sandbox (what ``with`` does on leaving the block); a second call does nothing."""
        closing, self._loop, self._closing = self._closing, None, None
        _OPEN_FACADES.discard(self)
        if closing is not None:
            closing.now(cancel=bool(exc) and exc[0] is not None)

    @property
    def backend(self) -> ExecutionBackend | None:
        return self.aio.backend

    @property
    def id(self) -> str:
        """This sandbox's id: in the audit log, and in `execbox ps` / `execbox kill`."""
        return self.aio.id

    def _call(self, fn: Callable[..., Awaitable[T]], *args: Any, **kw: Any) -> T:
        if self._loop is None:
            raise SandboxError("this sandbox is not open (closed already, never opened, or opened by the process "
                               "this one was forked from): use it as `with execbox.sandbox() as sb:` and call it "
                               "inside that block, or open it first (`sb.open()`)")
        return self._loop.call(functools.partial(fn, *args, **kw))

    def exec(self, command: str | Sequence[str], *, network: NetworkMode | None = None, timeout: float | None = None,
             env: Mapping[str, str] | None = None, stdin: bytes | str | None = None,
             files: Mapping[str, bytes | str] | None = None, workdir: str | None = None,
             max_output_bytes: int | None = None, limits: Limits | None = None, mounts: Sequence[Mount] | None = None,
             collect: Sequence[str] | None = None, secrets: Mapping[str, Secret | str] | None = None,
             secrets_at_egress: Given | None = None, on_stdout: OnText | None = None,
             on_stderr: OnText | None = None) -> ExecResult:
        return self._call(
            self.aio.exec, command,
            network=network, timeout=timeout, env=env, stdin=stdin, files=files, workdir=workdir,
            max_output_bytes=max_output_bytes, limits=limits, mounts=mounts, collect=collect, secrets=secrets,
            secrets_at_egress=secrets_at_egress, on_stdout=on_stdout, on_stderr=on_stderr)

    def run_code(self, code: str, language: Language = "python", *, network: NetworkMode | None = None,
                 timeout: float | None = None, env: Mapping[str, str] | None = None, stdin: bytes | str | None = None,
                 files: Mapping[str, bytes | str] | None = None, workdir: str | None = None,
                 max_output_bytes: int | None = None, limits: Limits | None = None,
                 mounts: Sequence[Mount] | None = None, collect: Sequence[str] | None = None,
                 secrets: Mapping[str, Secret | str] | None = None, secrets_at_egress: Given | None = None,
                 on_stdout: OnText | None = None, on_stderr: OnText | None = None) -> ExecResult:
        return self._call(
            self.aio.run_code, code, language,
            network=network, timeout=timeout, env=env, stdin=stdin, files=files, workdir=workdir,
            max_output_bytes=max_output_bytes, limits=limits, mounts=mounts, collect=collect, secrets=secrets,
            secrets_at_egress=secrets_at_egress, on_stdout=on_stdout, on_stderr=on_stderr)

    def run_cell(self, code: str, *, timeout: float | None = None, pip: bool = True, on_stdout: OnText | None = None,
                 on_stderr: OnText | None = None) -> CellResult:
        """Python in this sandbox's persistent interpreter; see AsyncSandbox.run_cell."""
        return self._call(self.aio.run_cell, code, timeout=timeout, on_stdout=on_stdout, on_stderr=on_stderr, pip=pip)

    def execute(self, request: ExecRequest) -> ExecResult:
        return self._call(self.aio.execute, request)

    def write_file(self, path: str, data: bytes | str) -> None:
        self._call(self.aio.write_file, path, data)

    def read_file(self, path: str, *, max_bytes: int | None = None) -> bytes:
        return self._call(self.aio.read_file, path, max_bytes=max_bytes)

    def list_files(self, path: str = ".", *, recursive: bool = False) -> list[FileInfo]:
        return self._call(self.aio.list_files, path, recursive=recursive)

    def upload(self, local_path: str | os.PathLike[str], remote: str | None = None) -> Transfer:
        return self._call(self.aio.upload, local_path, remote)

    def download(self, remote: str, local_path: str | os.PathLike[str]) -> Transfer:
        return self._call(self.aio.download, remote, local_path)

    def pip_install(self, *requirements: str, on_stdout: OnText | None = None,
                    on_stderr: OnText | None = None) -> ExecResult:
        return self._call(self.aio.pip_install, *requirements, on_stdout=on_stdout, on_stderr=on_stderr)

    def snapshot(self, name: str | None = None, *, memory: bool = False) -> Snapshot:
        """See AsyncSandbox.snapshot."""
        return self._call(self.aio.snapshot, name, memory=memory)

    def rollback(self, snapshot: Snapshot | str) -> None:
        """See AsyncSandbox.rollback."""
        self._call(self.aio.rollback, snapshot)

    def fork(self, count: int = 1) -> list[Sandbox]:
        """See AsyncSandbox.fork: ``count`` open sandboxes, each yours to close (``with`` each, or ``close()``)."""
        forks = self._call(self.aio.fork, count)
        assert self._loop is not None
        held = []
        for child in forks:
            facade = Sandbox(child, runner=self._runner)
            facade._held(self._loop, owns_loop=False)
            held.append(facade)
        return held
