"""The check of the env policy: the request's variables reach the code; secret-looking ones and the host's
own environment do not."""

from __future__ import annotations

from execbox.testing.framework import Family, Kit, expect, reported
from execbox.testing.host import host_env

family = Family()


@family.check("the env policy: the request's variables pass, secrets and the host's environment do not")
def check_env_policy(kit: Kit) -> None:
    claim = "the env policy"
    env = {"VISIBLE": "yes", "OPENAI_API_KEY": "sk-secret", "GITHUB_PAT": "pat", "PYTHONHASHSEED": "0"}
    with host_env("EXECBOX_CONFORMANCE_HOST_ONLY", "host-value-must-not-leak"):
        result = kit.code("import os, json\nprint(json.dumps(dict(os.environ)))", env=env)
    seen = reported(result, claim, "probe of the environment")
    expect(seen.get("VISIBLE") == "yes" and seen.get("PYTHONHASHSEED") == "0", claim,
           "VISIBLE=yes and PYTHONHASHSEED=0 from the request", seen)
    leaked = sorted({"OPENAI_API_KEY", "GITHUB_PAT", "EXECBOX_CONFORMANCE_HOST_ONLY"} & set(seen))
    expect(not leaked, claim, "no secret-looking or host-only variable inside", leaked)
    expect("host-value-must-not-leak" not in result.stdout and "sk-secret" not in result.stdout, claim,
           "no secret value in the output", result.stdout)
    expect(result.filtered_env == ["GITHUB_PAT", "OPENAI_API_KEY"], claim,
           "filtered_env ['GITHUB_PAT', 'OPENAI_API_KEY']", result.filtered_env)
