"""Secrets the code needs: declared by the caller, given to the sandboxed command alone, and redacted from
everything the caller sees. (Not the wallet-seed scanner: that is ``execbox.guard.secrets``.)

Declaring. ``secrets={"OPENAI_API_KEY": value}`` on a run, an exec or a sandbox; a value is a str or a
``Secret`` (``Secret.from_env("NAME")``, ``Secret.from_file(path)``), whose repr and str never show it. A
declared secret is the one way past the env policy (``policy.env.filter_env`` still drops a secret-looking
``env`` entry): it is not an ``env`` entry at all, and it is reported by name only (``ExecResult.secrets``, the
audit log). A value must be 8 to 65536 bytes of text without NUL: redacting a shorter one would wipe ordinary
words out of the output (see ``MIN_SECRET_BYTES``).

Delivery (``deliver``). The values never travel in the command's environment as execbox hands it to a
backend, so they are in no container config (``docker inspect``), label, bwrap argument file, command line
or engine request log. The runner runs ``/bin/sh -c WRAPPER execbox-secrets ARGV...`` instead of ``ARGV``
and puts the values at the head of the command's stdin: one line per secret, ``NAME`` and the value's bytes
as octal escapes, then a ``.`` line. The wrapper uses shell builtins only (``read``, which takes exactly one
line from a pipe; ``printf``; ``export``), exports the variables and execs the command, which reads the rest
of its stdin as given. So a value passes only through the stdin pipe, and then sits where any environment
variable of the command sits: in that command's own environment (its ``/proc/PID/environ``, readable by its
uid and root). Getting it out of the sandbox altogether is the job of injection at egress.

Redaction (``Redactor``). Every occurrence of a declared value, and of its common encodings, is replaced by
``[secret NAME]``: the raw UTF-8 bytes; base64 and URL-safe base64 (the whole encoding with and without
padding, and, for the value inside a longer base64 stream, at each of the three byte alignments, the part
of the encoding that depends on the value alone: at most one character at either end, which also encodes
bits of the neighbouring bytes, is left); lower- and upper-case hex; URL encoding (``quote`` with and
without ``/`` kept, ``quote_plus``, JavaScript's ``encodeURIComponent``; upper- and lower-case escapes);
JSON string escaping as common encoders write it (``json_forms``: ``\\/`` or ``/``, ``\\uXXXX`` in lower or upper
hex, non-ASCII escaped or as UTF-8, Go's ``\\u003c`` for ``<>&``, Gson's ``\\u003d`` for ``=``, .NET's ``\\u002B``
for ``+`` and ``\\u0022`` for ``"``, control characters short, as ``\\u00XX``, or short only for ``\\n\\r\\t`` as
Go before 1.22 wrote them) and Python's ``repr``. Not covered: base64 wrapped over lines, other encodings (base32,
gzip, ...), transformations (reversed, split, XOR-ed), a value the code changed.

Where: in one place every path uses, ``contract.output.BoundedCapture.write``: bytes are redacted as they come
in, before they are streamed (``on_output``) and before the cap decides what is kept, so a secret cut by the
cap cannot leave a half behind, and the omission marker counts bytes of the redacted stream. A stream
redactor holds back the last ``len(longest pattern) - 1`` bytes until more come (or the run ends), so a
value split over two chunks is still found. The run's redactor travels in its ``ExecSpec`` (``redactor``):
``ExecSpec.captures()`` and the kit's process helpers build captures with it. The runner then redacts the result's
text once more (a safety net for a backend whose captures were made elsewhere; a note says so), error
messages, notes and egress host names.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import os
import re
from collections.abc import Iterator, Mapping
from typing import Any, TypeVar
from urllib.parse import quote, quote_plus

from pydantic import BaseModel, GetCoreSchemaHandler
from pydantic_core import core_schema

from execbox.errors import ConfigError, ExecboxError
from execbox.policy.env import is_injection_name

#: The shortest value accepted: redacting a 3-letter value would wipe ordinary words out of the output.
MIN_SECRET_BYTES = 8
#: The longest value accepted (it reaches the command through its stdin as octal escapes a shell reads).
MAX_SECRET_BYTES = 64 << 10
#: At most this many secrets per run.
MAX_SECRETS = 64
R = TypeVar("R", bound=BaseModel)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# Names a secret may not take: what the sandbox's base environment sets, the wrapper's own variables, and
# what makes a loader or an interpreter run code (a secret is data, never configuration).
_BASE_NAMES = frozenset({"PATH", "HOME", "LANG", "TMPDIR", "PYTHONUNBUFFERED", "PWD", "SHELL", "USER"})


class Secret:
    """A value a run needs (an API key, a token): given to the sandboxed command as an environment variable,
    redacted from its output, never shown by ``repr`` or ``str``, never pickled.

    ``Secret("sk-...")``, ``Secret.from_env("OPENAI_API_KEY")`` (this process's environment),
    ``Secret.from_file("/run/secrets/openai")`` (one trailing newline is dropped).
    """

    __slots__ = ("_value", "origin")

    def __init__(self, value: str, *, origin: str = "given in code") -> None:
        if isinstance(value, Secret):
            value = value.reveal()
        if not isinstance(value, str):
            raise ConfigError(f"a secret's value is a {type(value).__name__}; give a str (text)")
        self._value = value
        self.origin = origin

    @classmethod
    def from_env(cls, name: str, environ: Mapping[str, str] | None = None) -> Secret:
        """The value of the variable ``name`` in this process's environment (or ``environ``)."""
        value = (os.environ if environ is None else environ).get(name)
        if value is None:
            raise ConfigError(f"secret from the environment: {name!r} is not set in this process's environment; "
                              "export it before starting, or give the value another way (Secret.from_file)")
        return cls(value, origin=f"environment variable {name}")

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Secret:
        """The text of a file (``/run/secrets/...``, a key file), without one trailing newline; bounded."""
        where = os.fspath(path)
        try:
            with open(where, "rb") as fh:
                data = fh.read(MAX_SECRET_BYTES + 3)
        except OSError as exc:
            raise ConfigError(f"secret from file {where!r}: cannot read it ({exc.strerror or exc})") from None
        if len(data) > MAX_SECRET_BYTES + 2:
            raise ConfigError(f"secret from file {where!r}: over {MAX_SECRET_BYTES} bytes; a secret is a key or a "
                              "token, pass larger data as a file in the workspace")
        data = data[:-2] if data.endswith(b"\r\n") else data[:-1] if data.endswith(b"\n") else data
        try:
            text = data.decode()
        except UnicodeDecodeError:
            raise ConfigError(f"secret from file {where!r}: not UTF-8 text; an environment variable holds text "
                              "(base64-encode binary keys)") from None
        return cls(text, origin=f"file {where}")

    def reveal(self) -> str:
        """The value itself."""
        return self._value

    def __repr__(self) -> str:
        return f"Secret(<hidden>, {self.origin})"

    __str__ = __repr__

    def __reduce__(self) -> Any:
        raise TypeError("a Secret is not pickled (it would land in a file or a message); pass it in this process")

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        return core_schema.no_info_plain_validator_function(
            lambda v: v if isinstance(v, Secret) else Secret(v),
            serialization=core_schema.plain_serializer_function_ser_schema(lambda s: "[secret]"))


def check_secrets(secrets: Mapping[str, Secret | str]) -> dict[str, Secret]:
    """Declared secrets, checked: names a shell can export, values 8..65536 bytes of text without NUL. Raises
    ValueError (the request model turns it into a ConfigError) saying what to change."""
    if not isinstance(secrets, Mapping):
        raise ValueError(f"secrets is a {type(secrets).__name__}; give a mapping of names to values")
    if len(secrets) > MAX_SECRETS:
        raise ValueError(f"{len(secrets)} secrets; at most {MAX_SECRETS} per run")
    out: dict[str, Secret] = {}
    for name, given in secrets.items():
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"secret name {str(name)[:60]!r}: use letters, digits and _ (not first a digit), a name "
                             "a shell can export")
        upper = name.upper()
        if upper in _BASE_NAMES or upper.startswith("__EXECBOX") or is_injection_name(upper):
            raise ValueError(f"secret name {name!r} is a variable the sandbox sets or a loader/interpreter reads; "
                             "name the secret after what it is (e.g. OPENAI_API_KEY)")
        secret = given if isinstance(given, Secret) else Secret(given) if isinstance(given, str) else None
        if secret is None:
            raise ValueError(f"secret {name}: a {type(given).__name__}; give a str or an execbox.Secret")
        value = secret.reveal()
        try:
            size = len(value.encode())
        except UnicodeEncodeError:
            raise ValueError(f"secret {name}: not valid text (a lone surrogate)") from None
        if "\0" in value:
            raise ValueError(f"secret {name}: holds a NUL byte, which no environment variable can carry")
        if size < MIN_SECRET_BYTES:
            raise ValueError(f"secret {name}: {size} bytes; a secret must be at least {MIN_SECRET_BYTES} bytes, since "
                             "every occurrence of it is cut out of the output (a short one would wipe ordinary text)")
        if size > MAX_SECRET_BYTES:
            raise ValueError(f"secret {name}: {size} bytes, over {MAX_SECRET_BYTES}; pass larger data as a file")
        out[name] = secret
    return out


