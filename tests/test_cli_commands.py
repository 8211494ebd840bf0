"""Commands a plugin adds to the execbox command line (hook ``execbox_register_commands``): listed and run as
execbox's own, never in place of one, loaded only when a command line needs them (never for `execbox run`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from execbox import registry
from execbox.cli import main
from execbox.registry import PluginWarning
from tests.support.fixtures import FakeDistributions, fake_dists, fresh_registry, home, local_mode  # noqa: F401 (fixtures)

HELLO = '''
import json

import click
from execbox import ConfigError, hookimpl

CALLS = []

@click.group()
def hello():
    """Greetings from a plugin."""

@hello.command("say")
@click.option("--json", "as_json", is_flag=True)
@click.option("--fail", is_flag=True)
def say(as_json, fail):
    """Say hello."""
    if fail:
        raise ConfigError("no greeting configured", env_var="HELLO_GREETING")
    click.echo(json.dumps({"hello": "world"}) if as_json else "hello, world")

@hookimpl
def execbox_register_commands(cli):
    CALLS.append(cli)
    cli.add_command(hello)
'''


def cli(*args: str) -> Result:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


@pytest.fixture
def hello(fake_dists: FakeDistributions) -> str:  # noqa: F811
    """An installed plugin whose hook adds `execbox hello say`; its module's CALLS holds each call of the hook."""
    return fake_dists.add("hello-plugin", source=HELLO)


def test_a_plugins_command_is_listed_and_runs(hello: str) -> None:
    listed = cli("--help")
    assert "hello     Greetings from a plugin." in listed.stdout
    assert "image     Sandbox images for the docker backend." in listed.stdout  # the built-in docker backend's
    done = cli("hello", "say")
    assert (done.exit_code, done.stdout) == (0, "hello, world\n")
    assert cli("hello", "say", "--json").stdout == '{"hello": "world"}\n'


def test_an_error_from_a_plugins_command_is_reported_as_execboxs_own(hello: str) -> None:
    text = cli("hello", "say", "--fail")
    assert (text.exit_code, text.stdout) == (2, "")  # a ConfigError: a usage or configuration error
    assert text.stderr == "execbox: ConfigError: no greeting configured\n"
    as_json = cli("hello", "say", "--fail", "--json")
    assert as_json.exit_code == 2
    error = json.loads(as_json.stdout)["error"]
    assert (error["type"], error["message"], error["env_var"]) == ("ConfigError", "no greeting configured",
                                                                   "HELLO_GREETING")


def test_a_plugin_cannot_replace_a_command(fake_dists: FakeDistributions) -> None:  # noqa: F811
    fake_dists.add("usurper", source=textwrap.dedent('''
        import click
        from execbox import hookimpl

        @click.command()
        def run():
            click.echo("not execbox's run")

        @click.command()
        def image():
            click.echo("not docker's image")

        @click.command()
        def extra():
            click.echo("extra")

        @hookimpl
        def execbox_register_commands(cli):
            for command in (run, image, extra):
                cli.add_command(command)
    '''))
    with pytest.warns(PluginWarning) as warned:
        listed = cli("--help")
    assert sorted(str(w.message) for w in warned) == [
        f"execbox plugin from distribution 'usurper' adds the command {name!r}, which the execbox command line "
        "already has: it is left out" for name in ("image", "run")]
    assert "Sandbox images for the docker backend." in listed.stdout and "extra" in listed.stdout
    assert "Run a command (after --)" in cli("run", "--help").stdout
    assert cli("extra").stdout == "extra\n"


def test_a_plugin_that_fails_while_adding_commands_is_a_warning(fake_dists: FakeDistributions) -> None:  # noqa: F811
    fake_dists.add("raising-commands", source=textwrap.dedent('''
        from execbox import hookimpl

        @hookimpl
        def execbox_register_commands(cli):
            raise RuntimeError("boom")
    '''))
    with pytest.warns(PluginWarning, match="'raising-commands' failed while adding its commands.*boom"):
        listed = cli("--help")
    assert listed.exit_code == 0 and "image" in listed.stdout


def test_builtin_commands_that_fail_to_load_are_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "BUILTIN_COMMANDS", ["execbox_no_such_commands"])
    with pytest.warns(PluginWarning, match="execbox's own commands from execbox_no_such_commands failed to load"):
        listed = cli("--help")
    assert listed.exit_code == 0 and "run " in listed.stdout and "image" not in listed.stdout


def test_execbox_run_does_not_ask_for_the_plugins_commands(hello: str, local_mode: None) -> None:  # noqa: F811
    done = cli("run", "--backend", "local_subprocess", "--", "true")
    assert done.exit_code == 0, done.output
    plugin = sys.modules[hello]  # loaded with the registry the run built
    assert plugin.CALLS == []
    cli("hello", "say")
    assert len(plugin.CALLS) == 1  # the control: a command line that names one asks, once
    cli("--help")
    assert len(plugin.CALLS) == 1


def test_invalid_settings_leave_the_builtin_commands_and_name_the_problem(hello: str,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CODE_EXEC_MAX_TIMEOUT_SEC", "not a number")
    assert "image" in cli("--help").stdout  # which third-party plugins to load is unknown: not them
    done = cli("hello", "say")
    assert done.exit_code == 2 and "CODE_EXEC_MAX_TIMEOUT_SEC" in done.stderr, done.output


def test_execbox_run_imports_no_command_module(tmp_path: Path) -> None:
    """In a fresh process: a run loads no plugin's command module (the docker backend's among them); the control,
    `execbox image --help`, does."""
    code = textwrap.dedent("""
        import json, sys
        from execbox.cli import main
        try:
            main(sys.argv[1:])
        except SystemExit:
            pass
        print(json.dumps("execbox.backends.docker.cli" in sys.modules))
    """)
    env = {**os.environ, "HOME": str(tmp_path), "CODE_EXEC_LOCAL": "true", "CODE_EXEC_NETWORK": "host"}
    loaded = []
    for args in (["run", "--backend", "local_subprocess", "--", "true"], ["image", "--help"]):
        done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120,
                              env=env, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        loaded.append(json.loads(done.stdout.splitlines()[-1]))
    assert loaded == [False, True]

