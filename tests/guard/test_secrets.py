"""The wallet-seed scan: seeds and keys in readable env files refuse unsandboxed runs, even in local mode.

The refusal names the file and never its content. Ordinary .env content does not trigger it, and sandbox
backends are not scanned (the sandbox cannot read the host's files). The fixture corpus under
tests/fixtures/secrets holds every layout that must be found (positive/) and realistic files that must not be
(negative/); its seeds and keys were generated for the corpus and guard nothing.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from re import Pattern, _constants, _parser

import pytest
from mnemonic import Mnemonic

import execbox
from execbox import Runner, SecretFileError, Settings
from execbox.backends.local_subprocess import LocalSubprocessBackend
from execbox.guard import Guard, find_secrets, scan_text
from execbox.guard import secrets as scanner
from tests.support.fakes_plugin import FakeNamespace, FakeSandbox

FIXTURES = Path(__file__).parent.parent / "fixtures" / "secrets"
POSITIVES = sorted((FIXTURES / "positive").iterdir())
NEGATIVES = sorted((FIXTURES / "negative").iterdir())

B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


def b58encode(data: bytes) -> str:
    value = int.from_bytes(data, "big")
    out = ""
    while value:
        value, rem = divmod(value, 58)
        out = B58[rem] + out
    return "1" * (len(data) - len(data.lstrip(b"\0"))) + out


def mnemonic(words: int) -> str:
    """A random seed with at most one repeated word. The scanner allows one repeat (a real 12-word seed has one
    3% of the time); two or more (~0.05% of seeds) are missed by design, and drawing one made tests flaky."""
    while True:
        seed = Mnemonic("english").generate(strength={12: 128, 24: 256}[words]).split()
        if len(set(seed)) >= len(seed) - 1:
            return " ".join(seed)


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


@pytest.mark.parametrize("path", POSITIVES, ids=[p.name for p in POSITIVES])
def test_every_positive_fixture_is_found(path: Path, tmp_path: Path) -> None:
    [finding] = find_secrets(tmp_path, tmp_path, [path])
    assert finding.path == path
    assert {"mnemonic": "BIP-39", "hex": "64-hex-digit", "solana": "Solana"}[path.name.split("_")[0]] in finding.kind


@pytest.mark.parametrize("path", NEGATIVES, ids=[p.name for p in NEGATIVES])
def test_no_negative_fixture_is_flagged(path: Path, tmp_path: Path) -> None:
    assert find_secrets(tmp_path, tmp_path, [path]) == []


def test_the_corpus_covers_the_layouts_and_the_lookalikes() -> None:
    names = {p.name for p in POSITIVES}
    for layout in ("split_over_two_lines", "five_words_per_line", "one_word_per_line", "numbered_dots",
                   "numbered_parens", "json_list", "yaml_list", "upper_case", "envrc", "hex_0x", "solana_keypair"):
        assert any(layout in name for name in names), layout
    assert {"package-lock.json", "poetry.lock", "Cargo.lock", "yarn.lock", "prose.md", "README.md", "uuids.csv",
            "base64_blobs.txt", "web_app.env"} <= {p.name for p in NEGATIVES}


def test_a_seed_split_over_two_lines_in_the_workspace_env_is_refused(tree: tuple[Path, Path]) -> None:
    workspace, home = tree
    words = mnemonic(12).split()
    (workspace / ".env").write_text(f'SEED="{" ".join(words[:6])}\n{" ".join(words[6:])}"\n')
    assert_refused_naming(workspace / ".env", " ".join(words), workspace, home)


@pytest.mark.parametrize("where", ["workspace", "home"])
def test_envrc_is_scanned(where: str, tmp_path: Path) -> None:
    home, workspace = tmp_path / "home", tmp_path / "elsewhere"
    home.mkdir()
    workspace.mkdir()
    envrc = (workspace if where == "workspace" else home) / ".envrc"
    line, secret = SECRETS["hex key"]()
    envrc.write_text(f"use nix\nexport {line}\n")
    assert_refused_naming(envrc, secret, workspace, home)


def _nested_repeat(node: object, inside: bool = False) -> bool:
    """Whether a parsed pattern has a repeat inside a repeat (what makes a regex backtrack super-linearly)."""
    if isinstance(node, _parser.SubPattern):
        node = node.data
    if isinstance(node, tuple) and len(node) == 2 and isinstance(node[0], _constants._NamedIntConstant):
        op, arg = node
        assert op not in (_constants.GROUPREF, _constants.GROUPREF_EXISTS), "a back-reference"
        if op in (_constants.MAX_REPEAT, _constants.MIN_REPEAT, _constants.POSSESSIVE_REPEAT):
            return inside or _nested_repeat(arg[2], True)
        return _nested_repeat(arg, inside)
    return isinstance(node, (list, tuple)) and any(_nested_repeat(item, inside) for item in node)


def test_no_pattern_of_the_scanner_can_backtrack_super_linearly() -> None:
    patterns = [v for v in vars(scanner).values() if isinstance(v, Pattern)]
    patterns += [x for v in vars(scanner).values() if isinstance(v, tuple) for x in v if isinstance(x, Pattern)]
    assert len(patterns) >= 10
    for pattern in patterns:
        assert not _nested_repeat(_parser.parse(pattern.pattern, pattern.flags)), pattern.pattern
    assert _nested_repeat(_parser.parse(r"(?:a+)+b"))  # the control: the check sees the classic case


@pytest.mark.parametrize("filler", [
    "A_KEY_" * 30_000 + "=" + "0" * 63,  # what stalled the old hex-key pattern for 23 s
    "abandon " * 30_000,
    "[" + "1," * 100_000,
    "1" * 200_000,
])
def test_no_line_is_too_long_to_hide_what_follows_it(filler: str) -> None:
    words = mnemonic(12)
    assert scan_text(f"{filler}\nMNEMONIC={words}\n") == "BIP-39 mnemonic"
    assert scan_text(f"{filler}\nPRIVATE_KEY={secrets.token_hex(32)}\n") == "64-hex-digit private key"


@pytest.mark.parametrize("offset", range(-60, 61, 7))
def test_a_seed_across_the_scanners_chunk_boundary_is_found(offset: int) -> None:
    prefix = "x" * (scanner._CHUNK_CHARS + offset)
    assert scan_text(prefix + " " + mnemonic(12).replace(" ", "\n")) == "BIP-39 mnemonic"


def test_repeated_list_words_are_not_a_seed_but_a_list_of_twelve_distinct_ones_is() -> None:
    assert scan_text("MNEMONIC=" + "test " * 11 + "junk") is None  # hardhat's public development seed
    assert scan_text("flags: [" + ", ".join(["true", "false"] * 20) + "]") is None
    # The accepted false positive: twelve distinct list words in a row (measured: 2 files in 2.2 GB of text).
    assert scan_text("apple, banana, butter, cheese, coffee, egg, honey, lemon, milk, onion, orange, pepper") \
        == "BIP-39 mnemonic"


@pytest.mark.parametrize(("line", "found"), [
    ("PRIVATE_KEY={}", True),
    ("export ETH_PK={}", True),
    ("DEPLOYER=0x{}", True),
    ("0x{}", True),
    ('"privateKey": "0x{}", "txHash": "0x{}"', True),
    ("ARTIFACT_SHA256={}", False),
    ("{}", False),  # a bare 64-hex value with no name is a sha256 more often than a key
    ('hash = "sha256:{}"', False),
    ('{{file = "mnemonic-1.0.tar.gz", hash = "sha256:{}"}}', False),
    ("INIT_CODE_HASH=0x{}", False),
    ("MINTER_ROLE=0x{}", False),
    ("SUI_PACKAGE_ID=0x{}", False),
    ("WALLET_ADDRESS=0x{}", False),
    ("JWT_SECRET={}", False),
    ("image: redis@sha256:{}", False),
])
def test_a_hex_value_is_a_key_by_its_name(line: str, found: bool) -> None:
    values = [secrets.token_hex(32) for _ in range(line.count("{}"))]
    assert (scan_text(line.format(*values)) == "64-hex-digit private key") is found


def test_a_hex_placeholder_is_not_a_key() -> None:
    assert scan_text("PRIVATE_KEY=0x" + "0" * 64) is None
    assert scan_text("PRIVATE_KEY=0x" + "0" * 48 + secrets.token_hex(8)) is None


def test_base58_inside_a_base64_integrity_hash_is_not_a_key() -> None:
    value = b58encode(secrets.token_bytes(64))
    assert scan_text(f"SOLANA_KEY={value}") == "base58 Solana secret key"
    for blob in (f"sha512-{value}==", f"ab+{value}", f"{value}/cd", f"{value}=="):
        assert scan_text(f"integrity {blob}") is None


@pytest.mark.parametrize(("values", "found"), [
    (list(range(64)), True),
    ([255] * 64, True),
    (list(range(32)), False),  # a public key
    (list(range(65)), False),
    (list(range(63)) + [256], False),
])
def test_a_solana_keypair_array_is_exactly_64_bytes(values: list[int], found: bool) -> None:
    assert (scan_text(f"KEYPAIR={json.dumps(values)}") is not None) is found


def test_past_the_scans_bounds_a_file_is_refused_not_skipped(tree: tuple[Path, Path],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    workspace, home = tree
    monkeypatch.setattr(scanner, "MAX_FILE_BYTES", 1000)
    (workspace / ".env").write_text("A=1\n" * 300)
    [finding] = find_secrets(workspace, home, [])
    assert finding.path == workspace / ".env" and "not scanned" in finding.kind
    (workspace / ".env").unlink()
    monkeypatch.setattr(scanner, "MAX_FILES", 2)
    for name in (".env.a", ".env.b", ".env.c"):
        (workspace / name).write_text("A=1\n")
    assert [f.path.name for f in find_secrets(workspace, home, [])] == [".env.c"]
    monkeypatch.setattr(scanner, "MAX_FILES", 64)
    monkeypatch.setattr(scanner, "MAX_TOTAL_BYTES", 8)
    [finding] = find_secrets(workspace, home, [])
    assert finding.path.name == ".env.c" and "not scanned" in finding.kind