# --- delivery ---------------------------------------------------------------------------------------------

#: Reads the secrets' lines from stdin (builtins only: exactly those lines are consumed), exports them, execs
#: the command. Command substitution drops trailing newlines: the value is printed with an ``x`` after it,
#: which is then cut. Without the end line (".") nothing runs: exit 125.
WRAPPER = (
    'while IFS= read -r __execbox_l; do [ "$__execbox_l" = . ] && break; '
    '__execbox_v=$(printf "${__execbox_l#* }x"); export "${__execbox_l%% *}=${__execbox_v%x}"; done; '
    '[ "$__execbox_l" = . ] || { echo "execbox: the secrets did not arrive on stdin" >&2; exit 125; }; '
    'unset __execbox_l __execbox_v; exec "$@"'
)


def deliver(argv: list[str], stdin: bytes | None, secrets: Mapping[str, Secret]) -> tuple[list[str], bytes]:
    """The argv and stdin that give ``argv`` the secrets as environment variables (see the module docstring)."""
    lines = [f"{name} {_octal(secret.reveal())}\n" for name, secret in secrets.items()]
    header = ("".join(lines) + ".\n").encode()
    return ["/bin/sh", "-c", WRAPPER, "execbox-secrets", *argv], header + (stdin or b"")


def _octal(value: str) -> str:
    return "".join("\\%03o" % b for b in value.encode())


