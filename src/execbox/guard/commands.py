"""The command review: destructive shapes an agent's command may take, recognised before it runs.

A checkpoint, not a sandbox. The sandbox is what contains a command; this review only makes a person look
at the commands that are hard to take back before they run (the MCP server asks through elicitation). It
reads the command as a shell would split it — separators, pipes, redirections, ``$(...)`` and backticks,
``sh -c``/``eval`` strings, wrappers such as ``sudo``, ``env``, ``xargs``, ``timeout`` — and Python code's
literal ``os.system``/``subprocess``/``shutil.rmtree`` calls. Code that builds its command at run time, an
interpreter reading a script file, an alias: the review cannot see those, and does not pretend to.

The built-in rules (each answers ``ask``; ``CODE_EXEC_REVIEW_OFF`` switches rules off by name):

    recursive-delete        rm -r / find -delete / find -exec rm / shred outside the workspace (a target that
                            is absolute, ``~``, ``..`` out of it, a variable, or relative after a cd out of it;
                            /tmp/... counts as inside a sandbox's own /tmp, not at posture 3)
    recursive-permissions   chmod / chown / chgrp -R outside the workspace
    git-push                git push (any remote, any options)
    publish-package         twine upload, npm / pnpm / yarn / bun publish or unpublish, cargo publish / yank,
                            gem push, poetry / flit / hatch / uv / pdm publish, setup.py upload,
                            docker / podman push, mvn deploy, gradle publish
    pipe-to-shell           a download (curl, wget) piped into an interpreter (sh, bash, python, perl, node...),
                            or fed to one through <(...), $(...) or eval
    device-write            a write to a block or memory device: > /dev/sda, dd of=/dev/..., tee /dev/nvme0n1
    disk-format             mkfs*, mke2fs, mkswap, wipefs, fdisk, sfdisk, parted, sgdisk, blkdiscard,
                            cryptsetup luksFormat
    power                   shutdown, reboot, halt, poweroff, init 0/6, systemctl poweroff/reboot/halt
    kill-all                kill -1 (every process the user may signal), killall5
    too-long-to-review      a command line or script over 256 KiB, Python code over 1 MiB, or substitutions and
                            inline scripts nested past what one review reads (512 KiB in all): every search has
                            bounded gaps and every pass is linear, so no input makes a review slow

Operators add rules with ``CODE_EXEC_REVIEW_RULES``: a file with one rule a line, ``ask REGEX`` or
``deny REGEX`` (Python regular expression, searched in the command line or the code as given; ``#`` starts a
comment line). Plugins add policy through the ``execbox_review_command`` hook.
"""

from __future__ import annotations

import ast
import functools
import posixpath
import re
import shlex
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from execbox.config.settings import Settings
from execbox.contract.review import ReviewAction, ReviewDecision, ReviewRequest
from execbox.errors import ConfigError

MAX_REVIEW_BYTES = 256 << 10  # a command line or a shell script; longer ones are asked about unread
MAX_PYTHON_BYTES = 1 << 20
#: Characters of shell text one review may read in all (substitutions and sh -c strings are read again inside
#: their command): nesting cannot make a review cost more than this, whatever the input.
REVIEW_BUDGET = 512 << 10
MAX_DEPTH = 4  # sh -c "sh -c '...'" nesting followed this deep
RULES: dict[str, str] = {
    "recursive-delete": "deletes recursively outside the workspace",
    "recursive-permissions": "changes permissions or owners recursively outside the workspace",
    "git-push": "pushes to a git remote",
    "publish-package": "publishes a package or an image",
    "pipe-to-shell": "runs a script downloaded from the network",
    "device-write": "writes to a device",
    "disk-format": "formats or partitions a disk",
    "power": "shuts down or restarts the machine",
    "kill-all": "signals every process it may",
    "too-long-to-review": "is too long to review",
}

SEPARATORS = frozenset({";", "&&", "||", "&", "\n", "(", ")", ";;", "|&"})
REDIRECTS = frozenset({">", ">>", ">|", "&>", "&>>", "<>"})
SHELLS = frozenset({"sh", "bash", "zsh", "dash", "ksh", "mksh", "fish", "ash", "busybox"})
INTERPRETERS = SHELLS | frozenset({"python", "python2", "python3", "perl", "ruby", "node", "nodejs", "php", "deno",
                                   "bun", "pwsh"})
