"""The pydantic-ai toolset (execbox.integrations.pydantic_ai) under a real Agent with a scripted FunctionModel,
on docker and bubblewrap: the model calls run_python and run_shell, the state persists between calls of one run,
the model gets the real output back, each run has a sandbox of its own that closes when the run ends, and a
sandbox given to the toolset is shared across runs and left to its owner. The README's example runs too."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

import execbox
from execbox import Runner, Settings
from execbox.audit import reader as audit_reader
from execbox.integrations.pydantic_ai import ExecboxToolset
from tests.support import readme
from tests.test_kernel import _usable

Call = tuple[str, dict[str, Any]]


def scripted(*turns: list[Call]) -> FunctionModel:
    """Each turn: the tool calls the model makes; after the last, it answers with every tool return it got."""
    script = list(turns)

    def respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if script:
            return ModelResponse(parts=[ToolCallPart(name, args) for name, args in script.pop(0)])
        returns = [str(part.content) for message in messages for part in getattr(message, "parts", [])
                   if isinstance(part, ToolReturnPart)]
        return ModelResponse(parts=[TextPart("\n---\n".join(returns))])

    return FunctionModel(respond)


def sandbox_events() -> list[tuple[str, str]]:
    records = audit_reader.records(Path(Settings().audit_log or ""))
    return [(r["event"], r["session"]) for r in records if r["event"] in ("sandbox.open", "sandbox.close")]


@pytest.mark.engine
def test_an_agent_runs_python_and_shell_in_one_sandbox_per_run(backend: str) -> None:
    agent = Agent(toolsets=[ExecboxToolset(backend)])
    first = agent.run_sync("compute", model=scripted(
        [("run_python", {"code": "x = 6 * 7\nprint('x is', x)"})],
        [("run_python", {"code": "x + 1"}), ("run_shell", {"command": "echo from-shell > f.txt; cat f.txt; id -u"})],
        [("run_python", {"code": "1 / 0"})],
    ))
    answer = first.output.split("\n---\n")
    assert answer[0] == "x is 42\n" and answer[1] == "Out: 43\n"
    assert answer[2].startswith("exit code 0\nfrom-shell\n") and answer[2].split("\n")[2].isdigit()
    assert "ZeroDivisionError" in answer[3]  # an error is the tool's output, for the model to read
    second = agent.run_sync("again", model=scripted([("run_python", {"code": "print('x' in dir())"})]))
    assert second.output == "False\n"  # a run of its own, a sandbox of its own
    opened = sandbox_events()
    assert [event for event, _ in opened] == ["sandbox.open", "sandbox.close"] * 2  # each closed with its run


@pytest.mark.engine
def test_a_sandbox_given_to_the_toolset_is_shared_and_left_open(backend: str) -> None:
    async def main() -> list[str]:
        async with execbox.asandbox(backend) as sb:
            agent = Agent(toolsets=[ExecboxToolset(sandbox=sb)])
            outputs = []
            for code in ("kept = 'across runs'", "print(kept)"):
                result = await agent.run("go", model=scripted([("run_python", {"code": code})]))
                outputs.append(result.output)
            outputs.append((await sb.exec("echo still open")).stdout)
        await sb.close()  # closing twice is fine; a closed sandbox does not reopen
        with pytest.raises(execbox.SandboxError, match="does not reopen"):
            await sb.open()
        return outputs

    import anyio

    assert anyio.run(main) == ["the code ran and printed nothing", "across runs\n", "still open\n"]


@pytest.mark.engine
def test_the_readme_example(capsys: pytest.CaptureFixture[str]) -> None:
    with Runner() as runner:
        _usable(runner, "docker")
    code = readme.blocks("### pydantic-ai", "python")[0]
    model_line = re.compile(r'^agent = Agent\("[^"]+", ', re.M)
    assert len(model_line.findall(code)) == 1, "the README example names its model once, in Agent(...)"
    model = scripted([("run_python", {"code": "sum(n for n in range(2, 100) if all(n % d for d in range(2, n)))"})])
    namespace: dict[str, Callable[..., Any] | FunctionModel] = {"scripted": model}
    exec(model_line.sub("agent = Agent(scripted, ", code), namespace)  # noqa: S102 - the README's own code
    assert capsys.readouterr().out.strip() == "Out: 1060"
