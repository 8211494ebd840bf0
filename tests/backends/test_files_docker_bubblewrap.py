"""Getting work in and out on the real engines (docker and bubblewrap): a 50 MB directory round trip, links the
code planted, read-only mounts and refused ones, the package cache's second install measured at the index, an
image built with Debian's numpy and matplotlib (and a wheel from a loopback index) running numpy and returning a
plot through collect, a host venv bound read-only into bubblewrap, and the CLI's file options end to end.

Extra images are built at most once per test session and cached by recipe across sessions (a second build of
the same recipe is a no-op), so only the first run on a machine pays for debootstrap and apt."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

import execbox
from execbox import Mount, RefusedError, Runner, SecretFileError, Settings, WorkspacePathError
from execbox.cli import main as cli
from execbox.runner import run_blocking
from execbox.testing import engine_missing
from tests.support.gvisor import DOCKER_GVISOR, backend_for
from tests.support.wheels import MODULE, NAME, VALUE, build_wheel, host_pip_uses, serve_index

ROOT = os.geteuid() == 0
SEED = ("abandon ability able about above absent absorb abstract absurd abuse access accident account accuse "
        "achieve acid")


def _available(name: str) -> None:
    runner = Runner(Settings(backend=name))
    try:
        run_blocking(runner.aio.backend(name).check)
    except execbox.BackendUnavailableError as exc:
        engine_missing(f"{name} cannot run here: {exc}")


@pytest.fixture(params=["docker", DOCKER_GVISOR, "bubblewrap"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    name = backend_for(request, monkeypatch)
    _available(name)
    return name


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory every sandbox user can reach (as root, docker and bubblewrap run the code as 65534)."""
    path = Path(tempfile.mkdtemp(prefix="files-test-", dir="/opt" if os.access("/opt", os.W_OK) else None))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _digests(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


# --- directories in and out --------------------------------------------------------------------------------


def test_a_50_mb_directory_round_trips_byte_for_byte(backend: str, shared_dir: Path) -> None:
    src = shared_dir / "src"
    for i in range(20):
        sub = src / f"part{i % 4}" / f"chunk{i % 3}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"blob{i}.bin").write_bytes(os.urandom(2_500_000 + i))
    (src / "empty").mkdir()
    total = sum(p.stat().st_size for p in src.rglob("*") if p.is_file())
    assert total >= 50_000_000
    with execbox.sandbox(backend) as sb:
        moved = sb.upload(src, "data")
        assert (moved.files, moved.bytes, moved.skipped) == (20, total, [])
        inside = sb.exec("cd data && find . -type f -exec sha256sum {} + | sort -k2", timeout=60)
        got = {line.split()[1][2:]: line.split()[0] for line in inside.stdout.splitlines()}
        assert got == {k: v for k, v in _digests(src).items() if v != "dir"}, inside.stderr
        assert sum(e.size for e in sb.list_files("data", recursive=True) if e.type == "file") == total
        back = sb.download("data", shared_dir / "back")
        assert (back.files, back.bytes, back.skipped) == (20, total, [])
    assert _digests(shared_dir / "back") == _digests(src)


def test_a_planted_symlink_is_not_followed_on_download(backend: str, shared_dir: Path) -> None:
    with execbox.sandbox(backend) as sb:
        planted = sb.exec("mkdir -p out/d && echo real > out/d/real.txt && ln -s /etc/shadow out/shadow && "
                          "ln -s /etc out/etc && ln -s ../../../../../../../etc/passwd out/d/up && "
                          "ln -s /etc/passwd whole")
        assert planted.exit_code == 0, planted.stderr
        moved = sb.download(".", shared_dir / "ws")
        with pytest.raises(WorkspacePathError, match="symlink"):
            sb.read_file("out/shadow")
    found = [p for p in (shared_dir / "ws").rglob("*")]
    assert not [p for p in found if p.is_symlink()]
    assert sorted(p.relative_to(shared_dir / "ws").as_posix() for p in found) == ["out", "out/d", "out/d/real.txt"]
    assert sorted(s.split(":")[0] for s in moved.skipped) == ["out/d/up", "out/etc", "out/shadow", "whole"]


# --- mounts --------------------------------------------------------------------------------------------------


def test_a_read_only_mount_cannot_be_written_and_refused_paths_are_refused(backend: str, shared_dir: Path) -> None:
    repo = shared_dir / "repo"
    (repo / "src").mkdir(parents=True)
    (repo / "src/app.py").write_text("print('from the repo')\n")
    for path in (repo, repo / "src"):
        path.chmod(0o755)
    with execbox.sandbox(backend, mounts=[Mount(repo, "/workspace/repo")]) as sb:
        ran = sb.exec("python3 repo/src/app.py; touch repo/new; echo touch=$?; rm repo/src/app.py; echo rm=$?; "
                      "mv repo/src repo/moved; echo mv=$?")
        assert ran.stdout.split("\n")[0] == "from the repo"
        assert all(f"{op}=0" not in ran.stdout for op in ("touch", "rm", "mv")), ran.stdout
        assert sorted(os.listdir(repo)) == ["src"] and (repo / "src/app.py").exists()
        with pytest.raises(WorkspacePathError, match="mount of the host path"):
            sb.upload(repo / "src/app.py", "repo/src/app.py")
        if backend == "docker":  # the engine's own account of the container: the bind is read-only
            session = sb.aio._session
            keeper = sb.aio.backend.call(lambda c: c.containers.get(session._keeper_id))  # type: ignore[union-attr]
            mounts = {m["Destination"]: (m["Source"], m["RW"]) for m in keeper.attrs["Mounts"]}
            assert mounts["/workspace/repo"] == (str(repo), False)
    home = os.path.expanduser("~")
    for refused in ("/", home, "/var/run/docker.sock", "/etc", str(Path(home, ".ssh"))):
        if os.path.lexists(refused):
            with pytest.raises(RefusedError, match="refused: mount"):
                execbox.run("true", backend=backend, mounts=[Mount(refused, "/data")])
    (repo / ".env").write_text(f"SEED='{SEED}'\n")
    with pytest.raises(SecretFileError, match="wallet secret"):
        execbox.run("true", backend=backend, mounts=[Mount(repo, "/data")])


def test_a_writable_mount_is_written_on_the_host(backend: str, shared_dir: Path) -> None:
    out = shared_dir / "out"
    out.mkdir(mode=0o777)
    out.chmod(0o777)  # the sandbox user is another uid than ours when execbox runs as root
    result = execbox.run("echo made > /data/out/made.txt", backend=backend,
                         mounts=[Mount(out, "/data/out", writable=True)])
    assert result.exit_code == 0, result.stderr
    assert (out / "made.txt").read_text() == "made\n"


# --- the package cache ---------------------------------------------------------------------------------------


@pytest.mark.not_gvisor("the package cache is host-side and the runtime adds nothing to it but 25 s of pip")
def test_the_second_sessions_pip_install_hits_the_cache(backend: str, shared_dir: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    wheel = build_wheel(shared_dir)
    check = ["python3", "-c", f"import {MODULE}; print({MODULE}.VALUE)"]
    with serve_index(shared_dir / "index", [wheel]) as index:
        host_pip_uses(index, monkeypatch)
        monkeypatch.setenv("CODE_EXEC_PACKAGE_CACHE", str(shared_dir / "cache"))
        with execbox.sandbox(backend, package_cache=True) as sb:
            first = sb.pip_install(NAME)
            assert first.exit_code == 0, first.stderr
            assert sb.exec(check).stdout == f"{VALUE}\n"
            assert "touch=0" not in sb.exec("touch /opt/execbox/pip/planted.whl; echo touch=$?").stdout
        assert index.downloads == [wheel.name]
        with execbox.sandbox(backend, pip=[f"{NAME}==1.0"]) as sb:  # a second session: from the cache
            assert sb.exec(check).stdout == f"{VALUE}\n"
        with execbox.sandbox(backend, package_cache=True) as sb:  # plain pip inside finds it too, offline
            plain = sb.exec(["python3", "-m", "pip", "install", NAME])
            assert plain.exit_code == 0, plain.stderr
            assert sb.exec(check).stdout == f"{VALUE}\n"
        assert index.downloads == [wheel.name]  # measured at the index: nothing more was downloaded
    assert sorted(os.listdir(shared_dir / "cache")) == [".lock", wheel.name]


# --- images (docker) and a host prefix (bubblewrap) ---------------------------------------------------------


@pytest.fixture(scope="session")
def data_image() -> str:
    """execbox-sandbox:bookworm-<recipe>: Debian's numpy and matplotlib, and the probe wheel from a loopback
    index; built once per machine (a second build of the same recipe is a no-op)."""
    _available("docker")
    if not ROOT:
        engine_missing("building an image runs debootstrap, which needs root")
    from execbox.backends.docker import image as docker_image

    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as mp:
        wheel = build_wheel(Path(tmp))
        with serve_index(Path(tmp, "index"), [wheel]) as index:
            host_pip_uses(index, mp)
            result = docker_image.build_image(
                None, packages=(*docker_image.DEFAULT_PACKAGES, "python3-numpy", "python3-matplotlib"),
                pip=(f"{NAME}==1.0",))
    assert result.tag.startswith(f"{docker_image.DEFAULT_TAG}-")
    return result.tag


def test_an_image_built_with_python3_numpy_runs_numpy(data_image: str) -> None:
    code = f"import numpy, {MODULE}; print(int(numpy.arange(5).sum()), {MODULE}.VALUE)"
    result = execbox.run_code(code, backend="docker", options={"image": data_image})
    assert result.stdout == f"10 {VALUE}\n", result.stderr
    import docker

    labels = docker.from_env().images.get(data_image).labels
    assert labels["io.execbox.image.packages"] == "python3-matplotlib,python3-numpy"
    assert labels["io.execbox.image.pip"] == f"{NAME}==1.0"


def test_collect_returns_a_png_a_matplotlib_script_wrote(data_image: str) -> None:
    plot = ("import matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt, numpy as np, os\n"
            "data = np.loadtxt('data.csv', delimiter=',')\nos.makedirs('out', exist_ok=True)\n"
            "plt.plot(data[:, 0], data[:, 1]); plt.savefig('out/plot.png')\n")
    with execbox.sandbox("docker", image=data_image) as sb:  # the image per session, as an option
        sb.write_file("data.csv", "1,1\n2,4\n3,9\n")
        result = sb.run_code(plot, collect=["out/*.png"])
    assert result.exit_code == 0, result.stderr
    png = result.files["out/plot.png"]
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(png[16:20], "big") > 100  # IHDR width


def test_a_dockerfile_from_the_default_image_is_a_sandbox_image(shared_dir: Path) -> None:
    """The documented FROM path, with no registry: the base is local."""
    _available("docker")
    import docker

    (shared_dir / "hello.txt").write_text("hello from my image\n")
    (shared_dir / "Dockerfile").write_text("FROM execbox-sandbox:bookworm\nCOPY hello.txt /opt/hello.txt\n")
    client = docker.from_env()
    tag = f"execbox-test-from:{os.getpid()}"
    client.images.build(path=str(shared_dir), tag=tag, rm=True)
    try:
        assert execbox.run(["cat", "/opt/hello.txt"], backend="docker", options={"image": tag}).stdout == \
            "hello from my image\n"
    finally:
        client.images.remove(tag, force=True)


def test_a_host_venv_bound_read_only_into_bubblewrap(shared_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _available("bubblewrap")
    if not os.access("/opt", os.W_OK):
        pytest.skip("needs a writable /opt for a venv outside the refused places")
    venv = shared_dir / "venv"
    # The system Python, which the sandbox has under /usr; the wheel unpacked into the venv's site-packages.
    subprocess.run(["/usr/bin/python3", "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next(venv.glob("lib/python3*/site-packages"))
    with zipfile.ZipFile(build_wheel(shared_dir)) as zf:
        zf.extractall(site)
    for path in [venv, *venv.rglob("*")]:
        if not path.is_symlink():
            path.chmod(0o755 if path.is_dir() else 0o644)
    code = [str(venv / "bin/python"), "-c", f"import sys, {MODULE}; print({MODULE}.VALUE, sys.prefix)"]
    monkeypatch.setenv("CODE_EXEC_BWRAP_RO_BINDS", str(venv))
    bound = execbox.run(code, backend="bubblewrap")
    assert bound.stdout == f"{VALUE} {venv}\n", bound.stderr
    assert execbox.run(["touch", str(site / "x")], backend="bubblewrap").exit_code != 0
    monkeypatch.delenv("CODE_EXEC_BWRAP_RO_BINDS")
    mounted = execbox.run(code, backend="bubblewrap", mounts=[Mount(venv, str(venv))])
    assert mounted.stdout == f"{VALUE} {venv}\n", mounted.stderr


@pytest.mark.parametrize("path", ["/", "/home", "/root", "/run", "/var/run", "/proc", "/sys", "/dev", "/boot", "/etc",
                                  "/var", "/tmp", "/workspace", "/var/tmp", "/usr/..", "/etc/ssl/certs"])
def test_bwrap_ro_binds_refuses_what_the_readme_says(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from execbox.backends.bubblewrap.filesystem import FORBIDDEN, unsafe_bind
    from execbox.backends.bubblewrap.settings import BubblewrapSettings

    readme = " ".join(Path(__file__).resolve().parents[2].joinpath("README.md").read_text().split())
    listed = ", ".join(f"`{p}`" for p in FORBIDDEN)  # the README's list is the code's list, in its order
    assert f"holds any of {listed}, the temp directory and your home" in readme
    if not os.path.lexists(path) and path != "/workspace":
        pytest.skip(f"{path} does not exist here")
    assert unsafe_bind(path) is not None
    monkeypatch.setenv("CODE_EXEC_BWRAP_RO_BINDS", path)
    with pytest.raises(execbox.ConfigError, match="CODE_EXEC_BWRAP_RO_BINDS"):
        BubblewrapSettings()


# --- the CLI -----------------------------------------------------------------------------------------------


def test_the_cli_file_options_end_to_end(backend: str, shared_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(shared_dir)
    (shared_dir / "in.csv").write_text("a,b\n1,2\n")
    (shared_dir / "inputs").mkdir(mode=0o755)
    (shared_dir / "inputs/y.txt").write_text("y\n")
    (shared_dir / "ro").mkdir(mode=0o755)
    (shared_dir / "ro/m.txt").write_text("mounted\n")
    for path in (shared_dir / "ro", shared_dir / "inputs"):
        path.chmod(0o755)
    script = ("mkdir -p out && cat in.csv data/y.txt /data/ro/m.txt > out/all.txt && touch /data/ro/x; "
              "echo ro=$? > out/ro.txt")
    done = CliRunner().invoke(cli, ["run", "--backend", backend, "--file", "in.csv", "--dir", "inputs:data",
                                    "--mount", f"{shared_dir / 'ro'}:/data/ro", "--collect", "out/*.txt", "--out",
                                    "res", "--", "sh", "-c", script])
    assert done.exit_code == 0, done.output
    assert (shared_dir / "res/out/all.txt").read_text() == "a,b\n1,2\ny\nmounted\n"
    assert (shared_dir / "res/out/ro.txt").read_text() == "ro=1\n"
    done = CliRunner().invoke(cli, ["run", "--backend", backend, "--dir", "inputs", "--out", "whole", "--",
                                    "sh", "-c", "cp inputs/y.txt copy.txt"])
    assert done.exit_code == 0, done.output
    assert sorted(os.listdir(shared_dir / "whole")) == ["copy.txt", "inputs"]
    done = CliRunner().invoke(cli, ["run", "--backend", backend, "--mount", f"{os.path.expanduser('~')}:/data",
                                    "--", "true"])
    assert done.exit_code == 125 and "home directory" in done.output, done.output
    assert sys.executable  # the CLI ran in this process: nothing outlives it (the sandboxes closed above)


def test_a_warm_pool_never_serves_a_run_that_has_mounts(shared_dir: Path) -> None:
    """Warm members are opened without mounts: a run with mounts must open its own sandbox, never take one."""
    _available("bubblewrap")
    (shared_dir / "m.txt").write_text("mounted\n")
    (shared_dir / "m.txt").chmod(0o644)
    with Runner(Settings(backend="bubblewrap", pool_size=1)) as runner:
        runner.warm("bubblewrap")
        plain = runner.run(["true"])
        result = runner.run(["cat", "/data/m.txt"], mounts=[Mount(shared_dir, "/data")])
    assert result.stdout == "mounted\n" and not result.pooled, result
    assert plain.exit_code == 0
