"""A fake ``apptainer`` / ``singularity`` executable for tests (stdlib only).

Apptainer cannot be installed on these machines, so the singularity backend is
tested against this script. It answers what spython and the backend ask:

- ``--version`` / ``version``
- ``exec [flags] IMAGE CMD...`` (IMAGE may be ``instance://NAME``)
- ``instance start [flags] IMAGE NAME [args]``, ``instance stop [-t N] NAME|--all``,
  ``instance list [--json] [NAME]`` (spython's JSON shape)

Every command line is appended, as one JSON object per line, to the file named
by ``EXECBOX_FAKE_APPTAINER_LOG`` (when set), so tests can assert exact flags.

How ``exec`` runs the command: with bubblewrap when it is usable, as a small
container built from the host's own /usr and /etc (the image is NOT unpacked:
every image runs on the host's userland). It honours ``--bind SRC:DST``
(so the workspace really is at /workspace), ``--pwd``, ``--cleanenv`` plus
``APPTAINERENV_*``/``SINGULARITYENV_*``/``--env``, a private /tmp and PID
namespace for ``--contain``/``--containall``, and ``--net --network none`` as a
fresh network namespace with only loopback. Without bubblewrap it falls back to
running on the host with /workspace paths translated, and refuses
``--network none`` (it cannot enforce it, so it fails closed).

Instances are real: ``instance start`` leaves a detached container whose PID 1 is a small reaping
init (in its own PID namespace for ``--containall``/``--pid``, as with Apptainer's own init), and
``exec instance://NAME`` enters that container's namespaces with ``nsenter``, so a process one exec leaves
behind survives into the next, and an orphan is re-parented to the instance's init, out of the calling
process tree's reach. ``instance stop`` SIGKILLs the init (and with it the whole PID namespace).
``instance list`` reports the init's host pid.

Not emulated: images, overlays, ``--writable``, GPU flags, apptainer.conf (beyond the two switches
below), setuid/user-namespace details, start scripts, and ``instance stop``'s graceful SIGTERM.

Install it with :func:`install`, which writes a tiny wrapper script with the log, state dir and options
baked in (``deny_net=True`` acts like a host whose apptainer.conf forbids ``--network none``;
``deny_pidns=True`` like one with ``allow pid ns = no``, where ``--containall`` silently makes no PID
namespace). Every command line is logged with the binary's own ``APPTAINER_*``/``SINGULARITY_*``
settings (``host_env``), and ``APPTAINER_BIND``/``SINGULARITY_BIND``/``*_BINDPATH`` add binds, as they do
in Apptainer.
"""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

LOG_ENV = "EXECBOX_FAKE_APPTAINER_LOG"
STATE_ENV = "EXECBOX_FAKE_APPTAINER_STATE"
NAME_ENV = "EXECBOX_FAKE_APPTAINER_NAME"
# set to 1 to act like a host whose apptainer.conf does not let this user make a network namespace
DENY_NET_ENV = "EXECBOX_FAKE_APPTAINER_DENY_NET"
# set to 1 to act like a host whose apptainer.conf says `allow pid ns = no`
DENY_PIDNS_ENV = "EXECBOX_FAKE_APPTAINER_DENY_PIDNS"
# seconds `instance start` waits after the instance is up, before it returns (tests of a slow start)
START_DELAY_ENV = "EXECBOX_FAKE_APPTAINER_START_DELAY"
# Host variables Apptainer reads as extra binds (SINGULARITY_* are still honoured by Apptainer).
BIND_VARS = ("APPTAINER_BIND", "APPTAINER_BINDPATH", "SINGULARITY_BIND", "SINGULARITY_BINDPATH")
# PID 1 of an instance with a PID namespace: reaps the orphans re-parented to it, ignores every signal a
# process inside may send (the kernel only lets SIGKILL from outside through). Runs the host's python3.
INSTANCE_INIT = """
import os, signal, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
os.write(1, b"ready\\n")
os.close(1)
while True:
    try:
        os.waitpid(-1, 0)
    except ChildProcessError:
        time.sleep(0.2)
"""
VERSIONS = {"apptainer": "apptainer version 1.3.6-fake", "singularity": "singularity-ce version 4.2.1-fake"}
NS_GET_USERNS = 0xB701  # _IO(0xb7, 0x1), linux/nsfs.h
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# flags that take a value, and boolean flags (long and short spellings)
VALUE_FLAGS = {
    "--bind": "bind", "-B": "bind", "--pwd": "pwd", "--network": "network", "--env": "env",
    "--home": "home", "-H": "home", "--network-args": "network_args", "--env-file": "env_file",
    "--mount": "mount", "--workdir": "workdir", "-W": "workdir", "--security": "security",
}
BOOL_FLAGS = {
    "--containall": "containall", "-C": "containall", "--contain": "contain", "-c": "contain",
    "--cleanenv": "cleanenv", "-e": "cleanenv", "--no-home": "no_home", "--net": "net", "-n": "net",
    "--ipc": "ipc", "-i": "ipc", "--pid": "pid", "-p": "pid", "--no-privs": "no_privs",
    "--writable-tmpfs": "writable_tmpfs", "--no-init": "no_init", "--no-mount": "no_mount",
    "--compat": "compat", "--nv": "nv", "--writable": "writable", "-w": "writable",
}


