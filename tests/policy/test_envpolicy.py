"""The env policy: variables with secret-looking names or values are dropped, reported by name, never by value.

tests/fixtures/env/cases.json holds the realistic mix (fake values): every pair under ``must_drop`` is
dropped, every pair under ``must_pass`` reaches the command unchanged.
"""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import pytest

from execbox import Runner, Settings
from execbox.policy.env import (
    BASE_PATH,
    filter_env,
    is_injection_name,
    is_secret_name,
    is_secret_value,
    sandbox_env,
)

CASES = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "env" / "cases.json").read_text())
MUST_DROP = [(group, name, value) for group, pairs in CASES["must_drop"].items() for name, value in pairs]
MUST_PASS = [(name, value) for pairs in CASES["must_pass"].values() for name, value in pairs]

SECRET_NAMES = [
    "OPENAI_API_KEY", "STRIPE_APIKEY", "CLIENT_SECRET", "GITHUB_TOKEN", "DB_PASSWORD", "MYSQL_PASSWD",
    "ETH_PRIVATE_KEY", "AWS_ACCESS_KEY_ID", "WALLET_MNEMONIC", "SEED_PHRASE", "GOOGLE_APPLICATION_CREDENTIALS",
    "AUTH_HEADER", "SESSION_COOKIE", "JWT", "SENTRY_DSN", "DATABASE_URL", "GITHUB_PAT", "GITLAB_PAT",
]


def test_the_fixtures_are_the_realistic_mix_the_issue_asks_for() -> None:
    assert len(MUST_DROP) >= 89 and len(MUST_PASS) >= 60
    by_value = [name for group, name, _ in MUST_DROP if group.startswith("by value")]
    assert len(by_value) >= 40


@pytest.mark.parametrize(("group", "name", "value"), MUST_DROP, ids=[f"{n}" for _, n, _ in MUST_DROP])
def test_must_drop(group: str, name: str, value: str) -> None:
    kept, dropped = filter_env({name: value, "OTHER": "1"})
    assert (kept, dropped) == ({"OTHER": "1"}, [name])
    # each case exercises one rule alone: a name case has an innocent value, a value case an innocent name
    if group.startswith("by name"):
        assert is_secret_name(name) and not is_secret_value(value)
    else:
        assert is_secret_value(value) and not is_secret_name(name)


@pytest.mark.parametrize(("name", "value"), MUST_PASS, ids=[n for n, _ in MUST_PASS])
def test_must_pass(name: str, value: str) -> None:
    assert filter_env({name: value}) == ({name: value}, [])


@pytest.mark.parametrize("name", SECRET_NAMES)
@pytest.mark.parametrize("case", [str.upper, str.lower, lambda s: s[:1].upper() + s[1:].lower()],
                         ids=["upper", "lower", "mixed"])
def test_secret_names_are_dropped_in_any_case(name: str, case: object) -> None:
    assert is_secret_name(case(name))  # type: ignore[operator]


@pytest.mark.parametrize("name", ["OPENAI_API_KEY", "GITHUB_TOKEN", "DB_PASSWORD", "FOO", "LANG", "CAF\u00c9"])
@pytest.mark.parametrize("form", ["NFD", "fullwidth", "cyrillic"])
def test_every_name_that_is_not_plain_ascii_is_dropped(name: str, form: str) -> None:
    # whatever it normalises to: a look-alike of an innocent name is no more a real variable than of a secret one
    spelled = {
        "NFD": unicodedata.normalize("NFD", name + "\u00c9"),
        "fullwidth": "".join(chr(ord(c) + 0xFEE0) if "!" <= c <= "~" else c for c in name),
        "cyrillic": name.replace("A", "\u0410").replace("E", "\u0415").replace("O", "\u041e") + "\u0410",
    }[form]
    assert not spelled.isascii()
    assert is_secret_name(spelled)


@pytest.mark.parametrize("name", ["-uPATH", "--chdir", "9LIVES", "A B", "A;B", "A\nB", "A$B"])
def test_names_that_are_not_names_are_dropped(name: str) -> None:
    # `env -i NAME=VALUE` on a remote wrapper would read a leading dash as an option
    assert is_secret_name(name)


def test_pythonhashseed_is_the_only_seed_exception() -> None:
    assert not is_secret_name("PYTHONHASHSEED") and not is_secret_name("pythonhashseed")
    assert is_secret_name("MY_PYTHONHASHSEED_COPY") and is_secret_name("RANDOM_SEED")


