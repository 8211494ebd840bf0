"""A declared value written inside a JSON string is redacted however the encoder escaped it: ``\\/`` for ``/``
(PHP), ``\\uXXXX`` in either case, non-ASCII escaped or not, Go's ``\\u003c`` for ``<>&``, control characters
short or as ``\\u00XX``; and the number of forms stays small whatever the value."""

from __future__ import annotations

import json
import re
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from execbox.secrets.values import Redactor, json_forms


def _upper_hex(text: str) -> str:
    return re.sub(r"\\u([0-9a-f]{4})", lambda m: "\\u" + m.group(1).upper(), text)


def _go(value: str) -> str:  # Go's encoding/json: UTF-8 kept, <>& and U+2028/9 escaped
    text = json.dumps(value, ensure_ascii=False)[1:-1]
    for ch in "<>&\u2028\u2029":
        text = text.replace(ch, f"\\u{ord(ch):04x}")
    return text


def _long_controls(value: str, controls: str = "\b\f\n\r\t", text: str | None = None) -> str:
    # \\u00XX for each of ``controls``, not its short form
    text = json.dumps(value)[1:-1] if text is None else text
    for ch in controls:
        short = json.dumps(ch)[1:-1]
        text = re.sub(r"(?<!\\)((?:\\\\)*)" + re.escape(short), lambda m, c=ch: m.group(1) + f"\\u{ord(c):04x}", text)
    return text


def _dotnet(value: str) -> str:  # System.Text.Json's default: ASCII only, upper hex, HTML-sensitive and " escaped
    text = _upper_hex(json.dumps(value)[1:-1])
    text = re.sub(r'(?<!\\)((?:\\\\)*)\\"', lambda m: m.group(1) + "\\u0022", text)
    for ch in "<>&'+`":
        text = text.replace(ch, f"\\u{ord(ch):04X}")
    return text


def _gson(value: str) -> str:  # Gson's default (HTML-safe): UTF-8 kept, <>&=' and U+2028/9 as \\u00xx
    text = json.dumps(value, ensure_ascii=False)[1:-1]
    for ch in "<>&='\u2028\u2029":
        text = text.replace(ch, f"\\u{ord(ch):04x}")
    return text


ENCODERS: dict[str, Callable[[str], str]] = {
    "python": lambda v: json.dumps(v)[1:-1],
    "python utf-8": lambda v: json.dumps(v, ensure_ascii=False)[1:-1],
    "php \\/": lambda v: json.dumps(v)[1:-1].replace("/", "\\/"),
    "php \\/ utf-8": lambda v: json.dumps(v, ensure_ascii=False)[1:-1].replace("/", "\\/"),
    "upper hex": lambda v: _upper_hex(json.dumps(v)[1:-1]),
    "upper hex \\/": lambda v: _upper_hex(json.dumps(v)[1:-1]).replace("/", "\\/"),
    "go": _go,
    "go upper hex": lambda v: _upper_hex(_go(v)),
    "controls as \\u00XX": _long_controls,
    "go before 1.22 (\\b \\f as \\u00XX)": lambda v: _long_controls(v, "\b\f", _go(v)),
    "controls as \\u00XX, upper hex, \\/": lambda v: _upper_hex(_long_controls(v)).replace("/", "\\/"),
    ".net": _dotnet,
    "gson": _gson,
}
VALUE = 'sk/live"q\\u\n\t\b\x01 é€😀<a>&b\u2028+\'`=='


@pytest.mark.parametrize("encoder", sorted(ENCODERS))
def test_each_json_escaping_of_a_value_is_redacted(encoder: str) -> None:
    form = ENCODERS[encoder](VALUE)
    assert json.loads(f'"{form}"') == VALUE  # a real JSON spelling of the value
    assert Redactor({"K": VALUE}).redact(f'{{"k": "{form}"}}'.encode()) == b'{"k": "[secret K]"}'


def test_a_base64_value_from_gson_is_redacted() -> None:
    value = "c2stbGl2ZS0xMjM0NTY3OA=="  # Gson writes its padding as \\u003d\\u003d
    gson = '{"token":"' + _gson(value) + '"}'
    assert json.loads(gson) == {"token": value} and "\\u003d" in gson
    assert Redactor({"T": value}).redact(gson.encode()) == b'{"token":"[secret T]"}'


def test_a_slash_escaped_as_php_does_is_redacted() -> None:
    value = "ghp_token/with/slashes+x=="
    php = json.dumps({"token": value}).replace("/", "\\/").encode()
    assert Redactor({"T": value}).redact(php) == b'{"token": "[secret T]"}'


def test_the_json_forms_stay_few_for_any_value() -> None:
    assert len(json_forms(VALUE)) <= 96
    assert json_forms("sk-plainvalue123") == {"sk-plainvalue123"}
    long = (VALUE * 3000)[:60000]
    assert len(json_forms(long)) <= 96


@given(st.text(min_size=8), st.sampled_from(sorted(ENCODERS)))
def test_any_value_in_any_of_these_spellings_is_redacted(value: str, encoder: str) -> None:
    try:
        value.encode()
    except UnicodeEncodeError:  # a lone surrogate is no declared secret's value
        return
    form = ENCODERS[encoder](value).encode()
    assert b"[secret K]" in Redactor({"K": value}).redact(b"<" + form + b">")
