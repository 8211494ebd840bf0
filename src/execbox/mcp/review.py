"""Approval of destructive commands: every reviewer's decision, the strictest wins, "ask" asks a person.

The reviewers are execbox's own rules and the operator's rules file (``guard.commands``) and every plugin's
``execbox_review_command`` hook. ``allow`` runs the command; ``deny`` refuses it; ``ask`` sends the person at
the client an approval request (MCP elicitation) naming the command and why; a client that cannot ask (no
elicitation capability) gets a refusal that says what would need approval. A checkpoint, not a sandbox: the
sandbox contains what runs; the review makes a person look first at what is hard to take back.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from execbox.config.settings import Settings
from execbox.contract.review import ReviewDecision, ReviewRequest, strictest
from execbox.guard.commands import review
from execbox.registry import Registry

MAX_SHOWN = 2000  # characters of the command a person is shown


class Approval(BaseModel):
    """The approval form a person fills in (MCP elicitation: primitive fields only)."""

    approve: bool = Field(description="Run this command?")


class Gate(BaseModel):
    """What the review resolved before a command runs (when it did not ask a person)."""

    action: str  # allow | deny
    message: str = ""
    #: True when the answer is a refusal only because the client cannot ask for approval.
    unattended: bool = False
    #: The error (as ExecboxError.to_dict) when the call was refused before the review.
    error: dict[str, object] | None = None


def decisions(request: ReviewRequest, settings: Settings, registry: Registry) -> list[ReviewDecision]:
    """Every reviewer's decisions that are not plain allow: execbox's rules, the rules file, then each plugin.
    A plugin that raises or answers something else than decisions counts as deny (policy fails closed)."""
    found = list(review(request, settings))
    pm = registry.pm
    if pm is None:
        return found
    for impl in pm.hook.execbox_review_command.get_hookimpls():
        source = impl.plugin_name
        try:
            answer = impl.function(request=request)
        except Exception as exc:
            found.append(ReviewDecision(action="deny", source=source, rule="plugin-error",
                                        reason=f"the review plugin {source!r} failed ({type(exc).__name__}: {exc})"))
            continue
        for item in answer if isinstance(answer, list) else [answer]:
            if item is None:
                continue
            if not isinstance(item, ReviewDecision):
                found.append(ReviewDecision(action="deny", source=source, rule="plugin-error",
                                            reason=f"the review plugin {source!r} answered {type(item).__name__}, "
                                                   "not a ReviewDecision"))
            elif item.action != "allow":
                found.append(item.model_copy(update={"source": source}))
    return found


def why(found: list[ReviewDecision]) -> str:
    """The reasons, in one line a person can judge."""
    return "; ".join(f"it {d.reason}" if d.source == "execbox" else f"{d.source}: {d.reason}" for d in found)


def question(request: ReviewRequest, found: list[ReviewDecision]) -> str:
    """The approval request a person sees."""
    shown = request.text if len(request.text) <= MAX_SHOWN else request.text[:MAX_SHOWN] + " [...]"
    where = f" on {request.backend}" + (" (this host, unsandboxed)" if request.posture == 3 else "")
    return (f"execbox: an agent asks to run this ({request.tool}{where}):\n\n{shown}\n\n"
            f"It needs your approval because {why([d for d in found if d.action == 'ask'])}. Approve it?")


def refusal(request: ReviewRequest, found: list[ReviewDecision], *, unattended: bool) -> str:
    if strictest(found) == "deny":
        return f"refused by the command policy: {why([d for d in found if d.action == 'deny'])}. Do not retry it"
    if unattended:
        return (f"refused: this {request.tool} needs a person's approval because "
                f"{why([d for d in found if d.action == 'ask'])}, and this MCP client cannot ask for it (it does not "
                "support elicitation). Ask the user to run it themselves, or to approve it from a client that can ask")
    return "refused: the user did not approve this command. Do not retry it unless the user asks you to"
