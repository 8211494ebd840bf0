"""The redactor of declared secrets (secrets.values): every form of a value is cut out, nothing else is
changed, whatever the chunking of the stream; delivery through the stdin wrapper; the Secret type."""

from __future__ import annotations

import base64
import json
import os
import pickle
import subprocess
from urllib.parse import quote, quote_plus

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from execbox.errors import ConfigError
from execbox.secrets.values import (
    MAX_SECRET_BYTES,
    Redactor,
    Secret,
    check_secrets,
    deliver,
    encodings,
    label,
)

KEY = "sk-proj-9fQ2xLm7Tz0aBcD"


def reference(secrets: dict[str, str], data: bytes) -> bytes:
    """Brute force: at each position the longest form there; overlapping occurrences merged; labels."""
    owners: dict[bytes, set[str]] = {}
    for name, value in secrets.items():
        for form in encodings(value):
            owners.setdefault(form, set()).add(name)
    found: list[list[object]] = []
    for i in range(len(data)):
        hits = [f for f in owners if data.startswith(f, i)]
        if not hits:
            continue
        form = max(hits, key=lambda f: (len(f), [-b for b in f]))
        end, names = i + len(form), set(owners[form])
        if found and i < found[-1][1]:  # type: ignore[operator]
            found[-1][1] = max(found[-1][1], end)  # type: ignore[call-overload]
            found[-1][2] |= names  # type: ignore[operator]
        else:
            found.append([i, end, names])
    out, pos = bytearray(), 0
    for start, end, names in found:
        out += data[pos:start] + label(frozenset(names))  # type: ignore[arg-type, misc]
        pos = end  # type: ignore[assignment]
    return bytes(out + data[pos:])


def stream(redactor: Redactor, data: bytes, cuts: list[int]) -> bytes:
    s = redactor.stream()
    out, pos = b"", 0
    for cut in sorted(set(cuts)):
        out += s.feed(data[pos:cut])
        pos = cut
    return out + s.feed(data[pos:]) + s.flush()


# Small alphabets make overlapping and repeated values likely; no brackets, so a form cannot run into a label
# (with brackets in a value, a contrived neighbour could complete it with a label's own bracket).
values = st.text(alphabet=st.sampled_from("ab1/+=% \n\"\\é"), min_size=8, max_size=24) | st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\0[]"), min_size=8, max_size=30)


