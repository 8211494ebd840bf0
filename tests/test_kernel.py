"""run_cell (issue 15): a persistent Python interpreter per session, on docker and bubblewrap: state across
cells, timeouts that keep or lose the state (and say which), a memory limit that kills the interpreter and
not the session, rich outputs as MIME bundles, matplotlib figures as PNG, network none; and the host side
(kernel/client.py CellParser) holding its bounds against whatever the sandbox sends."""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from typing import Any

import pytest

from execbox import CellResult, Limits, Runner, Sandbox, Settings
from execbox.contract.models import ExecResult
from execbox.errors import BackendUnavailableError
from execbox.kernel.client import CellParser
from execbox.runner import run_blocking
from execbox.testing import PeakRss, engine_missing
from tests.backends.test_files_docker_bubblewrap import data_image  # noqa: F401 - a fixture, shared
from tests.support.gvisor import DOCKER_GVISOR, backend_for

# --- the host side's bounds, no engine --------------------------------------------------------------------------


def frames(*objs: Any) -> bytes:
    return b"".join(json.dumps(o).encode() + b"\n" for o in objs)


def test_parser_rebuilds_streams_outputs_and_the_final_frame() -> None:
    parser = CellParser(max_output=100, max_display=1000)
    data = frames({"t": "stream", "s": "stdout", "d": "hé"}, {"t": "stream", "s": "stderr", "d": "oops\n"},
                  {"t": "display", "kind": "result", "data": {"text/plain": "42"}, "metadata": {}},
                  {"t": "done", "count": 3, "error": None})
    for i in range(0, len(data), 7):  # in pieces, as a stream delivers it
        parser.feed("stdout", data[i:i + 7])
    assert parser.captures["stdout"].text() == "hé" and parser.captures["stderr"].text() == "oops\n"
    assert [(o.kind, o.text) for o in parser.outputs] == [("result", "42")]
    assert parser.done is not None and parser.done["count"] == 3 and parser.bad_lines == 0


