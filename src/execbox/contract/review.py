"""What a command review is asked and answers: the data of the ``execbox_review_command`` hook.

A review runs before an agent's command does (the MCP tools ``run_command``, ``run_code``, ``shell``). Each
reviewer — execbox's own (``guard.commands``), the operator's rules file, a plugin — answers ``allow``, ``ask``
or ``deny`` with a reason, or nothing; the strictest answer wins (deny > ask > allow). ``ask`` means a person
approves it first (MCP elicitation). It is a checkpoint in front of the sandbox, not a sandbox: a review reads
what it can see of a command, and code can always do what it does not show.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

ReviewAction = Literal["allow", "ask", "deny"]
STRICTNESS: dict[str, int] = {"allow": 0, "ask": 1, "deny": 2}


class ReviewRequest(BaseModel):
    """One command as an agent asked for it."""

    model_config = ConfigDict(frozen=True)

    #: The tool that would run it: ``run_command``, ``run_code``, ``shell``.
    tool: str
    #: What ``text`` is: a shell command line, an argv, Python or bash code.
    kind: Literal["shell", "argv", "python", "bash"]
    #: The command line or the code, as given (an argv joined with shell quoting).
    text: str
    argv: list[str] | None = None
    #: The workspace as the command sees it (relative paths start there).
    workspace: str = "/workspace"
    backend: str = ""
    #: AGENT_COMPUTE_POSTURE of the surface asking: 3 means the command runs on the host itself.
    posture: int = 0
    #: Who asks, outermost first (the MCP client, the grant chain).
    chain: list[str] = Field(default_factory=list)


class ReviewDecision(BaseModel):
    """A reviewer's answer: the action, why in words a person approving it can judge, and which rule."""

    model_config = ConfigDict(frozen=True)

    action: ReviewAction
    reason: str
    rule: str = ""
    #: Who decided: ``execbox`` (the built-in rules), ``rules-file``, or a plugin's name.
    source: str = "execbox"


def strictest(decisions: Iterable[ReviewDecision]) -> ReviewAction:
    """deny > ask > allow; no decision at all is allow."""
    action: ReviewAction = "allow"
    for decision in decisions:
        if STRICTNESS[decision.action] > STRICTNESS[action]:
            action = decision.action
    return action
