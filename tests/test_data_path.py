"""Getting work in and out, without an engine: the tar walkers on hostile trees, globs, the Mount model and the
guard's mount rules, the package-cache host step against a loopback index, image recipes, docker's mount
contract, and the whole API and CLI path on local_subprocess (local mode)."""

from __future__ import annotations

import io
import os
import stat
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

import execbox
from execbox import ConfigError, Mount, RefusedError, SecretFileError, TransferTooLargeError, WorkspacePathError
from execbox.backends.docker import hardening
from execbox.backends.docker.image import DEFAULT_PACKAGES, DEFAULT_TAG, ImageBuildError, build_image, recipe_hash
from execbox.cli import main as cli
from execbox.files.transfer import TransferLimits, glob_regex, host_list, host_pack, host_unpack
from execbox.guard.mounts import admit_mounts, admit_upload, mount_problem
from execbox.kit import packages
from execbox.testing.checks import host_processes
from tests.support.wheels import build_wheel, host_pip_uses, serve_index

LIMITS = TransferLimits(max_bytes=64 << 20, max_entries=10_000)
SEED = ("abandon ability able about above absent absorb abstract absurd abuse access accident account accuse "
        "achieve acid")


@pytest.fixture
def outside() -> Iterator[Path]:
    """A directory the mount rules accept (not in the temp dir's execbox-* names, not in a home root)."""
    path = Path(tempfile.mkdtemp(prefix="data-path-"))
    path.chmod(0o755)
    yield path
    transfer_remove(path)


def transfer_remove(path: Path) -> None:
    from execbox.files.workspace import remove_tree

    remove_tree(str(path))


def pack(root: Path, rel: str, limits: TransferLimits = LIMITS) -> tuple[bytes, execbox.Transfer]:
    out = io.BytesIO()
    stats = host_pack(str(root), rel, out, limits=limits)
    return out.getvalue(), stats


def members(archive: bytes) -> dict[str, str]:
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        return {m.name: ("link:" + m.linkname if m.issym() else "dir" if m.isdir() else f"file:{m.size}")
                for m in tar.getmembers()}


# --- the walkers -----------------------------------------------------------------------------------------------


def test_pack_stores_links_as_links_and_skips_fifos(outside: Path) -> None:
    (outside / "out/sub").mkdir(parents=True)
    (outside / "out/a.txt").write_text("a")
    os.symlink("/etc/shadow", outside / "out/evil")
    os.symlink("/", outside / "out/sub/root")
    os.mkfifo(outside / "out/pipe")
    archive, stats = pack(outside, "out")
    assert members(archive) == {"out": "dir", "out/a.txt": "file:1", "out/evil": "link:/etc/shadow",
                                "out/sub": "dir", "out/sub/root": "link:/"}
    assert stats.skipped == ["out/pipe: a FIFO, not copied"] and stats.files == 1


def test_download_never_creates_a_link_and_reports_it(outside: Path) -> None:
    (outside / "out").mkdir()
    (outside / "out/ok.txt").write_text("kept")
    os.symlink("/etc/shadow", outside / "out/evil")
    archive, _ = pack(outside, "out")
    dest = outside / "local"
    dest.mkdir()
    stats = host_unpack(str(dest), "res", io.BytesIO(archive), limits=LIMITS, prefix="out", workspace=False,
                        shown_as="out")
    assert sorted(os.listdir(dest / "res")) == ["ok.txt"]
    assert stats.skipped == ["out/evil: a symlink to '/etc/shadow', not created"]


def test_a_three_thousand_deep_tree_is_refused_without_recursion(outside: Path) -> None:
    fd = os.open(outside, os.O_RDONLY)
    for _ in range(3000):  # deeper than PATH_MAX allows by name: built relative to each level
        os.mkdir("d", dir_fd=fd)
        nfd = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = nfd
    os.close(fd)
    with pytest.raises(TransferTooLargeError, match="deeper than 256 levels"):
        pack(outside, "d")
    with pytest.raises(TransferTooLargeError, match="deeper than 256"):
        host_list(str(outside), "d", recursive=True, limits=LIMITS)


def test_a_sparse_5_gib_file_is_refused_from_its_size(outside: Path) -> None:
    with open(outside / "big.bin", "wb") as fh:
        fh.truncate(5 << 30)
    out = io.BytesIO()
    with pytest.raises(TransferTooLargeError, match="CODE_EXEC_MAX_TRANSFER_BYTES") as info:
        host_pack(str(outside), "big.bin", out, limits=LIMITS)
    assert info.value.env_var == "CODE_EXEC_MAX_TRANSFER_BYTES"
    assert len(out.getvalue()) < 1 << 20  # nothing of it was read into the archive