class FakeError(Exception):
    pass


def program_name() -> str:
    return os.environ.get(NAME_ENV) or Path(sys.argv[0]).name.removesuffix(".py")


def env_prefix() -> str:
    return "SINGULARITYENV_" if program_name() == "singularity" else "APPTAINERENV_"


def state_dir() -> Path:
    path = Path(os.environ.get(STATE_ENV) or Path(tempfile.gettempdir()) / f"execbox-fake-apptainer-{os.getuid()}")
    path.mkdir(parents=True, exist_ok=True)
    return path


def log_invocation(argv: list[str]) -> None:
    path = os.environ.get(LOG_ENV)
    if not path:
        return
    prefixes = ("APPTAINERENV_", "SINGULARITYENV_")
    record = {
        "argv": [program_name(), *argv],
        "env": {k: v for k, v in os.environ.items() if k.startswith(prefixes)},
        # the binary's own settings (cache dirs, binds, ...), which change what every container gets
        "host_env": {k: v for k, v in os.environ.items()
                     if k.startswith(("APPTAINER_", "SINGULARITY_")) and not k.startswith(prefixes)},
        "time": time.time(),
    }
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def fail(message: str, code: int = 255) -> int:
    print(f"FATAL:   {message}", file=sys.stderr)
    return code


def parse_flags(args: list[str]) -> tuple[dict[str, Any], list[str]]:
    """Split leading flags from the positional rest, the way cobra does for exec."""
    opts: dict[str, Any] = {"bind": [], "env": []}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("-") or arg == "-":
            break
        if arg == "--":
            i += 1
            break
        name, eq, value = arg.partition("=")
        if name in VALUE_FLAGS:
            key = VALUE_FLAGS[name]
            if not eq:
                i += 1
                if i >= len(args):
                    raise FakeError(f"flag needs an argument: {name}")
                value = args[i]
            if key in ("bind", "env"):
                opts[key].extend(v for v in value.split(",") if v)
            else:
                opts[key] = value
        elif name in BOOL_FLAGS and not eq:
            opts[BOOL_FLAGS[name]] = True
        else:
            raise FakeError(f"unknown flag: {arg}")
        i += 1
    return opts, args[i:]


Bind = tuple[str, str, bool]  # (host source, container destination, read-only)


def parse_binds(specs: list[str]) -> list[Bind]:
    binds: list[Bind] = []
    from_env = [v for var in BIND_VARS for v in os.environ.get(var, "").split(",") if v]
    for spec in [*from_env, *specs]:
        parts = spec.split(":")
        src = parts[0]
        dst = parts[1] if len(parts) > 1 and parts[1] else src
        readonly = len(parts) > 2 and "ro" in parts[2].split(",")
        if not os.path.exists(src):
            raise FakeError(f"container creation failed: mount {src}->{dst} error: while mounting {src}: "
                            f"mount source {src} doesn't exist")
        binds.append((os.path.realpath(src), dst, readonly))
    return binds