@pytest.mark.parametrize(("name", "dropped"), [
    ("SORT_KEY", False), ("SORT_KEY_2", False), ("PRIMARY_KEY_COLUMN", False), ("SSH_PUBLIC_KEY", False),
    ("MONKEY", False), ("KEYBOARD_LAYOUT", False), ("STRIPE_KEY", True), ("STRIPE_KEY_2", True), ("stripeKey", True),
    ("SIGNING_KEY_PEM", True), ("DEPLOY_KEYS", True), ("KEY", True), ("PK_COLUMN", False), ("WALLET_PK", True),
])
def test_the_key_rule(name: str, dropped: bool) -> None:
    assert is_secret_name(name) is dropped


@pytest.mark.parametrize(("value", "secret"), [
    ("https://user:pw@host/", True), ("https://user@host/", False), ("https://host:8443/a@b", False),
    ("redis://:pw@host", True), ("sk-" + "a1B2c3D4e5F6g7H8i9J0k1L2", True), ("sk-" + "a" * 30, False),
    ("ghp_" + "x7Kq2LmP9vR4tZ8wB3nY6cD1fG5hJ0sA2eU4", True), ("ghp_" + "A" * 36, False),
    ("-----BEGIN CERTIFICATE-----", False), ("-----BEGIN DSA PRIVATE KEY-----", True),
    ("see AKIA" + "Q4ZX7W2R5T6Y3U2N for the id", True), ("AKIA" + "Q4ZX7W2R5T6Y3U2NXX", False),
])
def test_value_rules_need_the_whole_shape(value: str, secret: bool) -> None:
    assert is_secret_value(value) is secret


@pytest.mark.parametrize("name", ["LD_PRELOAD", "LD_LIBRARY_PATH", "LD_AUDIT", "GCONV_PATH", "PYTHONPATH",
                                  "PYTHONSTARTUP", "PYTHONHOME", "PERL5LIB", "PERL5OPT", "RUBYOPT", "RUBYLIB",
                                  "NODE_OPTIONS", "BASH_ENV", "ENV", "BASH_FUNC_x%%", "GLIBC_TUNABLES",
                                  "JAVA_TOOL_OPTIONS", "GIT_SSH_COMMAND", "OPENSSL_CONF"])
def test_injection_names(name: str) -> None:
    assert is_injection_name(name)


@pytest.mark.parametrize("name", ["PATH", "HOME", "LANG", "TMPDIR", "USER", "XDG_RUNTIME_DIR", "ENVIRONMENT"])
def test_ordinary_host_names_are_not_injection_names(name: str) -> None:
    assert not is_injection_name(name)


def test_filter_env_splits_kept_and_dropped_names() -> None:
    kept, dropped = filter_env({"FOO": "1", "github_token": "t", "PYTHONHASHSEED": "0", "X_PAT": "p",
                                "UPSTREAM": "postgres://a:b@db/x"})
    assert kept == {"FOO": "1", "PYTHONHASHSEED": "0"}
    assert dropped == ["UPSTREAM", "X_PAT", "github_token"]


def test_sandbox_env_is_a_minimal_base_plus_the_request() -> None:
    env = sandbox_env({"FOO": "bar"}, home="/workspace")
    assert env == {"PATH": BASE_PATH, "HOME": "/workspace", "LANG": "C.UTF-8", "TMPDIR": "/tmp",
                   "PYTHONUNBUFFERED": "1", "FOO": "bar"}


@pytest.fixture
def runner(home: Path, only_local_builtin: None) -> Runner:
    return Runner(Settings.from_env(local=True, network="host"))


def test_a_run_inherits_nothing_and_reports_every_drop_by_name_never_by_value(
    runner: Runner, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EXECBOX_TEST_HOST_ONLY", "host-value-must-not-leak")
    drops = {name: value for _, name, value in MUST_DROP}
    result = runner.run(["python3", "-c", "import json, os; print(json.dumps(sorted(os.environ)))"],
                        backend="local_subprocess", env={**drops, "FOO": "bar", "PYTHONHASHSEED": "0"})
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout) == sorted({"PATH", "HOME", "LANG", "TMPDIR", "PYTHONUNBUFFERED", "FOO",
                                                "PYTHONHASHSEED"})
    assert result.filtered_env == sorted(drops)
    dumped = result.model_dump_json()
    for value in [*(v for v in drops.values() if v != "not-a-secret"), "host-value-must-not-leak"]:
        assert value not in dumped


def test_a_run_passes_the_ordinary_variables_unchanged(runner: Runner) -> None:
    result = runner.run(["python3", "-c", "import json, os; print(json.dumps(dict(os.environ)))"],
                        backend="local_subprocess", env=dict(MUST_PASS))
    assert result.exit_code == 0, result.stderr
    assert result.filtered_env == []
    seen = json.loads(result.stdout)
    assert {name: seen.get(name) for name, _ in MUST_PASS} == dict(MUST_PASS)