def test_too_many_entries_are_refused_while_listing(outside: Path) -> None:
    (outside / "many").mkdir()
    for i in range(50):
        (outside / "many" / f"f{i}").touch()
    with pytest.raises(TransferTooLargeError, match="more than 20 entries"):
        host_list(str(outside), "many", recursive=False, limits=TransferLimits(1 << 20, 20))


def test_a_listing_shows_types_and_sizes_and_never_follows(outside: Path) -> None:
    (outside / "d/sub").mkdir(parents=True)
    (outside / "d/f.bin").write_bytes(b"x" * 10)
    os.symlink("/etc", outside / "d/link")
    flat = host_list(str(outside), "d", recursive=False, limits=LIMITS)
    assert [(e.path, e.name, e.type, e.size) for e in flat] == [
        ("d/f.bin", "f.bin", "file", 10), ("d/link", "link", "symlink", 0), ("d/sub", "sub", "directory", 0)]
    assert [e.path for e in host_list(str(outside), "", recursive=True, limits=LIMITS)] == [
        "d", "d/f.bin", "d/link", "d/sub"]
    assert [e.type for e in host_list(str(outside), "d/link", recursive=True, limits=LIMITS)] == ["symlink"]


def test_hostile_archive_names_stay_inside_and_a_planted_link_is_not_written_through(outside: Path) -> None:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name in ("x/../../escape.txt", "/abs.txt", "x/ok.txt", "other/y.txt"):
            info = tarfile.TarInfo(name)
            info.size = 2
            tar.addfile(info, io.BytesIO(b"hi"))
    dest = outside / "ws"
    dest.mkdir()
    stats = host_unpack(str(dest), "x", io.BytesIO(out.getvalue()), limits=LIMITS, prefix="x")
    assert sorted(os.listdir(dest)) == ["x"] and os.listdir(dest / "x") == ["ok.txt"]
    assert not (outside / "escape.txt").exists() and len(stats.skipped) == 3
    # The code replaced the destination directory by a link out: the write is refused, nothing lands outside.
    target = outside / "target"
    target.mkdir()
    os.symlink(target, dest / "planted")
    archive, _ = pack(dest, "x")
    with pytest.raises(WorkspacePathError, match="symlink"):
        host_unpack(str(dest), "planted/x", io.BytesIO(archive), limits=LIMITS, prefix="x")
    assert os.listdir(target) == []


@pytest.mark.parametrize(("pattern", "matches", "not_matches"), [
    ("out/*.png", ["out/a.png"], ["out/sub/a.png", "out/a.txt", "a.png"]),
    ("out/**/*.png", ["out/a.png", "out/sub/b/c.png"], ["x/out/a.png"]),
    ("**/*.csv", ["a.csv", "x/y/z.csv"], ["a.csvx"]),
    ("data/[ab]?.txt", ["data/a1.txt", "data/bz.txt"], ["data/c1.txt", "data/a/1.txt"]),
])
def test_globs(pattern: str, matches: list[str], not_matches: list[str]) -> None:
    regex = glob_regex(pattern)
    assert all(regex.fullmatch(m) for m in matches) and not any(regex.fullmatch(n) for n in not_matches)


# --- the Mount model and the guard's rules ---------------------------------------------------------------------


def test_mount_model_validates_and_parses() -> None:
    assert Mount("/src/repo", "/workspace/repo") == Mount(source="/src/repo", target="/workspace/repo")
    assert Mount.parse("/a:/data:rw").writable and not Mount.parse("/a:/data").writable
    for target in ("/", "/workspace", "relative", "/proc/x", "/tmp/x", "/opt/execbox/pip"):
        with pytest.raises(ConfigError):
            Mount("/src", target)
    # Over the sandbox's own system or the proxy's socket (found attacking the mounts): refused, also when the
    # path only gets there through '..'.
    for target in ("/etc", "/usr/bin", "/lib64", "/run/execbox", "/run", "/var/run/execbox", "/var/lock",
                   "/workspace/../etc", "/data/../../usr"):
        with pytest.raises(ConfigError, match="which the sandbox provides itself"):
            Mount("/src", target)
    assert Mount("/src", "/etcetera").target == "/etcetera" and Mount("/src", "/data/../x").target == "/x"
    with pytest.raises(ConfigError, match="absolute"):
        Mount("src", "/data")
    with pytest.raises(ConfigError, match="HOST:SANDBOX"):
        Mount.parse("/a")


