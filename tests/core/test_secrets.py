"""The wallet-seed scan: seeds and keys in readable env files refuse unsandboxed runs, even in local mode.

The refusal names the file and never its content. Ordinary .env content does not trigger it, and sandbox
backends are not scanned (the sandbox cannot read the host's files).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import pytest
from mnemonic import Mnemonic

import execbox
from execbox import Runner, SecretFileError, Settings
from execbox.backends.local_subprocess import LocalSubprocessBackend
from execbox.guard import Guard, scan_text
from tests.core.fakes_plugin import FakeNamespace, FakeSandbox

B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


def b58encode(data: bytes) -> str:
    value = int.from_bytes(data, "big")
    out = ""
    while value:
        value, rem = divmod(value, 58)
        out = B58[rem] + out
    return "1" * (len(data) - len(data.lstrip(b"\0"))) + out


def mnemonic(words: int) -> str:
    return Mnemonic("english").generate(strength={12: 128, 24: 256}[words])


def _line(template: str, value: str) -> tuple[str, str]:
    return template.format(value), value


# kind -> a factory of (the line written to the file, the secret value in it)
SECRETS = {
    "12-word mnemonic": lambda: _line('WALLET_MNEMONIC="{}"', mnemonic(12)),
    "24-word mnemonic": lambda: _line("{}", mnemonic(24)),
    "hex key": lambda: _line("PRIVATE_KEY=0x{}", secrets.token_hex(32)),
    "hex key, json": lambda: _line('{{"signerKey": "{}"}}', secrets.token_hex(32)),
    "solana key": lambda: _line("SOLANA_KEYPAIR={}", b58encode(secrets.token_bytes(64))),
}
KINDS = {"12-word mnemonic": "BIP-39 mnemonic", "24-word mnemonic": "BIP-39 mnemonic", "hex key": "64-hex-digit",
         "hex key, json": "64-hex-digit", "solana key": "base58 Solana"}

ORDINARY_ENV = f"""\
# Settings for the app. The deploy script reads these; ask the team before you change them.
APP_NAME=orbit
DEBUG=false
PORT=8080
ARTIFACT_SHA256={"ab" * 32}
GIT_COMMIT={secrets.token_hex(20)}
DATABASE_HOST=localhost
SOLANA_PUBKEY={b58encode(secrets.token_bytes(32))}
GREETING="please check the above balance before you transfer any amount to the account"
NOTES="a story about a little garden, a river, a bridge and an old house near the forest"
WORDS="{' '.join(Mnemonic('english').generate(128).split()[:11])}"
"""


def local_guard(workspace: Path, home: Path, **settings: object) -> tuple[Guard, LocalSubprocessBackend]:
    s = Settings.from_env(local=True, network="host", **settings)
    return Guard(s, workspace=workspace, home=home), LocalSubprocessBackend(s)


def assert_refused_naming(path: Path, secret: str, workspace: Path, home: Path, **settings: object) -> None:
    guard, backend = local_guard(workspace, home, **settings)
    with pytest.raises(SecretFileError) as info:
        guard.check_secrets(backend)
    message = info.value.message
    assert str(path) in message
    assert "docker" in message and "signer" in message  # the fix
    assert secret not in message and secret not in str(info.value)
    words = secret.split()
    for i in range(len(words) - 2):  # not even a fragment of a mnemonic
        assert " ".join(words[i:i + 3]) not in message


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Path, Path]:
    home = tmp_path / "home"
    workspace = home / "code" / "project"
    workspace.mkdir(parents=True)
    return workspace, home


@pytest.mark.parametrize("kind", list(SECRETS))
def test_scan_text_finds_each_kind(kind: str) -> None:
    assert KINDS[kind] in (scan_text("FOO=1\n" + SECRETS[kind]()[0] + "\nBAR=2\n") or "")


@pytest.mark.parametrize("kind", list(SECRETS))
def test_a_secret_in_the_workspace_env_is_refused_even_in_local_mode(kind: str, tree: tuple[Path, Path]) -> None:
    workspace, home = tree
    line, secret = SECRETS[kind]()
    (workspace / ".env").write_text(f"DEBUG=1\n{line}\n")
    assert_refused_naming(workspace / ".env", secret, workspace, home)


def test_a_parents_env_local_up_to_home_is_scanned(tree: tuple[Path, Path]) -> None:
    workspace, home = tree
    line, secret = SECRETS["12-word mnemonic"]()
    (home / "code" / ".env.local").write_text(line)
    assert_refused_naming(home / "code" / ".env.local", secret, workspace, home)


def test_home_env_is_scanned(tree: tuple[Path, Path]) -> None:
    workspace, home = tree
    line, secret = SECRETS["hex key"]()
    (home / ".env").write_text(line)
    assert_refused_naming(home / ".env", secret, workspace, home)


def test_home_env_is_scanned_for_a_workspace_outside_home(tmp_path: Path) -> None:
    home, workspace = tmp_path / "home", tmp_path / "elsewhere"
    home.mkdir()
    workspace.mkdir()
    line, secret = SECRETS["solana key"]()
    (home / ".env").write_text(line)
    assert_refused_naming(home / ".env", secret, workspace, home)


def test_nothing_above_home_is_scanned(tree: tuple[Path, Path]) -> None:
    workspace, home = tree
    (home.parent / ".env").write_text(SECRETS["24-word mnemonic"]()[0])
    guard, backend = local_guard(workspace, home)
    guard.check_secrets(backend)


def test_code_exec_secret_files_are_scanned(tree: tuple[Path, Path], tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    workspace, home = tree
    vault = tmp_path / "vault"
    vault.mkdir()
    harmless, seed = vault / "notes.txt", vault / "backup.txt"
    harmless.write_text("nothing here\n")
    line, secret = SECRETS["24-word mnemonic"]()
    seed.write_text(line + "\n")
    monkeypatch.setenv("CODE_EXEC_SECRET_FILES", f"{harmless},{seed}")
    assert_refused_naming(seed, secret, workspace, home)


def test_a_mnemonic_written_one_word_per_line_is_found(tree: tuple[Path, Path], tmp_path: Path) -> None:
    workspace, home = tree
    seed = tmp_path / "seed-backup.txt"
    words = mnemonic(12).split()
    seed.write_text("".join(f"{i}. {w}\n" for i, w in enumerate(words, 1)))
    assert_refused_naming(seed, " ".join(words), workspace, home, secret_files=[seed])


def test_ordinary_env_content_is_not_a_secret(tree: tuple[Path, Path]) -> None:
    workspace, home = tree
    assert scan_text(ORDINARY_ENV) is None
    (workspace / ".env").write_text(ORDINARY_ENV)
    (home / ".env").write_text(ORDINARY_ENV)
    guard, backend = local_guard(workspace, home)
    guard.check_secrets(backend)


def test_a_directory_named_env_is_skipped(tree: tuple[Path, Path]) -> None:
    workspace, home = tree
    (workspace / ".env").mkdir()
    guard, backend = local_guard(workspace, home)
    guard.check_secrets(backend)


def test_a_missing_secret_file_is_a_config_error_not_a_skipped_scan(tree: tuple[Path, Path], tmp_path: Path) -> None:
    from execbox import ConfigError

    workspace, home = tree
    guard, backend = local_guard(workspace, home, secret_files=[tmp_path / "does-not-exist"])
    with pytest.raises(ConfigError) as info:
        guard.check_secrets(backend)
    assert info.value.env_var == "CODE_EXEC_SECRET_FILES" and "does-not-exist" in info.value.message


@pytest.mark.parametrize("cls", [FakeSandbox, FakeNamespace], ids=["container", "namespace"])
def test_sandbox_backends_are_not_scanned(cls: type, tree: tuple[Path, Path]) -> None:
    workspace, home = tree
    (workspace / ".env").write_text(SECRETS["12-word mnemonic"]()[0])
    settings = Settings.from_env(local=True)
    guard = Guard(settings, workspace=workspace, home=home)
    guard.check_secrets(cls(settings))
    with pytest.raises(SecretFileError):  # the control: the same files stop an unsandboxed backend
        guard.check_secrets(LocalSubprocessBackend(settings))


def test_end_to_end_the_runner_scans_the_current_directory_and_home(
    home: Path, fake_backends: object, workspaces: Path
) -> None:
    line, secret = SECRETS["12-word mnemonic"]()
    env_file = Path.cwd() / ".env"
    env_file.write_text(line)
    runner = Runner(Settings.from_env(local=True, network="host"))
    with pytest.raises(SecretFileError) as info:
        runner.run(["true"], backend="local_subprocess")
    assert str(env_file) in info.value.message and secret not in info.value.message
    with pytest.raises(SecretFileError):
        runner.run_code("print(1)", backend="local_subprocess")
    with pytest.raises(SecretFileError):
        with runner.sandbox("local_subprocess"):
            pass
    assert not any(workspaces.iterdir())
    # The same secret does not stop a sandbox backend.
    assert runner.run(["true"], backend="fake_sandbox").exit_code == 0


def test_end_to_end_a_seed_added_during_a_session_stops_the_next_exec(home: Path, fake_backends: object) -> None:
    runner = Runner(Settings.from_env(local=True, network="host"))
    with runner.sandbox("local_subprocess") as sb:
        assert sb.exec(["true"]).exit_code == 0
        (home / ".env").write_text(SECRETS["hex key"]()[0])
        with pytest.raises(SecretFileError):
            sb.exec(["true"])


def test_end_to_end_through_the_public_api(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CODE_EXEC_LOCAL", "true")
    monkeypatch.setenv("CODE_EXEC_NETWORK", "host")
    (home / ".env").write_text(SECRETS["solana key"]()[0])
    with pytest.raises(SecretFileError, match=str(home / ".env")):
        execbox.run(["true"], backend="local_subprocess")
    os.unlink(home / ".env")
    assert execbox.run(["true"], backend="local_subprocess").exit_code == 0