def check_image(image: str) -> None:
    if "://" in image:
        return  # docker://, library://, oras://: a real apptainer would pull; the fake pretends it is cached
    if not os.path.exists(image):
        raise FakeError(f"could not open image {os.path.abspath(image)}: failed to retrieve path for {image}: "
                        f"lstat {os.path.abspath(image)}: no such file or directory")


def container_env(opts: dict[str, Any]) -> dict[str, str]:
    prefix_vars = {}
    for key, value in os.environ.items():
        for prefix in ("APPTAINERENV_", "SINGULARITYENV_"):
            if key.startswith(prefix) and key != prefix:
                prefix_vars[key[len(prefix):]] = value
    env = {"PATH": DEFAULT_PATH} if opts.get("cleanenv") else dict(os.environ)
    for key in [k for k in env if k.startswith(("APPTAINERENV_", "SINGULARITYENV_", "EXECBOX_FAKE_"))]:
        del env[key]
    env.setdefault("PATH", DEFAULT_PATH)
    env["HOME"] = "/root" if os.getuid() == 0 else f"/home/{os.environ.get('USER', 'user')}"
    env.update(prefix_vars)
    for item in opts["env"]:
        key, _, value = item.partition("=")
        env[key] = value
    return env


def bwrap_usable() -> bool:
    if shutil.which("bwrap") is None:
        return False
    probe = subprocess.run(["bwrap", "--ro-bind", "/", "/", "--unshare-pid", "--unshare-net", "true"],
                           capture_output=True)
    return probe.returncode == 0


def wants_pidns(opts: dict[str, Any]) -> bool:
    return bool(opts.get("containall") or opts.get("pid")) and os.environ.get(DENY_PIDNS_ENV) != "1"


