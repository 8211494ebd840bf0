"""Bounded output capture: head + tail + marker, exact counts, bounded memory, safe decoding."""

from __future__ import annotations

import random
import tracemalloc
from pathlib import Path

import pytest

from execbox import Runner, Settings
from execbox.contract.output import BoundedCapture

DATA = bytes(range(256)) * 40  # 10240 bytes, every position distinct enough to spot a wrong cut


def feed(capture: BoundedCapture, data: bytes, seed: int) -> None:
    rng = random.Random(seed)
    pos = 0
    while pos < len(data):
        step = rng.choice([1, 2, 7, 100, 4096])
        capture.write(data[pos:pos + step])
        pos += step


@pytest.mark.parametrize("cap", [1, 2, 10, 11, 1000])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_head_and_tail_are_exact_whatever_the_chunking(cap: int, seed: int) -> None:
    capture = BoundedCapture(cap)
    feed(capture, DATA, seed)
    head_len = cap - cap // 2
    tail_len = cap // 2
    value = capture.getvalue()
    assert capture.truncated and capture.total == len(DATA)
    assert value.startswith(DATA[:head_len])
    assert value.endswith(DATA[len(DATA) - tail_len:] if tail_len else b"")
    omitted = len(DATA) - cap
    marker = f"\n[... execbox: {omitted} bytes omitted; output is capped at {cap} bytes ...]\n".encode()
    assert value == DATA[:head_len] + marker + (DATA[-tail_len:] if tail_len else b"")


@pytest.mark.parametrize("size", [0, 1, 99, 100])
def test_output_up_to_the_cap_is_kept_whole_without_marker(size: int) -> None:
    capture = BoundedCapture(100)
    feed(capture, DATA[:size], seed=size)
    assert capture.getvalue() == DATA[:size]
    assert not capture.truncated
    assert capture.total == size


def test_one_byte_over_the_cap_is_truncated_with_the_count() -> None:
    capture = BoundedCapture(100)
    capture.write(DATA[:101])
    assert capture.truncated
    assert b"1 bytes omitted" in capture.getvalue()
    assert capture.getvalue().endswith(DATA[51:101])


def test_memory_stays_bounded_while_200_mb_stream_through() -> None:
    cap = 64 * 1024
    capture = BoundedCapture(cap)
    big = bytes(range(256)) * 4096  # 1 MiB
    small = b"x" * 3000
    total = 0
    tracemalloc.start()
    try:
        baseline, _ = tracemalloc.get_traced_memory()
        while total < 200 * 1024 * 1024:
            for chunk in (big, small):
                capture.write(chunk)
                total += len(chunk)
                assert len(capture.head) <= capture.head_cap
                assert len(capture.tail) <= capture.tail_cap
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert capture.total == total
    # The capture holds at most the cap; slicing may copy one chunk at a time, never the stream.
    assert peak - baseline < cap + len(big) + 1024 * 1024
    assert capture.getvalue().endswith((big + small)[-(cap // 2):])


def test_a_multibyte_character_cut_at_the_cap_decodes_with_replacement() -> None:
    text = "é" * 100  # two bytes each
    capture = BoundedCapture(7)  # head 4 bytes, tail 3 bytes: both cuts land inside a character
    capture.write(text.encode())
    decoded = capture.text()
    assert decoded.startswith("éé")
    assert decoded.endswith("\ufffdé")
    assert "\ufffd" in decoded


def test_invalid_utf8_in_a_small_output_decodes_with_replacement() -> None:
    capture = BoundedCapture(100)
    capture.write(b"ok \xff\xfe end")
    assert capture.text() == "ok \ufffd\ufffd end"


def test_a_run_that_floods_output_keeps_head_and_tail_within_the_cap(home: Path) -> None:
    runner = Runner(Settings.from_env(local=True, network="host", max_output_bytes=1000))
    code = "import sys; sys.stdout.write('H' * 600 + 'x' * 5_000_000 + 'T' * 600); sys.stderr.write('e' * 10)"
    # A request above the maximum is clamped to it.
    result = runner.run(["python3", "-c", code], backend="local_subprocess", max_output_bytes=10**8)
    assert result.exit_code == 0
    assert result.truncated
    assert result.stdout.startswith("H" * 500 + "\n[... execbox: ")
    assert result.stdout.endswith("...]\n" + "T" * 500)
    assert f"{600 + 5_000_000 + 600 - 1000} bytes omitted" in result.stdout
    assert result.stderr == "e" * 10