def test_parser_skips_an_over_long_line_without_buffering_it() -> None:
    parser = CellParser(max_output=100, max_display=1000)
    limit = parser.max_line
    parser.feed("stdout", b'{"t":"stream","s":"stdout","d":"' + b"x" * (limit // 2))
    parser.feed("stdout", b"x" * limit)  # still the same line: over the bound, dropped as it comes
    assert len(parser.buf) == 0 and parser.skipping
    parser.feed("stdout", b"x" * limit + b'"}\n' + frames({"t": "stream", "s": "stdout", "d": "after"}))
    assert parser.captures["stdout"].text() == "after" and parser.bad_lines == 1


def test_parser_caps_rich_outputs_and_ignores_what_it_does_not_know() -> None:
    parser = CellParser(max_output=100, max_display=2000)
    big = {"t": "display", "data": {"image/png": "A" * 900}, "metadata": {}}
    parser.feed("stdout", frames(big, big, big, ["not", "a", "frame"], {"t": "display", "data": ["bad"]},
                                 {"t": "stream", "s": "elsewhere", "d": "x"}, {"t": "unknown"}) + b"{broken\n")
    assert len(parser.outputs) == 2 and parser.dropped_displays == 1
    assert parser.bad_lines == 3  # the list, the bad display, the broken line
    parser.feed("stderr", frames({"t": "done"}))  # only the relay's stdout carries frames
    assert parser.done is None


def test_a_display_nested_too_deep_is_dropped_and_the_result_stays_serialisable() -> None:
    # Found attacking: a _repr_json_ nested 300 deep made the CellResult unserialisable, 900 deep a RecursionError.
    deep: Any = "leaf"
    for _ in range(300):
        deep = [deep]
    parser = CellParser(max_output=100, max_display=1 << 20)
    parser.feed("stdout", frames({"t": "display", "data": {"application/json": deep}, "metadata": {}},
                                 {"t": "display", "data": {"text/plain": "ok"}, "metadata": {"a": [[1]]}}))
    assert parser.dropped_displays == 1 and [o.text for o in parser.outputs] == ["ok"]
    CellResult(outputs=parser.outputs).model_dump_json()


def test_parser_keeps_head_and_tail_of_a_flood_and_counts_what_the_sandbox_cut() -> None:
    parser = CellParser(max_output=1000, max_display=1000)
    for _ in range(2000):
        parser.feed("stdout", frames({"t": "stream", "s": "stdout", "d": "y" * 500}))
    parser.feed("stdout", frames({"t": "drop", "s": "stdout", "n": 10**9}, {"t": "stream", "s": "stdout", "d": "END"}))
    text = parser.captures["stdout"].text()
    assert len(text) < 1200 and text.endswith("END") and "bytes omitted" in text
    assert parser.captures["stdout"].truncated


def test_parser_bounds_what_one_line_of_tiny_items_or_deep_nesting_costs() -> None:
    parser = CellParser(max_output=100, max_display=16 << 20)
    tiny = b'{"t":"display","data":{"application/json":[' + b"[1]," * 1_000_000 + b'[1]]}}\n'
    deep = b'{"t":"display","data":{"application/json":' + b"[" * 200_000 + b"]" * 200_000 + b"}}\n"
    with PeakRss() as rss:
        parser.feed("stdout", tiny + deep)
    assert parser.outputs == [] and parser.bad_lines == 2  # neither parsed: skipped, counted
    assert rss.growth < 64 << 20, f"parsing two hostile lines cost {rss.growth >> 20} MiB"
    parser.feed("stdout", frames(*({"t": "display", "data": {"text/plain": str(i)}} for i in range(1500))))
    assert len(parser.outputs) == 1000 and parser.dropped_displays == 500  # a count bound, whatever the size


def test_parser_reads_a_non_streaming_backends_output_at_the_end() -> None:
    parser = CellParser(max_output=100, max_display=1000)
    parser.finish(ExecResult(exit_code=0, stdout=frames({"t": "stream", "s": "stdout", "d": "late"},
                                                        {"t": "done", "count": 1}).decode()))
    assert parser.captures["stdout"].text() == "late" and parser.done == {"t": "done", "count": 1}


# --- docker and bubblewrap --------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def matplotlib_image(data_image: str) -> str:
    """The image with Debian's numpy and matplotlib that the data-path tests build (one recipe, so one build per
    machine for both)."""
    return data_image


def _usable(runner: Runner, name: str) -> None:
    try:
        run_blocking(runner.aio.backend(name).check)
    except BackendUnavailableError as exc:
        engine_missing(f"{name} cannot run here: {exc}")


@pytest.fixture(params=["docker", DOCKER_GVISOR, "bubblewrap"])
def sandbox(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Sandbox]:
    """A sandbox with network none (the default), its interpreter started by the first cell."""
    name = backend_for(request, monkeypatch)
    with Runner(Settings.from_env()) as runner:
        _usable(runner, name)
        with runner.sandbox(name, network="none") as sb:
            yield sb


def texts(result: CellResult) -> list[str | None]:
    return [output.text for output in result.outputs]


@pytest.mark.engine
def test_state_persists_across_cells_with_network_none(sandbox: Sandbox) -> None:
    one = sandbox.run_cell("import json, socket\nnotes = open('notes.txt', 'w')\nx = 40\n"
                           "sorted(name for _, name in socket.if_nameindex())")
    assert one.ok and one.execution_count == 1 and not one.state_lost, one
    assert texts(one) == ["['lo']"]  # network none: loopback only, and the interpreter works
    two = sandbox.run_cell("notes.write('kept open')\nx += 1\nprint('x is', x)")
    assert two.ok and two.stdout == "x is 41\n" and two.execution_count == 2, two
    three = sandbox.run_cell("notes.close()\njson.dumps({'x': x + 1, 'notes': open('notes.txt').read()})")
    assert three.ok and three.execution_count == 3, three
    assert texts(three) == ['\'{"x": 42, "notes": "kept open"}\'']
    assert three.outputs[0].kind == "result"


@pytest.mark.engine
def test_an_exception_is_data_and_the_state_stays(sandbox: Sandbox) -> None:
    sandbox.run_cell("y = 'still here'")
    failed = sandbox.run_cell("def f():\n    return 1 / 0\nf()")
    assert not failed.ok and failed.error is not None and failed.error.name == "ZeroDivisionError"
    assert "<cell-2>" in failed.error.traceback and "_kernel" not in failed.error.traceback
    assert "ZeroDivisionError" in failed.stderr and not failed.state_lost
    assert texts(sandbox.run_cell("y")) == ["'still here'"]


@pytest.mark.engine
def test_a_timed_out_cell_is_interrupted_and_keeps_the_state(sandbox: Sandbox) -> None:
    sandbox.run_cell("kept = 7")
    slow = sandbox.run_cell("import time\nprint('started', flush=True)\ntime.sleep(120)", timeout=2)
    assert slow.timed_out and not slow.state_lost, slow
    assert slow.error is not None and slow.error.name == "KeyboardInterrupt" and slow.stdout == "started\n"
    after = sandbox.run_cell("kept")
    assert texts(after) == ["7"] and after.execution_count == 3 and not after.state_lost


@pytest.mark.engine
def test_a_cell_that_ignores_the_interrupt_loses_the_state_and_says_so(sandbox: Sandbox) -> None:
    sandbox.run_cell("lost = 7")
    stuck = sandbox.run_cell("import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\ntime.sleep(120)",
                             timeout=1)
    assert stuck.timed_out and stuck.state_lost and not stuck.ok, stuck
    assert stuck.error is not None and stuck.error.name == "InterpreterLost"
    assert any("state was lost" in note for note in stuck.notes)
    fresh = sandbox.run_cell("'lost' in globals()")
    assert texts(fresh) == ["False"] and fresh.execution_count == 1 and not fresh.state_lost


@pytest.mark.engine
def test_a_dead_supervisor_is_never_a_silent_restart(sandbox: Sandbox) -> None:
    sandbox.run_cell("value = 1")
    gone = sandbox.run_cell("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nimport time\ntime.sleep(30)",
                            timeout=20)
    assert gone.state_lost and gone.error is not None and gone.error.name == "InterpreterLost", gone
    again = sandbox.run_cell("'value' in globals()")
    assert texts(again) == ["False"] and again.execution_count == 1


@pytest.mark.engine
def test_rich_outputs_come_back_as_mime_bundles(sandbox: Sandbox) -> None:
    result = sandbox.run_cell(RICH)
    assert result.ok, result
    shown, value = result.outputs
    assert shown.kind == "display" and value.kind == "result"
    assert shown.data["text/html"] == "<b>rich</b>" and shown.data["image/svg+xml"].startswith("<svg")
    assert shown.data["application/json"] == {"answer": 42} and shown.data["text/plain"] == "Rich()"
    png = shown.binary("image/png")
    assert png is not None and png.startswith(b"\x89PNG\r\n\x1a\n")
    assert struct.unpack(">II", png[16:24]) == (3, 2)  # the IHDR the cell wrote: 3 x 2 pixels
    assert value.data == {"text/plain": "{'plain': 1}"}


RICH = '''
import struct, zlib
def chunk(kind, data):
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
PNG = (b"\\x89PNG\\r\\n\\x1a\\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 3, 2, 8, 2, 0, 0, 0))
       + chunk(b"IDAT", zlib.compress(b"\\x00" + b"\\xff\\x00\\x00" * 3 + b"\\x00" + b"\\x00\\xff\\x00" * 3))
       + chunk(b"IEND", b""))
class Rich:
    def _repr_html_(self): return "<b>rich</b>"
    def _repr_svg_(self): return "<svg xmlns='http://www.w3.org/2000/svg'/>"
    def _repr_png_(self): return PNG
    def _repr_json_(self): return {"answer": 42}
    def __repr__(self): return "Rich()"
display(Rich())
{"plain": 1}
'''


def _png_size(png: bytes) -> tuple[int, int]:
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and png[12:16] == b"IHDR"
    width, height = struct.unpack(">II", png[16:24])
    assert zlib.crc32(png[12:29]) == struct.unpack(">I", png[29:33])[0]  # a real PNG header, not a prefix
    return width, height


PLOT = "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [4, 1, 9])\nplt.title('execbox')"


@pytest.mark.engine
def test_a_matplotlib_plot_comes_back_as_png_on_docker(matplotlib_image: str) -> None:
    with Runner(Settings.from_env()) as runner:
        _usable(runner, "docker")
        with runner.sandbox("docker", network="none", image=matplotlib_image) as sb:
            result = sb.run_cell(PLOT, timeout=120)  # the first import builds matplotlib's font cache
            shown = sb.run_cell("fig, ax = plt.subplots()\nax.bar([1, 2], [3, 4])\nplt.show()\nprint('shown')")
    assert result.ok, result
    pngs = [o.binary("image/png") for o in result.outputs if "image/png" in o.data]
    assert len(pngs) == 1 and pngs[0] is not None
    width, height = _png_size(pngs[0])
    assert width > 100 and height > 100
    assert shown.ok and shown.stdout == "shown\n" and [sorted(o.data) for o in shown.outputs] == [
        ["image/png", "text/plain"]]


@pytest.mark.engine
def test_a_matplotlib_plot_comes_back_as_png_on_bubblewrap() -> None:
    with Runner(Settings.from_env()) as runner:
        _usable(runner, "bubblewrap")
        with runner.sandbox("bubblewrap", network="none") as sb:
            # bubblewrap binds the host's /usr (not its /etc): the cell sees the host's own python3 and what it
            # has installed, if that works without the host's /etc (Debian's matplotlib reads /etc/matplotlibrc).
            probe = sb.exec(["python3", "-c", "import matplotlib"])
            if probe.exit_code != 0:
                pytest.skip("capability: matplotlib does not import inside bubblewrap here (the host's python3 has "
                            f"none, or it needs the host's /etc): {probe.stderr.strip()[-200:]}; docker's is "
                            "covered by an image")
            result = sb.run_cell(PLOT, timeout=120)
    assert result.ok, result
    pngs = [o.binary("image/png") for o in result.outputs if "image/png" in o.data]
    assert len(pngs) == 1 and pngs[0] is not None and _png_size(pngs[0])[0] > 100


@pytest.mark.engine
@pytest.mark.parametrize("backend", ["docker", "bubblewrap"])
def test_a_memory_limit_kills_the_interpreter_not_the_session(backend: str) -> None:
    with Runner(Settings.from_env()) as runner:
        _usable(runner, backend)
        with runner.sandbox(backend, limits=Limits(memory_mb=256)) as sb:
            if "memory" not in (sb.aio.capabilities.limits if sb.aio.capabilities else ()):
                pytest.skip(f"capability: {backend} enforces no memory limit on this host")
            sb.run_cell("before = 1")
            hog = sb.run_cell("blob = bytearray(2 * 1024 ** 3)", timeout=60)
            assert hog.state_lost and not hog.ok, hog
            if backend == "docker":  # the container's cgroup is readable inside: the kill is named for what it is
                assert hog.oom_killed and "out of memory" in " ".join(hog.notes)
            else:  # bubblewrap mounts no /sys: the interpreter was SIGKILLed, which is all it can tell
                assert "SIGKILL (a memory limit" in " ".join(hog.notes)
            assert sb.exec("echo session alive").stdout == "session alive\n"
            after = sb.run_cell("'before' in globals()")
            assert texts(after) == ["False"] and after.execution_count == 1


@pytest.mark.engine
def test_a_cell_printing_a_gigabyte_keeps_the_callers_memory_flat(sandbox: Sandbox) -> None:
    seen = {"chars": 0}

    def count(text: str) -> None:
        seen["chars"] += len(text)

    with PeakRss() as rss:
        result = sandbox.run_cell("import sys\nchunk = 'z' * (1 << 20)\nfor _ in range(1024):\n"
                                  "    sys.stdout.write(chunk)\nprint('END')", timeout=120, on_stdout=count)
    assert result.ok and result.truncated, result.model_dump(exclude={"stdout"})
    assert result.stdout.startswith("zzz") and result.stdout.endswith("zEND\n") and "bytes omitted" in result.stdout
    assert seen["chars"] == len(result.stdout)
    growth_mb = rss.growth / 2**20
    assert growth_mb < 100, f"the caller's memory grew by {growth_mb:.0f} MB for a 1 GB cell"


@pytest.mark.engine
def test_a_cancelled_cell_is_interrupted_and_the_next_one_runs(sandbox: Sandbox) -> None:
    """The caller gives up on a cell (cancellation): the cell is interrupted in the sandbox, whatever the backend
    does with the cancelled relay (docker leaves it running), and the next cell runs with the state kept."""
    import anyio

    sandbox.run_cell("kept = 'yes'")

    async def give_up() -> None:
        with anyio.move_on_after(2):
            await sandbox.aio.run_cell("import time\ntime.sleep(60)", timeout=60)

    sandbox._call(give_up)
    after = sandbox.run_cell("kept", timeout=30)
    assert after.ok and texts(after) == ["'yes'"] and not after.state_lost, after


def test_cells_are_in_the_audit_log_as_hashes_and_outcomes() -> None:
    import hashlib

    from execbox.audit import reader as audit_reader
    code = "print('secret-ish output')\n{'a': 1}"
    with Runner(Settings(local=True, network="host")) as runner, runner.sandbox("local_subprocess") as sb:
        sb.run_cell(code)
        session = sb.aio.id
    assert runner.audit.path is not None
    cells = [r for r in audit_reader.records(runner.audit.path, session=session) if r.get("event") == "cell"]
    assert len(cells) == 1, cells
    cell = cells[0]
    assert cell["code_sha256"] == hashlib.sha256(code.encode()).hexdigest() and cell["language"] == "python"
    assert cell["error"] is None and cell["execution_count"] == 1 and cell["outputs"] == [["text/plain"]]
    assert "secret-ish" not in json.dumps(cell)  # output as hashes unless CODE_EXEC_AUDIT_OUTPUT says otherwise