def bwrap_argv(opts: dict[str, Any], binds: list[Bind], cmd: list[str], env: dict[str, str], *,
               instance: bool = False) -> list[str]:
    # an instance outlives the command that started it; a plain exec dies with its caller
    argv = ["bwrap", "--new-session"] if instance else ["bwrap", "--die-with-parent", "--new-session"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr", "etc"):
        host = Path("/") / name
        if host.is_symlink():
            argv += ["--symlink", os.readlink(host), str(host)]
        elif host.is_dir():
            argv += ["--ro-bind", str(host), str(host)]
    argv += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--tmpfs", "/var/tmp"]
    contained = opts.get("containall") or opts.get("contain")
    if wants_pidns(opts):
        argv.append("--unshare-pid")
        if instance:
            argv.append("--as-pid-1")  # INSTANCE_INIT is PID 1, like Apptainer's own instance init
    if opts.get("containall") or opts.get("ipc"):
        argv.append("--unshare-ipc")
    if opts.get("net") and opts.get("network", "bridge") == "none":
        argv.append("--unshare-net")
    for src, dst, readonly in binds:
        argv += ["--ro-bind" if readonly else "--bind", src, dst]
    if not contained and not opts.get("no_home") and os.path.isdir(env["HOME"]):
        argv += ["--bind", env["HOME"], env["HOME"]]
    argv += ["--chdir", opts.get("pwd") or ("/" if contained else os.getcwd()), "--clearenv"]
    for key, value in env.items():
        argv += ["--setenv", key, value]
    return argv + ["--", *cmd]


def translate(path: str, binds: list[Bind]) -> str:
    for src, dst, _ in binds:
        if path == dst or path.startswith(dst.rstrip("/") + "/"):
            return src + path[len(dst.rstrip("/")):]
    return path


def network_refused(opts: dict[str, Any]) -> str | None:
    if opts.get("net") and opts.get("network", "bridge") != "none":
        return "the fake supports only --net --network none"
    if opts.get("net") and os.environ.get(DENY_NET_ENV) == "1":
        return "container creation failed: network none is not permitted for this user by apptainer.conf"
    return None


def run_in_container(opts: dict[str, Any], image: str, cmd: list[str]) -> int:
    if not cmd:
        return fail("no command given to exec", 255)
    binds = parse_binds(opts["bind"])
    env = container_env(opts)
    wants_no_net = bool(opts.get("net")) and opts.get("network", "bridge") == "none"
    refused = network_refused(opts)
    if refused:
        return fail(refused, 255)
    if bwrap_usable():
        argv = bwrap_argv(opts, binds, cmd, env)
        sys.stdout.flush()
        os.execvp(argv[0], argv)
    if wants_no_net:
        return fail("--network none needs a network namespace, which is not available here", 255)
    # host fallback: no namespaces; map bound paths in the argv and the working dir
    cwd = translate(opts.get("pwd") or os.getcwd(), binds)
    argv = [translate(a, binds) for a in cmd]
    try:
        os.chdir(cwd)
    except OSError as exc:
        return fail(f"could not set working directory {opts.get('pwd')}: {exc}", 255)
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as exc:
        return fail(f"{argv[0]}: {exc.strerror}", 255)
    return 255  # not reached


# instances: one JSON record per name in the state dir

def instance_file(name: str) -> Path:
    if not name or "/" in name or name.startswith("."):
        raise FakeError(f"invalid instance name {name!r}")
    return state_dir() / f"{name}.json"


def load_instance(name: str) -> dict[str, Any]:
    path = instance_file(name)
    if not path.exists():
        raise FakeError(f"no instance found with name {name}")
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def start_time(pid: int) -> str | None:
    """A live process's start time (clock ticks since boot), which with the pid names one process for good;
    None when it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rpartition(b")")[2].split()
    except OSError:
        return None
    return None if len(fields) < 20 or fields[0] == b"Z" else fields[19].decode()


def instance_running(data: dict[str, Any]) -> bool:
    return bool(data.get("init_start")) and start_time(data["pid"]) == data["init_start"]


def launch_instance(opts: dict[str, Any], data: dict[str, Any]) -> None:
    """Start the instance's container, detached, with INSTANCE_INIT as its command; record its init."""
    binds = parse_binds(opts["bind"])
    init_opts = {**opts, "pwd": opts.get("pwd") or "/"}  # the init's own cwd: execs choose theirs
    argv = bwrap_argv(init_opts, binds, ["python3", "-I", "-S", "-c", INSTANCE_INIT], container_env(opts),
                      instance=True)
    info_r, info_w = os.pipe()
    argv[1:1] = ["--info-fd", str(info_w)]
    with open(data["log_err"], "ab") as err:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err,
                                pass_fds=(info_w,), start_new_session=True)
    os.close(info_w)
    assert proc.stdout is not None
    ready = proc.stdout.readline()
    proc.stdout.close()
    info = b""
    while ready and b"}" not in info and (chunk := os.read(info_r, 4096)):
        info += chunk
    os.close(info_r)
    if ready != b"ready\n":
        proc.kill()
        proc.wait()
        raise FakeError(f"instance start failed: {Path(data['log_err']).read_text().strip()[-400:]}")
    data["pid"] = json.loads(info)["child-pid"]  # the host pid of the container's first process: its init
    data["init_start"] = start_time(data["pid"])


def owner_userns(ns_path: str) -> int:
    """An fd of the user namespace that owns the namespace at ``ns_path`` (ioctl NS_GET_USERNS)."""
    fd = os.open(ns_path, os.O_RDONLY)
    try:
        return fcntl.ioctl(fd, NS_GET_USERNS)
    finally:
        os.close(fd)