DOWNLOADERS = frozenset({"curl", "wget", "fetch", "aria2c", "http", "https"})
# Wrapper -> how many arguments its options take before the wrapped command (unknown options take none).
WRAPPERS = frozenset({"sudo", "doas", "env", "nohup", "nice", "ionice", "time", "timeout", "stdbuf", "exec",
                      "command", "builtin", "xargs", "chronic", "setsid", "flock", "chroot", "unbuffer", "watch"})
WRAPPER_OPTION_ARGS = {
    "sudo": {"-u", "-g", "-h", "-p", "-C", "-U", "-r", "-t", "-D", "-R", "--user", "--group"},
    "doas": {"-u", "-C"},
    "env": {"-u", "-C", "-S", "--unset", "--chdir"},
    "nice": {"-n", "--adjustment"},
    "ionice": {"-c", "-n", "-p", "-P", "-u"},
    "timeout": {"-s", "-k", "--signal", "--kill-after"},
    "stdbuf": {"-i", "-o", "-e"},
    "xargs": {"-I", "-i", "-n", "-P", "-s", "-L", "-l", "-a", "-d", "-E", "-e", "--max-args", "--max-procs",
              "--delimiter", "--arg-file", "--replace"},
    "flock": {"-w", "-E", "-c"},
    "watch": {"-n", "-d", "--interval"},
}
DEVICE = re.compile(r"^/dev/(?:sd|hd|vd|xvd|nvme|mmcblk|loop|md|dm-|mapper/|disk/|sr|fd[0-9]|nbd|rbd|zd|mem$|kmem$|"
                    r"port$)")
HARMLESS_DEVICES = frozenset({"/dev/null", "/dev/zero", "/dev/stdout", "/dev/stderr", "/dev/stdin", "/dev/tty",
                              "/dev/full", "/dev/random", "/dev/urandom"})
FORMATTERS = frozenset({"mkfs", "mke2fs", "mkswap", "wipefs", "fdisk", "sfdisk", "cfdisk", "parted", "sgdisk", "gdisk",
                        "blkdiscard", "mkdosfs", "mkntfs", "mkexfatfs"})
POWER = frozenset({"shutdown", "reboot", "halt", "poweroff"})
PUBLISH: dict[str, frozenset[str]] = {
    "twine": frozenset({"upload", "register"}),
    "npm": frozenset({"publish", "unpublish"}), "pnpm": frozenset({"publish"}), "yarn": frozenset({"publish", "npm"}),
    "bun": frozenset({"publish"}),
    "cargo": frozenset({"publish", "yank"}), "gem": frozenset({"push", "yank"}),
    "poetry": frozenset({"publish"}), "flit": frozenset({"publish"}), "hatch": frozenset({"publish"}),
    "uv": frozenset({"publish"}), "pdm": frozenset({"publish"}),
    "docker": frozenset({"push"}), "podman": frozenset({"push"}), "buildah": frozenset({"push"}),
    "mvn": frozenset({"deploy"}), "gradle": frozenset({"publish"}), "gradlew": frozenset({"publish"}),
}
# Every gap is bounded, so a search costs at most (bound x length), never (length squared), whatever the input.
PIPE_TO_SHELL = re.compile(
    r"(?:\b(?:ba|z|da|k|fi)?sh|\beval|\bsource|\bpython[0-9.]*|\bperl|\bruby|\bnode)\b[^|;&\n]{0,128}?"
    r"(?:<\(|\$\(|`)\s{0,16}(?:sudo\s{1,16})?(?:curl|wget)\b")
DOWNLOAD_PIPE = re.compile(r"\b(?:curl|wget)\b[^;\n]{0,256}?\|\s{0,16}(?:sudo\s{1,16}(?:-\S{1,32}\s{1,16}){0,8})?"
                           r"(?:env\s{1,16})?(?:(?:ba|z|da|k|fi)?sh|python[0-9.]*|perl|ruby|node)\b")
