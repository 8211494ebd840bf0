"""A smolagents executor: a CodeAgent's code runs in one execbox sandbox, cell after cell (``run_cell``).

    from smolagents import CodeAgent
    from execbox.integrations.smolagents import ExecboxExecutor

    with ExecboxExecutor(backend="docker", additional_imports=["numpy"]) as executor:
        agent = CodeAgent(tools=[], model=model, executor=executor)
        agent.run("What is the 10th Fibonacci number?")

It is smolagents' RemotePythonExecutor (as its E2B, Docker and Modal executors are): the agent's tools are sent
as code, its ``final_answer`` raises an exception whose value is the answer, and ``!pip install`` lines (its
``additional_imports``, a tool's requirements) go through execbox's package cache. Variables, imports and files
persist between the agent's steps until ``cleanup()`` (``CodeAgent.cleanup``, or leaving ``with``).
"""

from __future__ import annotations

import io
import re
from typing import Any

import execbox
from execbox.integrations import missing_extra

try:
    import PIL.Image  # smolagents' own dependency: named after it, so a missing smolagents is what the error says
    from smolagents.local_python_executor import CodeOutput
    from smolagents.monitoring import AgentLogger, LogLevel
    from smolagents.remote_executors import RemotePythonExecutor
    from smolagents.tools import get_tools_definition_code
    from smolagents.utils import AgentError
except ImportError as exc:
    raise missing_extra(__name__, "smolagents", "smolagents", exc) from exc

__all__ = ["ExecboxExecutor"]

#: The imports smolagents hoists out of its patched final_answer, which uses them only if they are there.
_OPTIONAL = re.compile(r"^import (?:numpy|PIL)$", re.M)


class ExecboxExecutor(RemotePythonExecutor):  # type: ignore[misc]  # smolagents ships no type information
    """``CodeAgent(executor=ExecboxExecutor(...))``. ``sandbox``: an open execbox Sandbox to use (its owner closes
    it); otherwise one is opened with ``execbox.sandbox(backend, **options)`` and closed by ``cleanup()``.
    ``timeout``: seconds each step's code may run (execbox's ceiling when None)."""

    def __init__(self, additional_imports: list[str] | None = None, logger: AgentLogger | None = None, *,
                 backend: str | None = None, sandbox: execbox.Sandbox | None = None, timeout: float | None = None,
                 allow_pickle: bool = False, **options: Any) -> None:
        super().__init__(list(additional_imports or []), logger or AgentLogger(LogLevel.INFO), allow_pickle)
        self.timeout = timeout
        self._owns = sandbox is None
        self.sandbox = (execbox.sandbox(backend, **options) if sandbox is None else sandbox).open()
        try:
            self.installed_packages = self.install_packages(self.additional_imports)
        except BaseException:
            self.cleanup()
            raise

    def send_tools(self, tools: dict[str, Any]) -> None:
        """smolagents' own (RemotePythonExecutor.send_tools), but for its patched final_answer: that imports PIL and
        numpy only to serialise such values when they are there (E2B's image has them), yet smolagents counts them
        as requirements and hoists their imports to the top of the tools' code. Here they stay optional: no 20 MB
        install for every agent, and a sandbox without them runs the tools' code."""
        if "final_answer" in tools:
            self._patch_final_answer_with_exception(tools["final_answer"])
        wanted = {req for name, t in tools.items() if name != "final_answer" for req in t.to_dict()["requirements"]}
        wanted -= {"smolagents", *self.installed_packages}
        if "PIL" in wanted:
            wanted = (wanted - {"PIL"}) | {"pillow"}
        if wanted:
            self.installed_packages += self.install_packages(sorted(wanted))
        code = _OPTIONAL.sub(r"try:\n    \g<0>\nexcept ImportError:\n    pass", get_tools_definition_code(tools))
        self.logger.log(self.run_code_raise_errors(code).logs)

    def run_code_raise_errors(self, code: str) -> CodeOutput:
        result = self.sandbox.run_cell(code, timeout=self.timeout)
        logs = result.stdout
        error = result.error
        if error is not None and error.name == self.FINAL_ANSWER_EXCEPTION:
            try:
                answer = self._deserialize_final_answer(error.value, self.allow_pickle)
            except ValueError as exc:  # cut at execbox's bound on an error's text (64 KiB), or not smolagents'
                raise AgentError(f"the final answer could not be read back from the sandbox: {exc}",
                                 self.logger) from None
            return CodeOutput(output=answer, logs=logs, is_final_answer=True)
        if not result.ok:
            what = (f"{error.name}\n{error.value}\n{error.traceback}" if error is not None
                    else "the code was stopped (timed out or out of memory)")
            notes = "".join(f"\n[execbox] {note}" for note in result.notes)
            raise AgentError(f"{logs}\nExecuting code yielded an error:\n{what}{notes}", self.logger)
        if result.stderr:
            logs += result.stderr
        for output in result.outputs:
            if output.kind == "result":
                png = output.binary("image/png")
                return CodeOutput(output=PIL.Image.open(io.BytesIO(png)) if png else output.text, logs=logs,
                                  is_final_answer=False)
        return CodeOutput(output=None, logs=logs, is_final_answer=False)

    def cleanup(self) -> None:
        """Close the sandbox this executor opened (one it was given is its owner's to close)."""
        if self._owns:
            self.sandbox.close()

    def __enter__(self) -> ExecboxExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