# --- redaction --------------------------------------------------------------------------------------------


def label(names: frozenset[str]) -> bytes:
    return f"[secret {','.join(sorted(names))}]".encode()


def _b64_forms(raw: bytes) -> set[bytes]:
    forms: set[bytes] = set()
    for encode in (base64.b64encode, base64.urlsafe_b64encode):
        whole = encode(raw)
        forms |= {whole, whole.rstrip(b"=")}
        for k in range(3):  # the value starting at byte k of a 3-byte group of a longer stream
            encoded = encode(b"\0" * k + raw)
            # only the characters whose 6 bits all come from the value
            forms.add(encoded[-(-8 * k // 6):8 * (k + len(raw)) // 6])
    return forms


def encodings(value: str) -> set[bytes]:
    """Every form of ``value`` the redactor looks for (see the module docstring)."""
    raw = value.encode()
    forms = {raw, raw.hex().encode(), raw.hex().upper().encode(), *_b64_forms(raw)}
    for quoted in (quote(value, safe=""), quote(value), quote_plus(value), quote(value, safe="!'()*~")):
        forms |= {quoted.encode(), re.sub(r"%[0-9A-F]{2}", lambda m: m.group().lower(), quoted).encode()}
    forms |= {form.encode() for form in json_forms(value)} | {repr(value)[1:-1].encode()}
    return {f for f in forms if f}


_JSON_SHORT = {"\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t"}
#: Which control characters get their short escape: all five (most encoders), ``\n\r\t`` only (Go before 1.22
#: wrote ``\b`` and ``\f`` as ``\u0008`` and ``\u000c``), none.
_JSON_SHORT_SETS = ("\b\f\n\r\t", "\n\r\t", "")
#: What an encoder escapes as ``\uXXXX`` beyond the control characters: nothing more; ``<>&`` and U+2028/9 (Go's
#: encoding/json, Rails); Gson's default (``=``, so a base64 value's padding, and ``'`` too); the HTML-sensitive
#: ``<>&'"+``` (.NET's System.Text.Json by default, ``"`` as ``\u0022``).
_JSON_HTML_SETS = ("", "<>&\u2028\u2029", "<>&='\u2028\u2029", "<>&'\"+`")


def json_forms(value: str) -> set[str]:
    """``value`` inside a JSON string, as common encoders write it. Each form applies one style to the whole
    value, a combination of five choices (``/`` as ``\\/``, as PHP writes it; ``\\u`` hex in upper case;
    non-ASCII and DEL escaped; which others are escaped, ``_JSON_HTML_SETS``; which of ``\\b\\f\\n\\r\\t`` are
    short, the others ``\\u00XX``, ``_JSON_SHORT_SETS``): 96 forms at most whatever the value's length (a form per
    character's choice would be exponential in it); ``\\`` is always ``\\\\``, ``"`` is ``\\"`` unless escaped as
    ``\\u0022``. Python's ``json.dumps`` (with and without ``ensure_ascii``), JavaScript's, Go's, Gson's and .NET's
    are among them."""
    chars = set(value)
    forms = set()
    seen: set[frozenset[tuple[int, str]]] = set()
    for (slash, upper, ascii_only), html, short in itertools.product(itertools.product((False, True), repeat=3),
                                                                     _JSON_HTML_SETS, _JSON_SHORT_SETS):
        u = "\\u{:04X}" if upper else "\\u{:04x}"
        table: dict[int, str] = {}
        for ch in chars:
            code = ord(ch)
            if ch == "\\" or (ch == '"' and ch not in html):
                table[code] = "\\" + ch
            elif ch in short:
                table[code] = _JSON_SHORT[ch]
            elif code < 0x20 or ch in html or (ascii_only and code > 0x7E):
                if code > 0xFFFF:  # outside the BMP: a UTF-16 surrogate pair
                    code -= 0x10000
                    table[ord(ch)] = u.format(0xD800 + (code >> 10)) + u.format(0xDC00 + (code & 0x3FF))
                else:
                    table[code] = u.format(code)
            elif slash and ch == "/":
                table[code] = "\\/"
        key = frozenset(table.items())
        if key not in seen:  # most choices change nothing in a value without the characters they concern
            seen.add(key)
            forms.add(value.translate(table))
    return forms


#: How many first bytes of the forms the redactor's pattern looks for (``Redactor.intervals``).
_HEAD = 32


class Redactor:
    """Finds and replaces the declared values (and their encodings) in bytes or text."""

    def __init__(self, secrets: Mapping[str, Secret | str]) -> None:
        owners: dict[bytes, set[str]] = {}
        for name, secret in secrets.items():
            value = secret.reveal() if isinstance(secret, Secret) else secret
            for form in encodings(value):
                owners.setdefault(form, set()).add(name)
        self.names = sorted(secrets)
        self._owners = {form: frozenset(names) for form, names in owners.items()}
        # Longest first: at each position the longest form wins (it covers the shorter ones there).
        forms = sorted(self._owners, key=lambda f: (-len(f), f))
        self.forms = forms
        self.longest = len(forms[0]) if forms else 0
        # Not one alternation of the whole forms: compiling it took seconds for a 64 KiB value (~40 forms of up to
        # 6x its length). A pattern of their first bytes finds where one may start; the forms that start so are
        # tried there longest first: the same leftmost, longest match.
        head = min(_HEAD, *map(len, forms)) if forms else 0
        by_head: dict[bytes, list[bytes]] = {}
        for form in forms:
            by_head.setdefault(form[:head], []).append(form)
        self._by_head = {first: tuple(group) for first, group in by_head.items()}
        self._pattern = re.compile(b"|".join(re.escape(first) for first in by_head)) if forms else None

    def __repr__(self) -> str:
        return f"Redactor(names={self.names})"

    def __reduce__(self) -> Any:
        raise TypeError("a Redactor holds secret values and is not pickled")

    def intervals(self, data: bytes | bytearray) -> list[tuple[int, int, frozenset[str]]]:
        """Where the values are: sorted, merged (overlapping occurrences become one) intervals, with names."""
        if self._pattern is None:
            return []
        found: list[tuple[int, int, frozenset[str]]] = []
        search, by_head = self._pattern.search, self._by_head
        pos = 0
        while (m := search(data, pos)) is not None:
            start = m.start()
            pos = start + 1  # overlapping occurrences are found too: every byte of each is covered
            form = next((f for f in by_head[m.group()] if data.startswith(f, start)), None)
            if form is None:
                continue
            end = start + len(form)
            names = self._owners[form]
            if found and start < found[-1][1]:
                a, b, n = found[-1]
                found[-1] = (a, max(b, end), n | names)
            else:
                found.append((start, end, names))
        return found

    def redact(self, data: bytes) -> bytes:
        """``data`` with every occurrence replaced by ``[secret NAME]``."""
        return _apply(data, self.intervals(data), len(data))

    def redact_text(self, text: str) -> str:
        if not text or self._pattern is None:
            return text
        data = text.encode("utf-8", "surrogatepass")
        redacted = self.redact(data)
        return text if redacted == data else redacted.decode("utf-8", "surrogatepass")

    def stream(self) -> StreamRedactor:
        return StreamRedactor(self)


def _apply(data: bytes | bytearray, intervals: list[tuple[int, int, frozenset[str]]], upto: int) -> bytes:
    out = bytearray()
    pos = 0
    for start, end, names in intervals:
        if start >= upto:
            break
        out += data[pos:start]
        out += label(names)
        pos = min(end, upto)
    out += data[pos:upto]
    return bytes(out)


class StreamRedactor:
    """Redacts one stream that arrives in chunks: ``feed`` returns what is safe to pass on, ``flush`` the rest.

    It holds back the end of what it has that could be the start of a value continued in the next chunk (at
    most ``longest - 1`` bytes: only from the first position whose rest begins one of the forms; all of them
    when the forms are longer than 4 KiB), and an occurrence that runs into it. Memory is bounded: a run of
    overlapping occurrences longer than ``bound`` bytes is passed on as labels as it goes (``_cover``
    remembers how far the last one reached into what is still held)."""

    def __init__(self, redactor: Redactor) -> None:
        self.redactor = redactor
        self.keep = max(redactor.longest - 1, 0)
        self.bound = max(4096, 4 * redactor.longest)
        self._buf = bytearray()
        self._cover = 0
        self._cover_names: frozenset[str] = frozenset()
        self._by_first: dict[int, tuple[bytes, ...]] | None = None
        if self.keep <= 4096:
            by_first: dict[int, list[bytes]] = {}
            for form in redactor.forms:
                by_first.setdefault(form[0], []).append(form)
            self._by_first = {first: tuple(forms) for first, forms in by_first.items()}

    def feed(self, data: bytes) -> bytes:
        self._buf += data
        return self._emit(final=False)

    def flush(self) -> bytes:
        return self._emit(final=True)

    def _emit(self, *, final: bool) -> bytes:
        buf = self._buf
        found = self.redactor.intervals(buf)
        if self._cover:
            found = _merge([(0, self._cover, self._cover_names), *found])
        cut = len(buf) if final else self._held_from(buf)
        cover, names = 0, frozenset[str]()
        straddle = next((iv for iv in found if iv[0] < cut < iv[1]), None)
        if straddle is not None:
            if straddle[0] > 0 or len(buf) <= self.bound:
                cut = straddle[0]  # wait for the end of the run of occurrences
            else:  # a run longer than the bound: pass on its start as a label, remember the rest is covered
                cover, names = straddle[1] - cut, straddle[2]
        if cut == 0 and not final:
            return b""
        out = _apply(buf, found, cut)
        del buf[:cut]
        self._cover, self._cover_names = cover, names
        return out


    def _held_from(self, buf: bytearray) -> int:
        """Where the part that could begin an occurrence still to come starts (``len(buf)``: nowhere)."""
        n = len(buf)
        start = max(0, n - self.keep)
        if self._by_first is None:
            return start
        for pos in range(start, n):
            forms = self._by_first.get(buf[pos])
            if forms is not None:
                tail = bytes(buf[pos:])
                if any(f.startswith(tail) for f in forms):
                    return pos
        return n


def _merge(found: list[tuple[int, int, frozenset[str]]]) -> list[tuple[int, int, frozenset[str]]]:
    merged: list[tuple[int, int, frozenset[str]]] = []
    for start, end, names in sorted(found, key=lambda iv: iv[0]):
        if merged and start < merged[-1][1]:
            a, b, n = merged[-1]
            merged[-1] = (a, max(b, end), n | names)
        else:
            merged.append((start, end, names))
    return merged


# --- the run's redactor -----------------------------------------------------------------------------------

@contextlib.contextmanager
def redacting(redactor: Redactor | None) -> Iterator[None]:
    """An ExecboxError raised inside has its message redacted with ``redactor``."""
    try:
        yield
    except ExecboxError as exc:
        if redactor is not None:
            redact_error(exc, redactor)
        raise


def redact_error(exc: ExecboxError, redactor: Redactor) -> None:
    """Redact an error's message (and its reason and fix, for BackendUnavailableError) in place."""
    exc.message = redactor.redact_text(exc.message)
    exc.args = (exc.message, *exc.args[1:])
    for attr in ("reason", "fix"):
        value = getattr(exc, attr, None)
        if isinstance(value, str):
            setattr(exc, attr, redactor.redact_text(value))


def redactor_for(secrets: Mapping[str, Secret | str]) -> Redactor | None:
    return Redactor(secrets) if secrets else None


def redact_listing(entries: list[Any], redactor: Redactor | None) -> list[Any]:
    """A workspace listing (FileInfo: path, name) with secret values cut out of the names."""
    if redactor is None:
        return entries
    text = redactor.redact_text
    return [e.model_copy(update={"path": text(e.path), "name": text(e.name)}) for e in entries]


def redact_result(result: R, redactor: Redactor | None, names: list[str]) -> R:
    """An ExecResult as the caller may see it: ``secrets`` names the declared secrets; stdout and stderr (already
    redacted as they were captured: this pass only catches a backend whose captures were made elsewhere, and
    says so), notes, the explanation, egress host names and collected files (paths and contents) redacted."""
    if redactor is None:
        return result.model_copy(update={"secrets": names}) if names else result
    text = redactor.redact_text
    update: dict[str, Any] = {"secrets": names}
    notes = [text(n) for n in getattr(result, "notes", [])]
    for stream in ("stdout", "stderr"):
        value: str = getattr(result, stream)
        redacted = text(value)
        if redacted != value:
            update[stream] = redacted
            backend = getattr(result, "backend", "") or "?"
            notes.append(f"{stream} was redacted after the run, not as it was captured: a secret cut by the output "
                         f"cap may have left a fragment (backend {backend} builds its output captures outside the run)")
    update["notes"] = notes
    update["explanation"] = text(getattr(result, "explanation", ""))
    egress = getattr(result, "egress", None)
    if egress:
        update["egress"] = [a.model_copy(update={"host": text(a.host), "reason": text(a.reason)}) for a in egress]
    files = getattr(result, "files", None)
    if files:
        kept: dict[str, bytes] = {}
        for path, data in files.items():
            clean = redactor.redact(data)
            if clean != data:
                notes.append(f"collected file {text(path)!r}: a secret's value in it was replaced by its label")
            kept[text(path)] = clean
        update["files"] = kept
    return result.model_copy(update=update)


def redact_model(model: R, redactor: Redactor | None) -> R:
    """Every string in a result model (recursively: a cell's outputs, its error), redacted."""
    if redactor is None:
        return model

    def walk(value: Any) -> Any:
        if isinstance(value, str):
            return redactor.redact_text(value)
        if isinstance(value, list):
            return [walk(v) for v in value]
        if isinstance(value, dict):
            return {walk(k) if isinstance(k, str) else k: walk(v) for k, v in value.items()}
        return value

    return type(model).model_validate(walk(model.model_dump(mode="python")))


class _TextStream:
    """A StreamRedactor over text (the caller's on_stdout/on_stderr chunks)."""

    def __init__(self, redactor: Redactor) -> None:
        import codecs

        self._stream = redactor.stream()
        self._decoder = codecs.getincrementaldecoder("utf-8")("surrogatepass")

    def feed(self, text: str) -> str:
        return self._decoder.decode(self._stream.feed(text.encode("utf-8", "surrogatepass")))

    def flush(self) -> str:
        return self._decoder.decode(self._stream.flush(), final=True)


def redacted_callbacks(redactor: Redactor, *callbacks: Any) -> tuple[list[Any], Any]:
    """The caller's text callbacks (None, plain or coroutine functions) behind a stream redactor each, and an
    async ``finish()`` that passes on what they still hold back once the run is over."""
    import inspect

    wrapped: list[Any] = []
    pending: list[tuple[Any, _TextStream]] = []
    for callback in callbacks:
        if callback is None:
            wrapped.append(None)
            continue
        stream = _TextStream(redactor)
        pending.append((callback, stream))

        async def call(text: str, callback: Any = callback, stream: _TextStream = stream) -> None:
            out = stream.feed(text)
            if out:
                returned = callback(out)
                if inspect.isawaitable(returned):
                    await returned

        wrapped.append(call)

    async def finish() -> None:
        for callback, stream in pending:
            out = stream.flush()
            if out:
                returned = callback(out)
                if inspect.isawaitable(returned):
                    await returned

    return wrapped, finish
