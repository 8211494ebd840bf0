"""Checks of how a command runs: exit codes as data, stdout and stderr kept apart, stdin, UTF-8 decoding,
python and bash code, and code kept off the command line."""

from __future__ import annotations

import uuid

from execbox.testing.framework import Family, Kit, expect, shown

family = Family()


@family.check("exit codes are data")
def check_exit_codes_are_data(kit: Kit) -> None:
    claim = "exit codes are data"
    ok = kit.run(["true"])
    expect(ok.exit_code == 0, claim, "exit 0 from `true`", shown(ok))
    three = kit.run("exit 3")
    expect((three.exit_code, three.timed_out) == (3, False), claim, "exit 3, not timed out, from `exit 3`",
           shown(three))
    killed = kit.run("kill -9 $$")
    expect(killed.exit_code == 137, claim, "exit 137 (128 + SIGKILL) from `kill -9 $$`", shown(killed))


@family.check("stdout and stderr are kept apart")
def check_stdout_and_stderr_kept_apart(kit: Kit) -> None:
    result = kit.run("echo to-out; echo to-err >&2")
    expect((result.stdout, result.stderr) == ("to-out\n", "to-err\n"), "stdout and stderr are kept apart",
           "stdout 'to-out\\n' and stderr 'to-err\\n'", shown(result))


@family.check("stdin is delivered")
def check_stdin_is_delivered(kit: Kit) -> None:
    small = kit.run(["cat"], stdin=b"hello stdin\n")
    expect(small.stdout == "hello stdin\n", "stdin is delivered", "cat to echo 'hello stdin\\n'", shown(small))
    big = kit.run(["wc", "-c"], stdin=b"x" * 1_000_000)
    expect(big.stdout.strip() == "1000000", "stdin is delivered", "wc -c to count 1000000 bytes", shown(big))


@family.check("output is decoded as UTF-8, invalid bytes replaced")
def check_utf8_and_invalid_bytes(kit: Kit) -> None:
    result = kit.code("import sys\nprint('héllo ✓ 世界')\nsys.stdout.flush()\n"
                      "sys.stdout.buffer.write(b'bad \\xff\\xfe end')")
    want = "héllo ✓ 世界\nbad \ufffd\ufffd end"
    expect(result.stdout == want, "output is decoded as UTF-8", repr(want), shown(result))


@family.check("python and bash code run")
def check_python_and_bash_code(kit: Kit) -> None:
    py = kit.code("print(6 * 7)")
    expect(py.stdout == "42\n", "python code runs", "'42\\n'", shown(py))
    sh = kit.code("echo $((6 * 7))", language="bash")
    expect(sh.stdout == "42\n", "bash code runs", "'42\\n'", shown(sh))


@family.check("code is not on the command line")
def check_code_is_not_on_the_command_line(kit: Kit) -> None:
    claim = "code is not on the command line"
    marker = uuid.uuid4().hex
    result = kit.code(f"# {marker}\nimport os\nprint(open('/proc/self/cmdline','rb').read())")
    # The positive signal: the probe did print its command line (the interpreter is on it).
    expect(result.exit_code == 0 and "python" in result.stdout, claim, "the probe to print its command line",
           shown(result))
    expect(marker not in result.stdout, claim, "the code's text absent from /proc/self/cmdline", result.stdout)
