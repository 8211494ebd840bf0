"""A pydantic-ai toolset: each agent run gets one execbox sandbox, and tools that run Python and shell commands in it.

    from pydantic_ai import Agent
    from execbox.integrations.pydantic_ai import ExecboxToolset

    agent = Agent("openai:gpt-5", toolsets=[ExecboxToolset("docker")])
    agent.run_sync("How many primes are there below 10000?")

``run_python`` runs code in the sandbox's persistent interpreter (``run_cell``: variables and imports persist
between calls; ``%pip install`` lines install from execbox's package cache), ``run_shell`` a command (``exec``).
The sandbox opens at the run's first tool call and closes when the run ends (a run is a toolset's lifetime in
pydantic-ai: ``for_run`` gives each run a fresh one). To keep one sandbox across runs, open it yourself and pass
it: ``ExecboxToolset(sandbox=await execbox.asandbox("docker").open())``; its owner closes it.
"""

from __future__ import annotations

from typing import Any

import anyio

import execbox
from execbox.integrations import missing_extra

try:
    from pydantic_ai import RunContext
    from pydantic_ai.toolsets import AbstractToolset, FunctionToolset
except ImportError as exc:
    raise missing_extra(__name__, "pydantic-ai", "pydantic-ai", exc) from exc

__all__ = ["ExecboxToolset"]


class ExecboxToolset(FunctionToolset[Any]):
    """The tools ``run_python`` and ``run_shell`` over one execbox sandbox per agent run: ``execbox.asandbox(backend,
    **options)``, or ``sandbox``, an open AsyncSandbox of yours. ``timeout``: seconds per call (execbox's ceiling
    when None). Calls run one at a time (``sequential``): they share the sandbox's state."""

    def __init__(self, backend: str | None = None, *, sandbox: execbox.AsyncSandbox | None = None,
                 timeout: float | None = None, id: str | None = None, **options: Any) -> None:
        super().__init__([self.run_python, self.run_shell], sequential=True, id=id)
        self._backend, self._options, self._timeout, self._given = backend, options, timeout, sandbox
        self._sandbox = sandbox
        self._opening = anyio.Lock()

    async def for_run(self, ctx: RunContext[Any]) -> AbstractToolset[Any]:
        """A fresh toolset (so a fresh sandbox) for each run, unless the sandbox is one given to share."""
        if self._given is not None:
            return self
        return ExecboxToolset(self._backend, timeout=self._timeout, id=self._id, **self._options)

    async def __aexit__(self, *args: Any) -> bool | None:
        sandbox, self._sandbox = self._sandbox, self._given
        if sandbox is not None and sandbox is not self._given:
            await sandbox.close()
        return None

    async def _open(self) -> execbox.AsyncSandbox:
        async with self._opening:
            if self._sandbox is None:
                self._sandbox = await execbox.asandbox(self._backend, **self._options).open()
            return self._sandbox

    async def run_python(self, code: str) -> str:
        """Run Python code in the sandbox's interpreter. Variables, imports and files persist from call to call; the
        value of the last expression is shown. A line `%pip install <package>` installs a package.

        Args:
            code: the Python source to run
        """
        cell = await (await self._open()).run_cell(code, timeout=self._timeout)
        parts = [cell.stdout, cell.stderr]  # stderr holds the traceback of an error
        for output in cell.outputs:
            label = "Out" if output.kind == "result" else "Display"
            parts.append(f"{label}: {output.text}\n" if output.text is not None else
                         f"{label}: [{', '.join(output.data)}]\n")
        if cell.error is not None and cell.error.name not in cell.stderr:
            parts.append(f"{cell.error.name}: {cell.error.value}\n")
        return _joined(parts, cell.notes, "the code ran and printed nothing")

    async def run_shell(self, command: str) -> str:
        """Run a shell command (sh -c) in the sandbox's workspace; files persist from call to call.

        Args:
            command: the shell command line
        """
        result = await (await self._open()).exec(command, timeout=self._timeout)
        return _joined([f"exit code {result.exit_code}\n", result.stdout, result.stderr], result.notes, "")


def _joined(parts: list[str], notes: list[str], empty: str) -> str:
    text = "".join(part if part.endswith("\n") or not part else part + "\n" for part in parts)
    text += "".join(f"[execbox] {note}\n" for note in notes)
    return text or empty