def enter_instance(data: dict[str, Any], opts: dict[str, Any], cmd: list[str]) -> int:
    """exec in a running instance: join each namespace its init does not share with us, run ``cmd`` there."""
    if not instance_running(data):
        return fail(f"instance {data['name']} is not running", 255)
    if not cmd:
        return fail("no command given to exec", 255)
    pid = data["pid"]
    argv = ["nsenter", f"--target={pid}"]
    # Without root, bwrap's namespaces belong to a user namespace it made (the init sits in a nested one):
    # join that owner, which lets us join the rest, keeping our own uid.
    owner = owner_userns(f"/proc/{pid}/ns/mnt")
    if os.fstat(owner).st_ino != os.stat("/proc/self/ns/user").st_ino:
        os.set_inheritable(owner, True)
        argv += [f"--user=/proc/self/fd/{owner}", "--preserve-credentials"]
    for ns, flag in (("mnt", "--mount"), ("uts", "--uts"), ("ipc", "--ipc"), ("net", "--net"), ("pid", "--pid")):
        if os.readlink(f"/proc/{pid}/ns/{ns}") != os.readlink(f"/proc/self/ns/{ns}"):
            argv.append(flag)
    env = container_env(opts)
    pwd = opts.get("pwd") or "/"
    argv += ["--root", "--", "/usr/bin/env", "-i", f"--chdir={pwd}", *(f"{k}={v}" for k, v in env.items()), *cmd]
    sys.stdout.flush()
    os.execvp(argv[0], argv)
    return 255  # not reached


