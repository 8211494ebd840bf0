"""The wallet-seed scan: env files an unsandboxed run could read, checked for keys that move money.

Looks for a BIP-39 mnemonic (12-24 words of the English list), a 64-hex-digit private key assigned to a
key-like name, or a base58 Solana secret key (64 bytes). Reports the file and the kind, never the content.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path

_B58_ALPHABET = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_B58_RE = re.compile(r"(?<![1-9A-HJ-NP-Za-km-z])[1-9A-HJ-NP-Za-km-z]{85,90}(?![1-9A-HJ-NP-Za-km-z])")
_HEX_KEY_RE = re.compile(
    r"(?i)[\w.-]*(?:key|secret|priv|seed|wallet|signer|mnemonic|account)[\w.-]*['\"]?\s*[:=]\s*['\"]?(?:0x)?[0-9a-f]{64}(?![0-9a-f])"
)
_WORD_RE = re.compile(r"[a-z]+")
_ONE_WORD_LINE = re.compile(r"^\s*(?:\d+[.):]?\s*)?[A-Za-z]+\s*$")
_MAX_FILE_BYTES = 1 << 20


@dataclass(frozen=True)
class SecretFinding:
    path: Path
    kind: str


@functools.cache
def _bip39_words() -> frozenset[str]:
    from mnemonic import Mnemonic

    return frozenset(Mnemonic("english").wordlist)


def _b58_decode_len(text: str) -> int:
    value = 0
    for char in text:
        value = value * 58 + _B58_ALPHABET.index(char)
    leading_zeros = len(text) - len(text.lstrip("1"))
    return leading_zeros + (value.bit_length() + 7) // 8


def _has_mnemonic(text: str) -> bool:
    """12+ list words in a row on one line, or one word per line (the paper-backup layout, "1. word")."""
    words = _bip39_words()
    column = 0
    for line in text.splitlines():
        tokens = _WORD_RE.findall(line.lower())
        run = 0
        for token in tokens:
            run = run + 1 if token in words else 0
            if run >= 12:
                return True
        column = column + 1 if len(tokens) == 1 and tokens[0] in words and _ONE_WORD_LINE.match(line) else 0
        if column >= 12:
            return True
    return False


def scan_text(text: str) -> str | None:
    """The kind of secret found in ``text``, or None."""
    if _has_mnemonic(text):
        return "BIP-39 mnemonic"
    for line in text.splitlines():
        if _HEX_KEY_RE.search(line):
            return "64-hex-digit private key"
        for match in _B58_RE.finditer(line):
            if _b58_decode_len(match.group()) == 64:
                return "base58 Solana secret key"
    return None


@functools.lru_cache(maxsize=256)
def _scan_file_cached(path: str, mtime_ns: int, size: int) -> str | None:
    try:
        with open(path, "rb") as fh:
            data = fh.read(_MAX_FILE_BYTES)
    except OSError:
        return None
    return scan_text(data.decode("utf-8", errors="replace"))


def candidate_files(workspace: Path, home: Path, extra: list[Path]) -> list[Path]:
    """`.env` and `.env.*` in the workspace and its parents up to home (or /), `~/.env`, and the extras."""
    found: list[Path] = []
    directory = workspace.resolve()
    home = home.resolve()
    while True:
        try:
            found.extend(sorted(p for p in directory.iterdir() if p.name == ".env" or p.name.startswith(".env.")))
        except OSError:
            pass
        if directory == home or directory.parent == directory:
            break
        directory = directory.parent
    found.append(home / ".env")
    found.extend(extra)
    seen: set[Path] = set()
    return [p for p in found if not (p in seen or seen.add(p))]


def find_secrets(workspace: Path, home: Path, extra: list[Path]) -> list[SecretFinding]:
    findings = []
    for path in candidate_files(workspace, home, extra):
        try:
            st = path.stat()
        except OSError:
            continue
        if not path.is_file() or not os.access(path, os.R_OK):
            continue
        kind = _scan_file_cached(str(path), st.st_mtime_ns, st.st_size)
        if kind:
            findings.append(SecretFinding(path, kind))
    return findings
