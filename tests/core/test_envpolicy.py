"""The env policy: secret-looking names are dropped (case-insensitively), reported by name, never by value."""

from __future__ import annotations

from pathlib import Path

import pytest

from execbox import Runner, Settings
from execbox.core.envpolicy import BASE_PATH, filter_env, is_secret_name, sandbox_env

SECRET_NAMES = [
    "OPENAI_API_KEY", "STRIPE_APIKEY", "CLIENT_SECRET", "GITHUB_TOKEN", "DB_PASSWORD", "MYSQL_PASSWD",
    "ETH_PRIVATE_KEY", "AWS_ACCESS_KEY_ID", "WALLET_MNEMONIC", "SEED_PHRASE", "GOOGLE_APPLICATION_CREDENTIALS",
    "AUTH_HEADER", "SESSION_COOKIE", "JWT", "SENTRY_DSN", "DATABASE_URL", "GITHUB_PAT", "GITLAB_PAT",
]
KEPT_NAMES = ["PYTHONHASHSEED", "pythonhashseed", "HOME_DIR", "LANGUAGE", "MY_PATH", "X_PATTERN", "COMPAT", "DEBUG", "FOO"]


@pytest.mark.parametrize("name", SECRET_NAMES)
@pytest.mark.parametrize("case", [str.upper, str.lower, lambda s: s[:1].upper() + s[1:].lower()], ids=["upper", "lower", "mixed"])
def test_secret_names_are_dropped_in_any_case(name: str, case: object) -> None:
    assert is_secret_name(case(name))  # type: ignore[operator]


@pytest.mark.parametrize("part", ["API_KEY", "APIKEY", "SECRET", "TOKEN", "PASSWORD", "PASSWD", "PRIVATE_KEY",
                                  "ACCESS_KEY", "MNEMONIC", "SEED", "CREDENTIAL", "AUTH", "COOKIE", "JWT", "DSN",
                                  "DATABASE_URL"])
def test_each_listed_part_is_matched_anywhere_in_the_name(part: str) -> None:
    assert is_secret_name(part)
    assert is_secret_name(f"x_{part.lower()}_y")


@pytest.mark.parametrize("name", KEPT_NAMES)
def test_ordinary_names_and_pythonhashseed_are_kept(name: str) -> None:
    assert not is_secret_name(name)


def test_pythonhashseed_is_the_only_seed_exception() -> None:
    assert is_secret_name("MY_PYTHONHASHSEED_COPY")


def test_filter_env_splits_kept_and_dropped_names() -> None:
    kept, dropped = filter_env({"FOO": "1", "github_token": "t", "PYTHONHASHSEED": "0", "X_PAT": "p"})
    assert kept == {"FOO": "1", "PYTHONHASHSEED": "0"}
    assert dropped == ["X_PAT", "github_token"]


def test_sandbox_env_is_a_minimal_base_plus_the_request() -> None:
    env = sandbox_env({"FOO": "bar"}, home="/workspace")
    assert env == {"PATH": BASE_PATH, "HOME": "/workspace", "LANG": "C.UTF-8", "TMPDIR": "/tmp",
                   "PYTHONUNBUFFERED": "1", "FOO": "bar"}


def test_a_run_inherits_nothing_and_reports_dropped_names_without_values(
    monkeypatch: pytest.MonkeyPatch, home: Path
) -> None:
    monkeypatch.setenv("EXECBOX_TEST_HOST_ONLY", "host-value-must-not-leak")
    secrets = {name: f"value-of-{name.lower()}-s3cr3t" for name in SECRET_NAMES}
    runner = Runner(Settings.from_env(local=True, network="host"))
    result = runner.run(["env"], backend="local_subprocess", env={**secrets, "FOO": "bar", "PYTHONHASHSEED": "0"})
    assert result.exit_code == 0, result.stderr
    names = {line.split("=", 1)[0] for line in result.stdout.splitlines()}
    assert names == {"PATH", "HOME", "LANG", "TMPDIR", "PYTHONUNBUFFERED", "FOO", "PYTHONHASHSEED"}
    assert result.filtered_env == sorted(SECRET_NAMES)
    dumped = result.model_dump_json()
    for value in [*secrets.values(), "host-value-must-not-leak"]:
        assert value not in dumped