GIT_OPTION_ARGS = frozenset({"-C", "-c", "--git-dir", "--work-tree", "--namespace", "--exec-path", "--config-env"})


@dataclass
class _Walk:
    """What one review has found so far, and where the shell is."""

    workspace: str
    host: bool  # posture 3: the command runs on the host, /tmp is everyone's
    off: frozenset[str]
    findings: dict[str, str] = field(default_factory=dict)  # rule -> the first reason found
    cwd: str | None = None  # None: somewhere unknown (after `cd $X`, `cd -`)
    budget: int = REVIEW_BUDGET

    def __post_init__(self) -> None:
        self.cwd = self.workspace

    def hit(self, rule: str, detail: str) -> None:
        if rule not in self.off and rule not in self.findings:
            self.findings[rule] = f"{RULES[rule]}: {detail}"

    def outside(self, target: str) -> bool:
        """Could this path (as written in the command) be outside the workspace?"""
        if not target or "$" in target or target.startswith("~") or "`" in target:
            return True
        if target.startswith("/"):
            full = target
        elif self.cwd is None:
            return True
        else:
            full = posixpath.join(self.cwd, target)
        full = posixpath.normpath(full)
        if not self.host and full.startswith("/tmp/") and full != "/tmp/":
            return False  # the sandbox's own /tmp
        return not (full == self.workspace or full.startswith(self.workspace.rstrip("/") + "/"))


def rules_off(settings: Settings) -> frozenset[str]:
    """CODE_EXEC_REVIEW_OFF, checked: a misspelt name must not leave on a rule the operator believes is off."""
    unknown = sorted(set(settings.review_off) - set(RULES))
    if unknown:
        raise ConfigError(f"CODE_EXEC_REVIEW_OFF names no rule {', '.join(map(repr, unknown))}; the rules are: "
                          f"{', '.join(sorted(RULES))}", env_var="CODE_EXEC_REVIEW_OFF")
    return frozenset(settings.review_off)


def review(request: ReviewRequest, settings: Settings) -> list[ReviewDecision]:
    """execbox's own rules and the operator's rules file, applied to one request: every decision that is not
    allow (an empty list: nothing to ask about)."""
    off = rules_off(settings)
    walk = _Walk(request.workspace, request.posture == 3, off)
    cap = MAX_PYTHON_BYTES if request.kind == "python" else MAX_REVIEW_BYTES
    if len(request.text) > cap or len(request.text.encode(errors="replace")) > cap:
        walk.hit("too-long-to-review", f"{len(request.text)} characters (more than {cap} bytes)")
    elif request.kind == "python":
        _python(request.text, walk)
    elif request.kind == "argv" and request.argv is not None:
        _simple([request.argv], walk, depth=0)
    else:
        _shell(request.text, walk, depth=0)
    decisions = [ReviewDecision(action="ask", reason=reason, rule=rule) for rule, reason in walk.findings.items()]
    if settings.review_rules is not None:
        text = request.text[:MAX_PYTHON_BYTES]
        for number, action, pattern in operator_rules(str(settings.review_rules)):
            if pattern.search(text):
                decisions.append(ReviewDecision(
                    action=action, rule=f"rules-file:{number}", source="rules-file",
                    reason=f"matches the operator's rule {pattern.pattern!r} (CODE_EXEC_REVIEW_RULES line {number})"))
    return decisions


def operator_rules(path: str) -> list[tuple[int, ReviewAction, re.Pattern[str]]]:
    """The rules of a CODE_EXEC_REVIEW_RULES file (re-read when it changes)."""
    try:
        stat = Path(path).stat()
    except OSError as exc:
        raise ConfigError(f"CODE_EXEC_REVIEW_RULES names {path!r}, which cannot be read ({exc.strerror}). Fix the "
                          "path or unset the variable", env_var="CODE_EXEC_REVIEW_RULES") from None
    return _parse_rules(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=8)