@pytest.mark.parametrize("source", ["/", "/home", "/root", "/var/run/docker.sock", "/run", "/var", "/etc",
                                    "/etc/ssh", "/proc/self", "/dev", "/sys/fs"])
def test_mount_of_a_refused_place_is_refused(source: str) -> None:
    assert mount_problem(source) is not None
    with pytest.raises(RefusedError, match="refused: mount"):
        admit_mounts([Mount(source, "/data")], backend="x")


def test_home_itself_secret_dirs_and_execbox_state_are_refused(outside: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = outside / "home-of-me"
    (home / ".ssh").mkdir(parents=True)
    (home / "project").mkdir()
    (home / ".cache/execbox/pip").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert "home directory" in (mount_problem(str(home)) or "")
    assert mount_problem(str(home / ".ssh")) and mount_problem(str(home / ".cache/execbox/pip"))
    assert mount_problem(str(home / "project")) is None  # a directory below the home is what people mount
    os.symlink(home / ".ssh", outside / "innocent")
    assert ".ssh" in (mount_problem(str(outside / "innocent")) or "")  # judged where it leads
    workspace = Path(tempfile.mkdtemp(prefix="execbox-ws-"))
    try:
        assert "workspace of execbox" in (mount_problem(str(workspace)) or "")
    finally:
        workspace.rmdir()


def test_the_tree_is_scanned_for_credentials_and_seeds(outside: Path) -> None:
    repo = outside / "repo"
    (repo / "src").mkdir(parents=True)
    assert admit_mounts([Mount(repo, "/workspace/repo")], backend="x")[0].source == str(repo)
    (repo / "src/.env").write_text(f"MNEMONIC='{SEED}'\n")
    with pytest.raises(SecretFileError, match=r"wallet secret in .*\.env"):
        admit_mounts([Mount(repo, "/workspace/repo")], backend="x")
    with pytest.raises(SecretFileError):
        admit_upload(str(repo))
    (repo / "src/.env").unlink()
    (repo / "deploy/.aws").mkdir(parents=True)
    with pytest.raises(RefusedError, match=r"\.aws"):
        admit_mounts([Mount(repo, "/workspace/repo")], backend="x")


def test_mounts_are_resolved_sorted_and_targets_unique(outside: Path) -> None:
    (outside / "a").mkdir()
    os.symlink(outside / "a", outside / "link")
    got = admit_mounts([Mount(outside / "a", "/data/a/b"), Mount(outside / "link", "/data")], backend="x")
    assert [(m.source, m.target) for m in got] == [(str(outside / "a"), "/data"), (str(outside / "a"), "/data/a/b")]
    with pytest.raises(ConfigError, match="two mounts"):
        admit_mounts([Mount(outside / "a", "/data"), Mount(outside / "a", "/data")], backend="x")


# --- docker's mount contract (no engine: the inspect data as docker reports it) -----------------------------


def _attrs(mounts: list[dict[str, object]]) -> dict[str, object]:
    return {"Mounts": mounts}


def test_docker_contract_names_a_mount_the_engine_made_writable() -> None:
    contract = hardening.Contract(user="1:1", network="none", workspace="/ws", memory_bytes=1, nano_cpus=1, pids=1,
                                  runtime=None, mounts=(("/src/repo", "/workspace/repo", False),))
    good = [{"Type": "bind", "Source": "/ws", "Destination": "/workspace", "RW": True, "Propagation": "rprivate"},
            {"Type": "bind", "Source": "/src/repo", "Destination": "/workspace/repo", "RW": False,
             "Propagation": "rprivate"}]
    mount_problems = [p for p in hardening.built_problems(_attrs(good), contract) if "Mounts" in p]
    assert mount_problems == []
    flipped = [good[0], {**good[1], "RW": True}]
    assert any(p.startswith("Mounts=") for p in hardening.built_problems(_attrs(flipped), contract))
    shared = [good[0], {**good[1], "Propagation": "rshared"}]
    assert any("Propagation='rshared'" in p for p in hardening.built_problems(_attrs(shared), contract))
    missing = [good[0]]
    assert any(p.startswith("Mounts=") for p in hardening.built_problems(_attrs(missing), contract))


def test_docker_create_arguments_admit_only_the_declared_writable_mounts() -> None:
    from docker.types import Mount as DockerMount

    base = {"cap_drop": ["ALL"], "security_opt": hardening.security_opt(), "read_only": True, "init": True,
            "user": "1000:1000", "pids_limit": 1, "mem_limit": "1m", "memswap_limit": "1m", "nano_cpus": 1}
    ws = DockerMount("/workspace", "/nonexistent-ws", type="bind", read_only=False)
    extra = DockerMount("/data", "/srv/data", type="bind", read_only=False)
    with pytest.raises(ConfigError, match="one writable mount"):
        hardening.hardened({**base, "mounts": [ws, extra]}, socket_path=None)
    hardening.hardened({**base, "mounts": [ws, extra]}, socket_path=None, user_mounts=[("/srv/data", "/data", True)])
    shared = DockerMount("/data", "/srv/data", type="bind", read_only=True, propagation="rshared")
    with pytest.raises(ConfigError, match="private bind"):
        hardening.hardened({**base, "mounts": [ws, shared]}, socket_path=None)


# --- packages: the trusted host step -------------------------------------------------------------------------


@pytest.mark.parametrize("req", ["https://evil.example/x.whl", "pkg @ https://evil.example/x.whl", "--index-url=x",
                                 "-e .", "./local/dir", "/etc/passwd", "", "pkg[", "a\0b"])
def test_requirements_other_than_names_and_versions_are_refused(req: str) -> None:
    with pytest.raises(ConfigError):
        packages.check_requirements([req])


def test_python_target_tags() -> None:
    target = packages.PythonTarget.parse("3 11 x86_64 glibc 2.36")
    args = target.pip_args()
    assert args[:3] == ["--only-binary=:all:", "--python-version", "3.11"]
    platforms = [args[i + 1] for i, a in enumerate(args) if a == "--platform"]
    assert platforms[0] == "manylinux_2_36_x86_64" and "manylinux2014_x86_64" in platforms
    assert "manylinux_2_4_x86_64" not in platforms and platforms[-1] == "linux_x86_64"
    with pytest.raises(execbox.SandboxError):
        packages.PythonTarget.parse("garbage")


def test_the_cache_is_filled_once_then_served_without_download(outside: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wheel = build_wheel(outside)
    cache = outside / "cache"
    with serve_index(outside / "index", [wheel]) as index:
        host_pip_uses(index, monkeypatch)
        first = packages.fill_cache(cache, ["execbox-probe-pkg"], packages.PythonTarget.here())
        second = packages.fill_cache(cache, ["execbox-probe-pkg==1.0"], packages.PythonTarget.here())
        assert first.downloaded == [wheel.name] and second.downloaded == [] and second.cached == [wheel.name]
        assert index.downloads == [wheel.name]  # measured at the index: one download, for the first fill only
    assert stat.S_IMODE(os.stat(cache / wheel.name).st_mode) == 0o644
    assert not [p for p in cache.iterdir() if p.name.startswith(".staging")]
    cache.chmod(0o777)
    with pytest.raises(ConfigError, match="writable by other users"):
        packages.fill_cache(cache, ["execbox-probe-pkg"], packages.PythonTarget.here())


# --- image recipes -------------------------------------------------------------------------------------------


def test_image_recipe_says_what_is_in_it(outside: Path) -> None:
    default = recipe_hash("bookworm", DEFAULT_PACKAGES, "65534:65534")
    numpy = recipe_hash("bookworm", (*DEFAULT_PACKAGES, "python3-numpy"), "65534:65534")
    pins = [recipe_hash("bookworm", DEFAULT_PACKAGES, "65534:65534", (pin,)) for pin in ("rich==1.0", "rich==1.1")]
    assert len({default, numpy, *pins}) == 4
    assert recipe_hash("bookworm", DEFAULT_PACKAGES, "65534:65534", ("b", "a")) == \
        recipe_hash("bookworm", DEFAULT_PACKAGES, "65534:65534", ("a", "b"))
    for bad in ("python3,evil", "-o", "a b"):
        with pytest.raises(ImageBuildError, match="Debian package name"):
            build_image(None, packages=(*DEFAULT_PACKAGES, bad), client=object())
    with pytest.raises(ImageBuildError, match="invalid requirement|refused requirement"):
        build_image(None, pip=("https://x/y.whl",), client=object())
    assert DEFAULT_TAG == "execbox-sandbox:bookworm"


# --- the API and the CLI, end to end on local_subprocess --------------------------------------------------


@pytest.fixture
def local(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CODE_EXEC_LOCAL", "true")
    monkeypatch.setenv("CODE_EXEC_NETWORK", "host")
    monkeypatch.setenv("CODE_EXEC_BACKEND", "local_subprocess")


def test_the_readme_data_job(local: None, outside: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(outside)
    (outside / "sales.csv").write_text("item,amount\na,10\nb,20\nc,12.5\n")
    job = ("import csv, os\n"
           "rows = list(csv.DictReader(open('data/sales.csv')))\n"
           "os.makedirs('out', exist_ok=True)\n"
           "open('out/summary.txt', 'w').write(f\"{len(rows)} sales, {sum(float(r['amount']) for r in rows):.2f} "
           "in all\\n\")\n")
    result = execbox.run_code(job, upload={"sales.csv": "data/sales.csv"}, collect=["out/*.txt"])
    assert result.files == {"out/summary.txt": b"3 sales, 42.50 in all\n"}, result
    data = result.model_dump_json()
    assert execbox.ExecResult.model_validate_json(data).files == result.files


def test_sessions_upload_list_download_and_read_file_of_a_directory(local: None, outside: Path) -> None:
    (outside / "in/sub").mkdir(parents=True)
    (outside / "in/sub/x.bin").write_bytes(os.urandom(4096))
    with execbox.sandbox("local_subprocess") as sb:
        moved = sb.upload(outside / "in")
        assert (moved.files, moved.directories) == (1, 2)
        assert [(e.path, e.type) for e in sb.list_files(".")] == [("in", "directory")]
        assert [e.path for e in sb.list_files("in", recursive=True)] == ["in/sub", "in/sub/x.bin"]
        with pytest.raises(WorkspacePathError, match="list_files"):
            sb.read_file(".")
        with pytest.raises(WorkspacePathError, match="download"):
            sb.read_file("in/sub")
        sb.download("in", outside / "back")
        assert (outside / "back/sub/x.bin").read_bytes() == (outside / "in/sub/x.bin").read_bytes()
        sb.download("in/sub/x.bin", outside / "back")  # a file into an existing directory lands inside it
        sb.download("in/sub/x.bin", outside / "single.bin")  # elsewhere, at that path
        assert (outside / "back/x.bin").read_bytes() == (outside / "single.bin").read_bytes() == \
            (outside / "in/sub/x.bin").read_bytes()
        with pytest.raises(WorkspacePathError, match="escapes|outside"):
            sb.download("../x", outside / "nope")


def test_mounts_and_package_cache_are_refused_where_the_backend_cannot_bind(local: None, outside: Path) -> None:
    with pytest.raises(execbox.UnsupportedPolicyError, match="upload"):
        execbox.run("true", mounts=[Mount(outside, "/data")])
    with pytest.raises(execbox.UnsupportedPolicyError, match="package cache"):
        with execbox.sandbox("local_subprocess", package_cache=True):
            pass
    with execbox.sandbox("local_subprocess") as sb:  # opened without asking: refused when asked, by the same rule
        with pytest.raises(execbox.UnsupportedPolicyError, match="cannot bind the package cache"):
            sb.pip_install("rich")


def test_cli_file_options_end_to_end(local: None, outside: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(outside)
    (outside / "in.csv").write_text("a,b\n")
    (outside / "inputs").mkdir()
    (outside / "inputs/y.txt").write_text("y\n")
    runner = CliRunner()
    done = runner.invoke(cli, ["run", "--file", "in.csv", "--dir", "inputs:data", "--collect", "out/*",
                               "--out", "res", "--", "sh", "-c", "mkdir out; cat in.csv data/y.txt > out/both"])
    assert done.exit_code == 0, done.output
    assert (outside / "res/out/both").read_text() == "a,b\ny\n"
    done = runner.invoke(cli, ["run", "--file", "in.csv", "--out", "whole", "--", "sh", "-c",
                               "ln -s /etc/passwd link; mkdir -p d; cp in.csv d/"])
    assert done.exit_code == 0, done.output
    assert sorted(os.listdir(outside / "whole")) == ["d", "in.csv"] and "link" in done.output
    for args, message in ((["--collect", "x"], "--collect needs --out"), (["--dir", "in.csv"], "not a directory"),
                          (["--file", "inputs"], "not a file"), (["--mount", "/a"], "HOST:SANDBOX")):
        done = runner.invoke(cli, ["run", *args, "--", "true"])
        assert done.exit_code == 2 and message in done.output, done.output
    done = runner.invoke(cli, ["run", "--mount", f"{outside}:/data", "--", "true"])
    assert done.exit_code == 125, done.output


def test_the_audit_log_and_the_signing_keys_are_never_handed_to_the_code(local: None, outside: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # Put where the operator chose (not in a default place): the audit log, its key, the MCP grant key. A mount
    # or an upload of any of them (or of what holds them) would let the code read or rewrite them.
    log_dir, keys = outside / "audit", outside / "keys"
    log_dir.mkdir()
    keys.mkdir()
    (keys / "audit.key").write_bytes(b"k" * 32)
    (keys / "mcp.key").write_bytes(b"m" * 32)
    monkeypatch.setenv("CODE_EXEC_AUDIT_LOG", str(log_dir / "audit.jsonl"))
    monkeypatch.setenv("CODE_EXEC_AUDIT_KEY_FILE", str(keys / "audit.key"))
    monkeypatch.setenv("EXECBOX_MCP_KEY_FILE", str(keys / "mcp.key"))
    with execbox.Runner() as runner:
        places = runner.aio.state_places()
        assert {str(log_dir), str(keys / "audit.key"), str(keys / "mcp.key")} <= set(places)
        for path in (log_dir, keys / "audit.key", keys, outside):
            with pytest.raises(execbox.RefusedError, match="refused: upload"):
                runner.run("true", upload={str(path): "x"})
    from execbox.guard.mounts import admit_mounts

    for path in (log_dir, keys / "mcp.key", outside):
        with pytest.raises(execbox.RefusedError, match="refused: mount"):
            admit_mounts([Mount(path, "/data")], backend="docker", state=places)


def test_an_archive_over_the_bound_is_refused_before_it_reaches_the_sandbox() -> None:
    import io

    import anyio

    from execbox.files.transfer import sandbox_unpack

    class Untouched:
        workspace = "/workspace"

        async def write_file(self, path: str, data: bytes) -> None:
            raise AssertionError("an oversize archive reached the sandbox")

    limits = TransferLimits(max_bytes=1000, max_entries=1)
    big = io.BytesIO(b"\0" * (1000 + 2048 * 9 + 1))
    with pytest.raises(TransferTooLargeError, match="CODE_EXEC_MAX_TRANSFER_BYTES"):
        anyio.run(lambda: sandbox_unpack(Untouched(), "dest", big, limits=limits))  # type: ignore[arg-type]


def test_host_pip_dies_with_a_sigkilled_caller(outside: Path) -> None:
    """pip runs on the host with the caller's privileges: a caller killed while pip waits on the index must not
    leave it running (its reaper takes it down). The index here is a loopback listener that never answers."""
    import signal
    import socket
    import subprocess
    import sys
    import time
    import uuid

    marker = f"execbox-never-answered-{uuid.uuid4().hex[:8]}"
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    port = listener.getsockname()[1]
    code = ("import pathlib, sys; from execbox.kit import packages; "
            "packages.pip_download([sys.argv[1]], pathlib.Path(sys.argv[2]), packages.PythonTarget.here())")
    env = {**os.environ, "PIP_INDEX_URL": f"http://127.0.0.1:{port}/simple", "PIP_RETRIES": "0",
           "PIP_TIMEOUT": "120"}
    caller = subprocess.Popen([sys.executable, "-c", code, marker, str(outside / "dest")], env=env)
    try:
        deadline = time.monotonic() + 60
        while not _processes_with(marker, but=caller.pid):
            assert caller.poll() is None, "the caller ended before pip started"
            assert time.monotonic() < deadline, "pip never started"
            time.sleep(0.05)
        listener.settimeout(60)
        held, _ = listener.accept()  # pip is waiting on the index now
        caller.send_signal(signal.SIGKILL)
        caller.wait()
        deadline = time.monotonic() + 15
        while left := _processes_with(marker, but=caller.pid):
            assert time.monotonic() < deadline, f"pip outlived its caller: {left}"
            time.sleep(0.05)
        held.close()
    finally:
        if caller.poll() is None:
            caller.kill()
            caller.wait()
        listener.close()


def _processes_with(text: str, *, but: int) -> list[int]:
    return [pid for pid, argv in host_processes() if pid != but and any(text in arg for arg in argv)]
