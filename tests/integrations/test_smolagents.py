"""The smolagents executor (execbox.integrations.smolagents) under a real CodeAgent with a scripted model, on
docker and bubblewrap: the agent's code runs in the sandbox step after step with its state kept, its
``!pip install`` comes from execbox's package cache (a loopback index, nothing else), a tool sent as code runs
inside, an error is an observation the agent recovers from, and ``final_answer`` ends the run with the value.
The README's example runs too, with the scripted model in place of its own."""

from __future__ import annotations

import re
from typing import Any

import pytest
from smolagents import CodeAgent, tool
from smolagents.models import ChatMessage, MessageRole, Model

from execbox import Runner
from execbox.integrations.smolagents import ExecboxExecutor
from tests.support import readme
from tests.support.wheels import MODULE, NAME, VALUE, VERSION, Index, probe_cache, probe_index  # noqa: F401 - fixtures
from tests.test_kernel import _usable


class ScriptedModel(Model):  # type: ignore[misc]
    """Answers each step with the next scripted code block, and keeps what the agent showed it."""

    def __init__(self, *steps: str) -> None:
        super().__init__(model_id="scripted")
        self.steps = list(steps)
        self.seen: list[str] = []

    def generate(self, messages: list[Any], stop_sequences: list[str] | None = None, **kw: Any) -> ChatMessage:
        self.seen.append(str(messages[-1].content))
        code = self.steps.pop(0)
        return ChatMessage(role=MessageRole.ASSISTANT, content=f"Thought: next step.\n<code>\n{code}\n</code>")


@tool
def sandbox_uid() -> int:
    """The user id the code runs as."""
    import os

    return os.getuid()


@pytest.mark.engine
def test_a_code_agent_runs_its_steps_in_one_sandbox(backend: str, probe_cache: Index) -> None:
    model = ScriptedModel(
        f"!pip install {NAME}\nimport {MODULE}\ntotal = 40\nprint('installed', {MODULE}.VALUE, 'uid', sandbox_uid())",
        "total += 2\nprint('total', total)\n1 / 0",
        f"final_answer(f'{{{MODULE}.VALUE}} {{total}}')",
    )
    with ExecboxExecutor(backend=backend) as executor:
        agent = CodeAgent(tools=[sandbox_uid], model=model, executor=executor, max_steps=5)
        answer = agent.run("Install the probe package and add two to forty.")
        assert answer == f"{VALUE} 42"
        uid = executor.sandbox.exec(["id", "-u"]).stdout.strip()
    assert f"installed {VALUE} uid {uid}" in model.seen[1]  # the tool ran inside, as the sandbox user
    assert "total 42" in model.seen[2] and "ZeroDivisionError" in model.seen[2]  # the error is an observation
    assert probe_cache.downloads == [f"{MODULE}-{VERSION}-py3-none-any.whl"]  # fetched once, on the host


@pytest.mark.engine
def test_the_readme_example(probe_cache: Index, capsys: pytest.CaptureFixture[str]) -> None:
    with Runner() as runner:
        _usable(runner, "docker")
    code = readme.blocks("### smolagents", "python")[0]
    model_line = re.compile(r"^model = .*$", re.M)
    assert len(model_line.findall(code)) == 1, "the README example builds its model on one line"
    scripted = ScriptedModel("import math\nradius = 2.0\nprint(round(math.pi * radius ** 2, 2))",
                             "final_answer(round(math.pi * radius ** 2, 2))")
    exec(model_line.sub("model = scripted", code), {"scripted": scripted})  # noqa: S102 - the README's own code
    assert capsys.readouterr().out.strip().endswith("12.57")