def stop_instance(data: dict[str, Any]) -> None:
    """SIGKILL the instance's init (in a PID namespace, the kernel then kills everything in it) and wait."""
    if not instance_running(data):
        return
    os.kill(data["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while instance_running(data) and time.monotonic() < deadline:
        time.sleep(0.02)


def stop_all(state: str | os.PathLike[str]) -> list[str]:
    """Stop every instance recorded in ``state`` (a test's clean-up: the fake's instances outlive tests)."""
    stopped = []
    for path in sorted(Path(state).glob("*.json")):
        data = json.loads(path.read_text())
        stop_instance(data)
        path.unlink(missing_ok=True)
        stopped.append(data["name"])
    return stopped


def instance_record(data: dict[str, Any]) -> dict[str, Any]:
    return {"instance": data["name"], "pid": data["pid"], "img": data["image"], "ip": "",
            "logErrPath": data["log_err"], "logOutPath": data["log_out"]}


def cmd_instance(args: list[str]) -> int:
    if not args:
        return fail("instance: missing subcommand (start, stop, list)")
    sub, rest = args[0], args[1:]
    if sub == "start":
        opts, pos = parse_flags(rest)
        if len(pos) < 2:
            return fail("instance start needs IMAGE and NAME")
        image, name = pos[0], pos[1]
        check_image(image)
        parse_binds(opts["bind"])  # fail now, like apptainer, when a bind source is missing
        path = instance_file(name)
        if path.exists():
            return fail(f"instance {name} already exists")
        logs = state_dir() / "logs"
        logs.mkdir(exist_ok=True)
        refused = network_refused(opts)
        if refused:
            return fail(refused)
        data: dict[str, Any] = {"name": name, "image": os.path.abspath(image) if "://" not in image else image,
                "opts": opts, "args": pos[2:], "pid": os.getpid(),
                "log_err": str(logs / f"{name}.err"), "log_out": str(logs / f"{name}.out")}
        Path(data["log_err"]).touch()
        Path(data["log_out"]).touch()
        if bwrap_usable():
            launch_instance(opts, data)
        # without bubblewrap the instance is only a record, and its execs run as one-shot containers
        path.write_text(json.dumps(data))
        time.sleep(float(os.environ.get(START_DELAY_ENV) or 0))  # a slow start (a test's knob)
        print("INFO:    instance started successfully", file=sys.stderr)
        return 0
    if sub == "stop":
        names, stop_all, i = [], False, 0
        while i < len(rest):
            if rest[i] in ("-a", "--all"):
                stop_all = True
            elif rest[i] in ("-t", "--timeout", "-s", "--signal"):
                i += 1
            elif rest[i] in ("-F", "--force"):
                pass
            elif rest[i].startswith("-"):
                return fail(f"unknown flag: {rest[i]}")
            else:
                names.append(rest[i])
            i += 1
        if stop_all:
            names = [p.stem for p in state_dir().glob("*.json")]
        if not names:
            return fail("instance stop needs a NAME or --all")
        code = 0
        for name in names:
            try:
                data = load_instance(name)
                stop_instance(data)
                instance_file(name).unlink()
                print(f"INFO:    Stopping {name} instance of fake (PID={data['pid']})", file=sys.stderr)
            except (FileNotFoundError, FakeError):
                code = fail(f"no instance found with name {name}")
        return code
    if sub == "list":
        as_json = "--json" in rest or "-j" in rest
        names = [a for a in rest if not a.startswith("-")]
        records = []
        for path in sorted(state_dir().glob("*.json")):
            data = json.loads(path.read_text())
            if not names or data["name"] in names:
                records.append(instance_record(data))
        if as_json:
            print(json.dumps({"instances": records}, indent=4))
        else:
            print(f"{'INSTANCE NAME':<16}{'PID':<8}{'IP':<8}IMAGE")
            for rec in records:
                print(f"{rec['instance']:<16}{rec['pid']:<8}{'':<8}{rec['img']}")
        return 0
    return fail(f"unknown instance subcommand {sub}")


def cmd_exec(args: list[str]) -> int:
    opts, pos = parse_flags(args)
    if not pos:
        return fail("exec needs an IMAGE and a command")
    image, cmd = pos[0], pos[1:]
    if image.startswith("instance://"):
        data = load_instance(image.removeprefix("instance://"))
        merged = dict(data["opts"])
        for key, value in opts.items():
            if key in ("bind", "env"):
                merged[key] = list(merged.get(key, [])) + value
            else:
                merged[key] = value
        if data.get("init_start"):
            return enter_instance(data, merged, cmd)
        opts = merged
    else:
        check_image(image)
    return run_in_container(opts, image, cmd)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    log_invocation(args)
    # global flags come before the subcommand
    while args and args[0] in ("--quiet", "-q", "--debug", "-d", "--silent", "-s", "--verbose", "-v"):
        args.pop(0)
    if not args:
        return fail("no command given")
    try:
        if args[0] in ("--version", "version"):
            print(VERSIONS.get(program_name(), VERSIONS["apptainer"]))
            return 0
        if args[0] == "exec":
            return cmd_exec(args[1:])
        if args[0] == "instance":
            return cmd_instance(args[1:])
        return fail(f"the fake does not implement {args[0]!r}")
    except FakeError as exc:
        return fail(str(exc))


def install(bin_dir: str | os.PathLike[str], name: str = "apptainer", log_file: str | os.PathLike[str] | None = None,
            state: str | os.PathLike[str] | None = None, python: str | None = None, deny_net: bool = False,
            deny_pidns: bool = False, start_delay: float = 0) -> Path:
    """Write an executable ``name`` into ``bin_dir`` that runs this fake; returns its path.

    The settings are baked into the script, because the backend runs the binary with a minimal environment.
    """
    bin_dir = Path(bin_dir)
    bin_dir.mkdir(parents=True, exist_ok=True)
    exports = [f"export {NAME_ENV}={shlex.quote(name)}"]
    if log_file is not None:
        exports.append(f"export {LOG_ENV}={shlex.quote(os.fspath(log_file))}")
    if state is not None:
        exports.append(f"export {STATE_ENV}={shlex.quote(os.fspath(state))}")
    if deny_net:
        exports.append(f"export {DENY_NET_ENV}=1")
    if deny_pidns:
        exports.append(f"export {DENY_PIDNS_ENV}=1")
    if start_delay:
        exports.append(f"export {START_DELAY_ENV}={start_delay:g}")
    run = f"exec {shlex.quote(python or sys.executable)} -I {shlex.quote(str(Path(__file__).resolve()))} \"$@\""
    script = bin_dir / name
    script.write_text("#!/bin/sh\n" + "\n".join([*exports, run]) + "\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return script


if __name__ == "__main__":
    sys.exit(main())
