"""The start-up sweep: a backend that declares ``sweeps_on_first_use`` runs its gc after the first successful
check of each process and scope, never again in that process, and never fails a check because of it."""

from __future__ import annotations

import os
import uuid

import anyio

from execbox import Settings
from execbox.plugin import Capabilities, ExecutionBackend


def _backend(sweeps: bool, fail: bool = False) -> type[ExecutionBackend]:
    scope = uuid.uuid4().hex  # a scope of this test's own

    class Counting(ExecutionBackend):
        name = "counting"
        capabilities = Capabilities(sandbox=True, isolation="container")
        sweeps_on_first_use = sweeps
        swept = 0

        def sweep_scope(self) -> str:
            return scope

        async def open_session(self, spec):  # type: ignore[no-untyped-def]  # never opened here
            raise NotImplementedError

        async def gc(self) -> list[str]:
            type(self).swept += 1
            if fail:
                raise RuntimeError("the sweep broke")
            return []

    return Counting


def _check(cls: type[ExecutionBackend]) -> Capabilities:
    return anyio.run(cls(Settings()).check)


def test_gc_runs_once_per_process_and_scope() -> None:
    cls = _backend(True)
    _check(cls)
    _check(cls)  # another instance, same process and scope
    assert cls.swept == 1  # type: ignore[attr-defined]
    other = _backend(True)
    _check(other)
    assert other.swept == 1  # type: ignore[attr-defined]


def test_a_backend_that_does_not_declare_it_is_not_swept() -> None:
    cls = _backend(False)
    _check(cls)
    assert cls.swept == 0  # type: ignore[attr-defined]


def test_a_failing_sweep_does_not_fail_the_check() -> None:
    cls = _backend(True, fail=True)
    assert _check(cls).sandbox
    assert cls.swept == 1  # type: ignore[attr-defined]


def test_a_forked_child_sweeps_again() -> None:
    cls = _backend(True)
    _check(cls)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        try:
            _check(cls)
            os.write(write, str(cls.swept).encode())  # type: ignore[attr-defined]
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    assert os.read(read, 16) == b"2"
    os.close(read)