@st.composite
def cases(draw: st.DrawFn) -> tuple[dict[str, str], bytes, list[int]]:
    secrets = draw(st.dictionaries(st.sampled_from(["A", "B_KEY", "C"]), values, min_size=1, max_size=3))
    assume(all(len(v.encode()) >= 8 for v in secrets.values()))
    forms = sorted({f for v in secrets.values() for f in encodings(v)})
    pieces = draw(st.lists(st.one_of(st.binary(max_size=12), st.sampled_from(forms),
                                     st.sampled_from(forms).map(lambda f: f[: len(f) // 2])), max_size=12))
    data = b"".join(pieces)
    cuts = draw(st.lists(st.integers(0, len(data)), max_size=8))
    return secrets, data, cuts


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_any_value_any_chunking_never_leaks_and_changes_nothing_else(case: tuple[dict[str, str], bytes, list[int]]
                                                                     ) -> None:
    secrets, data, cuts = case
    redactor = Redactor(secrets)
    whole = redactor.redact(data)
    assert whole == reference(secrets, data)  # exactly the occurrences replaced, every other byte as it was
    assert stream(redactor, data, cuts) == whole  # chunk boundaries change nothing
    for value in secrets.values():
        for form in encodings(value):
            assert form not in whole


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\0[]"),
               min_size=8, max_size=40), st.binary(max_size=5), st.binary(max_size=5))
def test_base64_of_the_value_inside_a_longer_stream_at_every_alignment(value: str, before: bytes,
                                                                       after: bytes) -> None:
    assume(len(value.encode()) >= 8)
    redactor = Redactor({"K": value})
    for encode in (base64.b64encode, base64.urlsafe_b64encode):
        out = redactor.redact(encode(before + value.encode() + after))
        assert b"[secret K]" in out
        # What is left around the label is at most one character at each end per alignment: it cannot rebuild
        # the value (fewer than 12 bits of it, of 64 or more).
        assert len(out) - len(b"[secret K]") <= len(encode(before + after)) + 8


def test_the_common_encodings_are_each_redacted() -> None:
    value = "p@ss/word+with spaces&more=1"
    redactor = Redactor({"TOKEN": value})
    raw = value.encode()
    for form in [raw, base64.b64encode(raw), base64.urlsafe_b64encode(raw), base64.b64encode(raw).rstrip(b"="),
                 raw.hex().encode(), raw.hex().upper().encode(), quote(value, safe="").encode(),
                 quote(value, safe="").lower().encode(), quote_plus(value).encode(), json.dumps(value).encode(),
                 repr(value).encode()]:
        assert redactor.redact(b"<" + form + b">") in (b"<[secret TOKEN]>", b'<"[secret TOKEN]">',
                                                       b"<'[secret TOKEN]'>"), form


def test_text_redaction_keeps_everything_else_including_invalid_utf8_markers() -> None:
    redactor = Redactor({"K": KEY})
    text = f"héllo {KEY}\udcff \ufffd {KEY[:5]}"
    assert redactor.redact_text(text) == "héllo [secret K]\udcff \ufffd sk-pr"


def test_a_long_run_of_overlapping_occurrences_is_streamed_with_bounded_memory() -> None:
    redactor = Redactor({"A": "aaaaaaaa"})
    s = redactor.stream()
    out = bytearray()
    for _ in range(2000):
        out += s.feed(b"a" * 1000)
        assert len(s._buf) <= s.bound + 1000
    out += s.flush()
    assert b"a" not in out and out.startswith(b"[secret A]")


def test_check_secrets_refuses_what_cannot_work() -> None:
    assert list(check_secrets({"OPENAI_API_KEY": KEY, "B": Secret(KEY)})) == ["OPENAI_API_KEY", "B"]
    for bad, says in [({"A": "short"}, "at least 8 bytes"), ({"1A": KEY}, "letters, digits"),
                      ({"A-B": KEY}, "letters, digits"), ({"LD_PRELOAD": KEY}, "loader"),
                      ({"PATH": KEY}, "the sandbox sets"), ({"A": KEY + "\0"}, "NUL"),
                      ({"A": "x" * (MAX_SECRET_BYTES + 1)}, "over"), ({"A": 12345678}, "give a str"),
                      ({"A": "\udcff" * 8}, "lone surrogate")]:
        with pytest.raises(ValueError, match=says):
            check_secrets(bad)  # type: ignore[arg-type]


def test_a_secret_never_shows_its_value() -> None:
    secret = Secret(KEY)
    assert KEY not in repr(secret) and KEY not in str(secret) and KEY not in f"{secret}"
    assert KEY not in repr([secret]) and KEY not in repr({"k": secret})
    with pytest.raises(TypeError):
        pickle.dumps(secret)
    assert secret.reveal() == KEY


def test_secret_from_env_and_from_file(tmp_path: os.PathLike[str]) -> None:
    assert Secret.from_env("X_TOKEN", {"X_TOKEN": KEY}).reveal() == KEY
    assert "environment variable X_TOKEN" in repr(Secret.from_env("X_TOKEN", {"X_TOKEN": KEY}))
    with pytest.raises(ConfigError, match="not set"):
        Secret.from_env("NOT_THERE_AT_ALL", {})
    path = os.path.join(tmp_path, "key")
    with open(path, "w") as fh:
        fh.write(KEY + "\n")
    assert Secret.from_file(path).reveal() == KEY
    with open(path, "wb") as fh:
        fh.write(b"\xff\xfe" * 8)
    with pytest.raises(ConfigError, match="UTF-8"):
        Secret.from_file(path)
    with open(path, "wb") as fh:
        fh.write(b"x" * (MAX_SECRET_BYTES + 10))
    with pytest.raises(ConfigError, match="over"):
        Secret.from_file(path)
    with pytest.raises(ConfigError, match="cannot read"):
        Secret.from_file(os.path.join(tmp_path, "missing"))


@pytest.mark.parametrize("shell", ["dash", "bash"])
def test_the_wrapper_exports_exactly_the_values_and_leaves_the_rest_of_stdin(shell: str) -> None:
    secrets = {"A_KEY": Secret("sk-abc\n\ndef%s\\n'\"$(id)`\t é中😀  \n\n"), "B": Secret("-n\\c%%%d-e")}
    argv, stdin = deliver(["python3", "-c", "import os, sys, json; print(json.dumps([os.environ['A_KEY'], "
                           "os.environ['B'], sys.stdin.read(), [k for k in os.environ if 'execbox' in k]]))"],
                          b"the rest\nof stdin", secrets)
    assert argv[0] == "/bin/sh"
    for secret in secrets.values():  # never on the command line
        assert all(secret.reveal() not in word for word in argv)
    proc = subprocess.run([shell, *argv[1:]], input=stdin, capture_output=True, check=True)
    assert json.loads(proc.stdout) == [secrets["A_KEY"].reveal(), secrets["B"].reveal(), "the rest\nof stdin", []]


def test_the_wrapper_runs_nothing_without_its_end_line() -> None:
    argv, stdin = deliver(["echo", "ran"], None, {"A": Secret(KEY)})
    proc = subprocess.run(argv, input=stdin[:-2], capture_output=True)
    assert proc.returncode == 125 and b"ran" not in proc.stdout


def test_a_stream_holds_back_only_what_could_begin_a_value() -> None:
    s = Redactor({"K": KEY}).stream()
    assert s.feed(b"hello\n") == b"hello\n"  # nothing of it can begin a form: passed on at once
    assert s.feed(b"x " + KEY[:5].encode()) == b"x "  # this could: held
    assert s.feed(KEY[5:].encode() + b" y\n") == b"[secret K] y\n"
    assert s.feed(b"sk") == b"" and s.flush() == b"sk"