def _parse_rules(path: str, mtime_ns: int, size: int) -> list[tuple[int, ReviewAction, re.Pattern[str]]]:
    if size > MAX_REVIEW_BYTES:
        raise ConfigError(f"CODE_EXEC_REVIEW_RULES file {path!r} is over {MAX_REVIEW_BYTES} bytes",
                          env_var="CODE_EXEC_REVIEW_RULES")
    rules: list[tuple[int, ReviewAction, re.Pattern[str]]] = []
    for number, line in enumerate(Path(path).read_text(errors="replace").splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        action, _, pattern = line.partition(" ")
        if action not in ("ask", "deny") or not pattern.strip():
            raise ConfigError(f"CODE_EXEC_REVIEW_RULES {path}:{number}: {line[:80]!r} is not `ask REGEX` or "
                              "`deny REGEX`", env_var="CODE_EXEC_REVIEW_RULES")
        try:
            compiled = re.compile(pattern.strip())
        except re.error as exc:
            raise ConfigError(f"CODE_EXEC_REVIEW_RULES {path}:{number}: invalid regular expression: {exc}",
                              env_var="CODE_EXEC_REVIEW_RULES") from None
        rules.append((number, "ask" if action == "ask" else "deny", compiled))
    return rules


# --- shell --------------------------------------------------------------------------------------------------------


def _tokens(text: str) -> list[str]:
    lexer = shlex.shlex(text.replace("`", "\n"), posix=True, punctuation_chars="();<>|&\n")
    lexer.whitespace = " \t\r"
    lexer.whitespace_split = True
    lexer.commenters = ""
    try:
        return list(lexer)
    except ValueError:  # an unbalanced quote: split crudely rather than not at all
        return re.findall(r"[;&|()<>\n]+|[^\s;&|()<>]+", text.replace("`", "\n"))


def _substitutions(text: str) -> Iterator[str]:
    """The insides of every $(...), <(...), >(...) and `...` in the text, at any nesting, quoted or not (in single
    quotes they are literal, but reading one more command than runs costs a question at most). One pass."""
    opened: list[tuple[int, bool]] = []
    for i, char in enumerate(text):
        if char == "(":
            opened.append((i + 1, i > 0 and text[i - 1] in "$<>"))
        elif char == ")" and opened:
            start, substitution = opened.pop()
            if substitution:
                yield text[start:i]
    for match in re.finditer(r"`([^`]*)`", text):
        yield match.group(1)


def _shell(text: str, walk: _Walk, depth: int, substitutions: bool = True) -> None:
    walk.budget -= len(text)
    if walk.budget < 0:
        walk.hit("too-long-to-review", "its substitutions and inline scripts nest too much to read them all")
        return
    if depth > MAX_DEPTH:
        return
    for pattern in (PIPE_TO_SHELL, DOWNLOAD_PIPE):
        found = pattern.search(text)
        if found:
            walk.hit("pipe-to-shell", found.group(0)[:200])
    tokens = _tokens(text)
    pipelines: list[list[list[str]]] = [[[]]]
    redirect: str | None = None  # the token before was a redirection: "out" (> file) or "in" (< file)
    for token in tokens:
        if redirect is not None:
            if redirect == "out":
                _redirect_target(token, walk)
            redirect = None
            continue
        if token in REDIRECTS or (token.endswith(">") and token.strip("0123456789&") in (">", ">>")):
            redirect = "out"
        elif token in ("<", "<<", "<<<"):
            redirect = "in"
        elif token == "|":
            pipelines[-1].append([])
        elif token in SEPARATORS or set(token) <= set(";&|()\n"):
            pipelines.append([[]])
        else:
            pipelines[-1][-1].append(token)
    for pipeline in pipelines:
        stages = [stage for stage in pipeline if stage]
        _simple(stages, walk, depth)
        names = [_command(stage)[0] for stage in stages]
        for i, name in enumerate(names):
            if name in DOWNLOADERS and any(later in INTERPRETERS for later in names[i + 1:]):
                walk.hit("pipe-to-shell", " | ".join(" ".join(stage) for stage in stages)[:200])
    if substitutions:  # one pass found them all, nested ones included: their own reviews need not look again
        for inner in _substitutions(text):
            _shell(inner, walk, depth + 1, substitutions=False)
            if walk.budget < 0:
                return


def _redirect_target(target: str, walk: _Walk) -> None:
    if DEVICE.match(target) and target not in HARMLESS_DEVICES:
        walk.hit("device-write", f"> {target}")


def _command(words: Sequence[str]) -> tuple[str, list[str]]:
    """The command's name (without a path) and its arguments, wrappers (sudo, env, xargs, timeout...) and
    leading VAR=value assignments skipped."""
    i = 0
    while i < len(words):
        word = words[i]
        if re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", word):
            i += 1
            continue
        name = posixpath.basename(word)
        if name not in WRAPPERS:
            # xargs appends operands nobody can see here: an unknown target, like a variable
            return name, [*words[i + 1:], *(["$xargs"] if "xargs" in words[:i] else [])]
        i += 1
        takes = WRAPPER_OPTION_ARGS.get(name, set())
        while i < len(words) and words[i].startswith("-") and words[i] != "-":
            i += 2 if words[i] in takes else 1
        if name == "timeout" and i < len(words):
            i += 1  # the duration
        if name in ("chroot", "flock") and i < len(words):
            i += 1  # the new root / the lock file
    return "", []


def _simple(stages: Iterable[Sequence[str]], walk: _Walk, depth: int) -> None:
    for words in stages:
        name, args = _command(words)
        if not name:
            continue
        if name.startswith("mkfs.") or name in FORMATTERS:
            walk.hit("disk-format", " ".join([name, *args])[:200])
        elif name == "cryptsetup" and any(a in ("luksFormat", "erase", "luksErase") for a in args):
            walk.hit("disk-format", " ".join([name, *args])[:200])
        _rules_for(name, args, walk, depth)


def _rules_for(name: str, args: list[str], walk: _Walk, depth: int) -> None:
    line = " ".join([name, *args])[:200]
    if name in ("cd", "pushd"):
        target = _operands(args)[0] if _operands(args) else "~"
        if target == "-" or "$" in target or "`" in target or target.startswith("~"):
            walk.cwd = None
        elif target.startswith("/"):
            walk.cwd = posixpath.normpath(target)
        elif walk.cwd is not None:
            walk.cwd = posixpath.normpath(posixpath.join(walk.cwd, target))
    elif name in ("rm", "shred", "srm", "unlink"):
        recursive = name != "rm" or _has_flag(args, "rR", "--recursive")
        targets = _operands(args)
        if recursive and (not targets or any(walk.outside(t) for t in targets)) and name != "unlink":
            walk.hit("recursive-delete", line)
    elif name == "find":
        starts = []
        for arg in args:
            if arg.startswith(("-", "(", "!")) or arg in ("(", "!"):
                break
            starts.append(arg)
        deleting = "-delete" in args or any(
            a in ("-exec", "-execdir", "-ok", "-okdir") and i + 1 < len(args)
            and posixpath.basename(args[i + 1]) in ("rm", "shred") for i, a in enumerate(args))
        if deleting and any(walk.outside(s) for s in (starts or ["."])):
            walk.hit("recursive-delete", line)
    elif name in ("chmod", "chown", "chgrp"):
        if _has_flag(args, "R", "--recursive"):
            operands = _operands(args)[1:]  # the mode or owner first
            if not operands or any(walk.outside(t) for t in operands):
                walk.hit("recursive-permissions", line)
    elif name == "git":
        if _git_subcommand(args) == "push":
            walk.hit("git-push", line)
    elif name in PUBLISH and any(a in PUBLISH[name] for a in args[:3]):
        walk.hit("publish-package", line)
    elif name.startswith("python") and "-m" in args:
        after = args[args.index("-m") + 1:]
        if after and after[0] in PUBLISH:  # python -m twine upload, python -m poetry publish
            _rules_for(after[0], after[1:], walk, depth)
    elif name.startswith("python") and args[:1] == ["setup.py"] and any(a in ("upload", "register") for a in args):
        walk.hit("publish-package", line)
    elif name == "dd":
        for arg in args:
            if arg.startswith("of=/dev/") and arg[3:] not in HARMLESS_DEVICES:
                walk.hit("device-write", line)
    elif name in ("tee", "cp", "cat", "install", "mv", "ln"):
        for arg in _operands(args):
            _redirect_target(arg, walk)
    elif name in POWER or (name in ("init", "telinit") and args[:1] in (["0"], ["6"])):
        walk.hit("power", line)
    elif name == "systemctl" and any(a in ("poweroff", "reboot", "halt", "kexec") for a in args):
        walk.hit("power", line)
    elif name == "kill" and "-1" in (args[1:] if args[:1] != ["-1"] else args):
        walk.hit("kill-all", line)  # `kill -1` alone is SIGHUP to no pid; `kill -9 -1`, `kill -- -1` hit them all
    elif name == "killall5":
        walk.hit("kill-all", line)
    if name in SHELLS or name in ("eval", "su", "runuser"):
        script = _inline_script(name, args)
        if script is not None:
            _shell(script, walk, depth + 1)


def _inline_script(name: str, args: list[str]) -> str | None:
    """The script an `sh -c '...'`, `su -c '...'` or `eval ...` runs."""
    if name == "eval":
        return " ".join(args)
    for i, arg in enumerate(args):
        if arg == "-c" or (arg.startswith("-") and not arg.startswith("--") and arg.endswith("c") and name in SHELLS):
            return args[i + 1] if i + 1 < len(args) else None
        if arg.startswith("--command="):
            return arg.split("=", 1)[1]
    return None


def _has_flag(args: list[str], letters: str, long: str) -> bool:
    for arg in args:
        if arg == "--":
            return False
        if arg == long or (arg.startswith("-") and not arg.startswith("--") and any(c in arg[1:] for c in letters)):
            return True
    return False


def _operands(args: list[str]) -> list[str]:
    operands, options_done = [], False
    for arg in args:
        if arg == "--" and not options_done:
            options_done = True
        elif options_done or not arg.startswith("-") or arg == "-":
            operands.append(arg)
    return operands


def _git_subcommand(args: list[str]) -> str:
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in GIT_OPTION_ARGS:
            i += 2
        elif arg.startswith("-"):
            i += 1
        else:
            return arg
    return ""


# --- python -------------------------------------------------------------------------------------------------------

SHELL_CALLS = frozenset({"os.system", "os.popen", "subprocess.getoutput", "subprocess.getstatusoutput",
                         "commands.getoutput"})
PROCESS_CALLS = frozenset({"subprocess.run", "subprocess.call", "subprocess.check_call", "subprocess.check_output",
                           "subprocess.Popen", "asyncio.create_subprocess_shell", "asyncio.create_subprocess_exec"})


def _python(code: str, walk: _Walk) -> None:
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return  # it will not run either
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                aliases[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        name = _dotted(node.func, aliases)
        first = node.args[0]
        if name in SHELL_CALLS or name == "asyncio.create_subprocess_shell":
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                _shell(first.value, walk, depth=1)
        elif name in PROCESS_CALLS:
            shell = any(k.arg == "shell" and isinstance(k.value, ast.Constant) and k.value.value for k in node.keywords)
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                _shell(first.value, walk, depth=1) if shell else _simple([shlex.split(first.value)], walk, 1)
            elif isinstance(first, (ast.List, ast.Tuple)) and all(
                    isinstance(e, ast.Constant) and isinstance(e.value, str) for e in first.elts):
                _simple([[str(e.value) for e in first.elts if isinstance(e, ast.Constant)]], walk, depth=1)
            elif name == "asyncio.create_subprocess_exec" and all(
                    isinstance(a, ast.Constant) and isinstance(a.value, str) for a in node.args):
                _simple([[str(a.value) for a in node.args if isinstance(a, ast.Constant)]], walk, depth=1)
        elif name == "shutil.rmtree" and isinstance(first, ast.Constant) and isinstance(first.value, str):
            if walk.outside(first.value):
                walk.hit("recursive-delete", f"shutil.rmtree({first.value!r})")


def _dotted(func: ast.expr, aliases: dict[str, str]) -> str:
    parts: list[str] = []
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if not isinstance(func, ast.Name):
        return ""
    parts.append(aliases.get(func.id, func.id))
    return ".".join(reversed(parts))
