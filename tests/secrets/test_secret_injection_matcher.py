"""The redactor's matcher (secrets.values.Redactor.intervals) finds exactly what one alternation of every
form, longest first, found (its pattern was that, which took ~18 s to compile for a 64 KiB value): the same
intervals and names for any data, with values that share their start, forms that overlap, a form cut short."""

from __future__ import annotations

import random
import re
import string

from hypothesis import given, settings
from hypothesis import strategies as st

from execbox.secrets.values import Redactor, encodings

# Few letters: values share long starts and their forms overlap; '/', '"', '\\', '<', '\n' make JSON forms differ.
ALPHABET = "ab/\"\\<\n"


def reference(secrets: dict[str, str], data: bytes) -> list[tuple[int, int, frozenset[str]]]:
    """The matcher as it was: one alternation of the forms, longest first, searched again one byte on."""
    owners: dict[bytes, set[str]] = {}
    for name, value in secrets.items():
        for form in encodings(value):
            owners.setdefault(form, set()).add(name)
    pattern = re.compile(b"|".join(re.escape(f) for f in sorted(owners, key=lambda f: (-len(f), f))))
    found: list[tuple[int, int, frozenset[str]]] = []
    pos = 0
    while (m := pattern.search(data, pos)) is not None:
        start, end = m.span()
        names = frozenset(owners[m.group()])
        if found and start < found[-1][1]:
            a, b, n = found[-1]
            found[-1] = (a, max(b, end), n | names)
        else:
            found.append((start, end, names))
        pos = start + 1
    return found


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text(ALPHABET, min_size=8, max_size=14), min_size=1, max_size=3), st.data())
def test_the_matcher_finds_what_one_alternation_of_the_forms_found(values: list[str], data: st.DataObject) -> None:
    secrets = {f"K{i}": value for i, value in enumerate(values)}
    forms = sorted({form for value in values for form in encodings(value)})
    piece = st.one_of(st.sampled_from(forms), st.sampled_from(forms).flatmap(lambda f: st.just(f[:len(f) // 2])),
                      st.text(ALPHABET, max_size=6).map(str.encode))
    text = b"".join(data.draw(st.lists(piece, max_size=8)))
    redactor = Redactor(secrets)
    assert redactor.intervals(text) == reference(secrets, text)
    assert redactor.intervals(bytearray(text)) == reference(secrets, text)  # as the stream redactor gives it


def test_a_64_kib_value_of_every_kind_of_character_is_redacted_in_each_form() -> None:
    rnd = random.Random(25)
    value = "".join(rnd.choice(string.printable) for _ in range(64 << 10))  # '/', '"', '\\', '<', '\n' included
    redactor = Redactor({"K": value})
    for form in encodings(value):
        assert redactor.redact(b"<" + form + b">") == b"<[secret K]>"
