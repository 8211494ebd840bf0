"""What a run with secrets runs - the argv and stdin that carry them in, the env that holds the placeholders of
secrets at egress, the redactor of every value - and the refusal of secrets at egress a run cannot carry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from execbox.secrets.egress import RunSecrets
from execbox.secrets.values import R


@dataclass
class RunPlan:
    """What a run with declared secrets runs: the argv and stdin that carry them in (secrets.values.deliver), the
    env with the placeholders of its secrets at egress, the redactor of every value, the placeholders' owner."""

    argv: list[str]
    stdin: bytes | None
    env: dict[str, str]
    names: list[str]
    redactor: Any = None
    egress: RunSecrets | None = None

    def finish(self, result: R) -> R:
        """The result as the caller may see it (secrets.values.redact_result), and a note when secrets at
        egress were given but no proxy run took them."""
        from execbox.secrets.values import redact_result

        if self.egress is not None and not self.egress.attached:
            backend = getattr(result, "backend", "") or "?"
            result = result.model_copy(update={"notes": [*getattr(result, "notes", []), (
                f"secrets at egress ({', '.join(self.egress.names)}) were not used: backend {backend} did not "
                "route this run through execbox's egress proxy, so the command saw only placeholders")]})
        return redact_result(result, self.redactor, self.names)


def refuse_uncarried(request: Any, *, backend: Any) -> None:
    """Refuse (before any sandbox opens) secrets at egress that this request's network mode or backend cannot
    carry, and a name declared both as a secret and as a secret at egress. The admission asks this."""
    from execbox.errors import ConfigError, UnsupportedPolicyError

    both = sorted(set(request.secrets) & set(request.secrets_at_egress))
    if both:  # a sandbox's secrets and an exec's, say
        raise ConfigError(f"{', '.join(both)} declared both as a secret and as a secret at egress; give each once")
    if not request.secrets_at_egress:
        return
    if request.network != "proxy":
        raise UnsupportedPolicyError(
            f"refused: secrets at egress ({', '.join(sorted(request.secrets_at_egress))}) need network mode "
            f"proxy, which substitutes them; this run's is {request.network!r}. Use network='proxy' (and "
            "allow the hosts in CODE_EXEC_EGRESS_ALLOW), or pass the values as secrets=", backend=backend.name,
            env_var="CODE_EXEC_NETWORK")
    if backend.capabilities.remote:
        raise UnsupportedPolicyError(
            f"refused: secrets at egress need execbox's own egress proxy; {backend.name} hands network mode "
            "proxy to its provider, which cannot substitute them. Use docker or bubblewrap, or secrets=",
            backend=backend.name)


def plan(request: Any, argv: list[str]) -> RunPlan:
    """The run plan of an admitted request (``refuse_uncarried`` said yes to its secrets at egress)."""
    from execbox.secrets.values import Redactor, deliver

    stdin, env = request.stdin, dict(request.env)
    egress: RunSecrets | None = None
    if request.secrets_at_egress:
        egress = RunSecrets(request.secrets_at_egress)
        env.update(egress.env())
    values = {**{n: s.reveal() for n, s in request.secrets.items()}, **(egress.values() if egress else {})}
    if request.secrets:
        argv, stdin = deliver(argv, stdin, request.secrets)
    return RunPlan(argv=argv, stdin=stdin, env=env, names=sorted(values), redactor=Redactor(values) if values else None,
                   egress=egress)
