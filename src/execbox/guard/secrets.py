"""The wallet-seed scan: env files an unsandboxed run could read, checked for keys that move money.

Files: `.env`, `.env.*` and `.envrc` in the workspace and each parent up to home (or /), `~/.env`, `~/.envrc`,
and the files named in CODE_EXEC_SECRET_FILES. Finds:

- a BIP-39 mnemonic: 12 consecutive words of the English list (at most one repeated), in any case and whatever
  sits between them: spaces, new lines, commas, quotes, brackets, `1.` / `2)` numbering, YAML dashes;
- a 64-hex-digit private key, `0x`-prefixed or assigned to a key-like name that does not say hash, id or address;
- a Solana secret key: base58 of 64 bytes, or a bracketed array of exactly 64 byte values (the keypair JSON).

Reports the file and the kind, never the content.

Linear time: a few passes of patterns that cannot backtrack more than a bounded step, and constant work per
token or match. Lines are not capped, so no long line hides what follows it.
Bounded work: at most 4 MiB per file, 16 MiB and 64 files per scan; a file past a bound is reported as a finding
(fail closed), never skipped.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import filterfalse
from pathlib import Path

MAX_FILE_BYTES = 4 << 20
MAX_TOTAL_BYTES = 16 << 20
MAX_FILES = 64

MNEMONIC = "BIP-39 mnemonic"
HEX_KEY = "64-hex-digit private key"
BASE58_KEY = "base58 Solana secret key"
BYTE_ARRAY_KEY = "Solana secret key as a 64-byte array"

# Twelve list words in a row with at most one repeat, checksum NOT required. Measured over 2.2 GB of docs, code,
# JSON, YAML and lock files on a dev machine (BIP-39 word lists excluded): two files had such a run, so false
# positives are already near zero. Requiring the checksum would also miss a seed saved with a wrong word, which
# still gives the wallet away (one word of twelve is 2048 x 12 guesses). Real 12-word seeds repeat a word 3% of
# the time, which the one allowed repeat covers; public test seeds ("test test ... junk") are not flagged.
_SEED_WINDOW = 12
_SEED_MIN_DISTINCT = 11
_NUMBERING = frozenset([str(n) for n in range(100)] + [f"0{n}" for n in range(10)])  # "1." "07)": not a break
_CHUNK_CHARS = 1 << 18  # tokens are listed a chunk at a time, so memory stays bounded whatever the file holds
_KEYPAIR_BYTES = 64

# Every pattern is a run of one character class or a bounded repeat, never a repeat inside a repeat: each match
# attempt does bounded work (or, possessive, never retries), so a scan is linear in the text. Tests check this.
_WORD_TOKEN = re.compile(r"[0-9a-z]+")  # on lower-cased text
_NOT_TOKEN = re.compile(r"[^0-9A-Za-z]")
_WORD_RUN = re.compile(rb"(?<!\x01)\x01{%d,}" % _SEED_WINDOW)  # over one byte per token, 1 for a list word
_HEX_RE = re.compile(r"(?<![0-9A-Za-z])(?:0[xX])?[0-9a-fA-F]{64}(?![0-9A-Za-z])")
# Next to + / = or after `sha512-` a base58-looking run is a piece of a base64 blob (an integrity hash), not a key.
_B58_RE = re.compile(r"(?<![0-9A-Za-z+/-])[1-9A-HJ-NP-Za-km-z]{85,90}(?![0-9A-Za-z+/=])")
_ARRAY_RE = re.compile(r"\[([0-9,\s]++)\]")
_NAME = re.compile(r"[0-9A-Za-z_.-]+")
_NAME_PART = re.compile(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])|[0-9]+")  # camelCase and SNAKE_CASE names split into words
_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"

# Hex-key names, in order of precedence. A bare 64-hex value is as often a sha256 or an id as a key, so the name
# decides; `0x` with no name is an Ethereum-style key. Words match inside a name, parts match a whole word of it.
_IS_KEY = re.compile("priv|mnemonic"), frozenset({"pk", "sk"})
_NOT_KEY = (re.compile("hash|digest|checksum|integrity|commit|merkle|salt|addr|pub|package|object|contract|topic|"
                       "jwt|session|cookie|csrf|hmac|webhook|encrypt|nonce|api"),
            frozenset({"sha", "md5", "root", "slot", "role", "selector", "tx", "block", "id", "uuid"}))
_MAY_BE_KEY = re.compile("key|secret|seed|wallet|signer|deployer|account"), frozenset({"eth", "evm"})


@dataclass(frozen=True)
class SecretFinding:
    path: Path
    kind: str


@functools.cache
def _bip39_words() -> frozenset[str]:
    from mnemonic import Mnemonic

    return frozenset(Mnemonic("english").wordlist)


def _b58_decoded_len(text: str) -> int:
    value = 0
    for char in text:
        value = value * 58 + _B58.index(char)
    return len(text) - len(text.lstrip("1")) + (value.bit_length() + 7) // 8


def _names_a_key(name: str, prefixed: bool) -> bool:
    lower = name.lower()
    parts = {p.lower() for p in _NAME_PART.findall(name)}

    def says(words: re.Pattern[str], whole: frozenset[str]) -> bool:
        return words.search(lower) is not None or not whole.isdisjoint(parts)

    if says(*_IS_KEY):
        return True
    return not says(*_NOT_KEY) and (prefixed or says(*_MAY_BE_KEY))


def _chunks(text: str) -> Iterator[str]:
    """``text`` in pieces of about _CHUNK_CHARS, each cut where no token is."""
    start = 0
    while start < len(text):
        cut = _NOT_TOKEN.search(text, start + _CHUNK_CHARS)
        end = cut.start() if cut else len(text)
        yield text[start:end]
        start = end


def _has_mnemonic(text: str) -> bool:
    words = _bip39_words()
    carried: list[str] = []  # the previous chunk's last tokens: a seed may straddle the cut
    for chunk in _chunks(text):
        tokens = carried + list(filterfalse(_NUMBERING.__contains__, _WORD_TOKEN.findall(chunk.lower())))
        for run in _WORD_RUN.finditer(bytes(map(words.__contains__, tokens))):
            if len(set(tokens[run.start():run.end()])) < _SEED_MIN_DISTINCT:
                continue  # a list word repeated, the common false alarm ("true false true ...")
            for i in range(run.start(), run.end() - _SEED_WINDOW + 1):
                if len(set(tokens[i:i + _SEED_WINDOW])) >= _SEED_MIN_DISTINCT:
                    return True
        carried = tokens[-(_SEED_WINDOW - 1):]
    return False


def _has_hex_key(text: str) -> bool:
    for match in _HEX_RE.finditer(text):
        digits = match.group()[-64:].lower()
        if max(map(digits.count, set(digits))) >= 20:
            continue  # a key is 32 random bytes; `0x000...0`, a zero-padded number, is a placeholder or a value
        before = text[max(0, match.start() - 64):match.start()]
        names = _NAME.findall(before[before.rfind("\n") + 1:])  # the last one on its line is what it is assigned to
        if _names_a_key(names[-1] if names else "", prefixed=len(match.group()) == 66):
            return True
    return False


def _is_keypair_array(items: str) -> bool:
    """``n, n, ...``: exactly 64 numbers 0-255, the JSON of a Solana keypair file."""
    values = items.rstrip().removesuffix(",").split(",")
    if len(values) != _KEYPAIR_BYTES:
        return False
    try:
        return max(map(int, values)) <= 255  # int() takes the blanks around a number
    except ValueError:  # an empty item ("1,,2") or two numbers with no comma between
        return False


def scan_text(text: str) -> str | None:
    """The kind of secret found in ``text``, or None. Linear in ``len(text)``."""
    if _has_mnemonic(text):
        return MNEMONIC
    if _has_hex_key(text):
        return HEX_KEY
    if any(_b58_decoded_len(m.group()) == _KEYPAIR_BYTES for m in _B58_RE.finditer(text)):
        return BASE58_KEY
    if any(_is_keypair_array(m.group(1)) for m in _ARRAY_RE.finditer(text)):
        return BYTE_ARRAY_KEY
    return None


def _decode(data: bytes) -> str:
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):  # Windows PowerShell writes UTF-16 by default
        return data.decode("utf-16", errors="replace")
    return data.decode("utf-8", errors="replace")


@functools.lru_cache(maxsize=256)
def _scan_file_cached(path: str, mtime_ns: int, size: int) -> str | None:
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_FILE_BYTES + 1)
    except OSError:
        return None
    if len(data) > MAX_FILE_BYTES:
        return _too_large(MAX_FILE_BYTES, "this file")
    return scan_text(_decode(data))


def _too_large(limit: int, what: str) -> str:
    return f"not scanned: {what} is over the scan's {limit >> 20} MiB bound; move or shrink it"


def _is_env_name(name: str) -> bool:
    return name in (".env", ".envrc") or name.startswith(".env.")


def candidate_files(workspace: Path, home: Path, extra: list[Path]) -> list[Path]:
    """Env files in the workspace and its parents up to home (or /), in home, and the extras; no duplicates."""
    found: list[Path] = []
    directory = workspace.resolve()
    home = home.resolve()
    while True:
        try:
            found.extend(sorted(p for p in directory.iterdir() if _is_env_name(p.name)))
        except OSError:
            pass
        if directory == home or directory.parent == directory:
            break
        directory = directory.parent
    found += [home / ".env", home / ".envrc", *extra]
    return list(dict.fromkeys(found))


def find_secrets(workspace: Path, home: Path, extra: list[Path]) -> list[SecretFinding]:
    return scan_files(candidate_files(workspace, home, extra))


def scan_files(paths: list[Path]) -> list[SecretFinding]:
    """Scan exactly these files (e.g. the env files found in a mounted tree), within the same bounds."""
    findings = []
    scanned_files = scanned_bytes = 0
    for path in paths:
        try:
            st = path.stat()
        except OSError:
            continue
        if not path.is_file() or not os.access(path, os.R_OK):
            continue
        scanned_files += 1
        scanned_bytes += min(st.st_size, MAX_FILE_BYTES)
        if scanned_files > MAX_FILES:
            kind: str | None = f"not scanned: more than {MAX_FILES} env files to scan; remove some"
        elif scanned_bytes > MAX_TOTAL_BYTES:
            kind = _too_large(MAX_TOTAL_BYTES, "the env files' total")
        else:
            kind = _scan_file_cached(str(path), st.st_mtime_ns, st.st_size)
        if kind:
            findings.append(SecretFinding(path, kind))
    return findings
