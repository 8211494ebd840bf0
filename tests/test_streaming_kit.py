"""The kit's streaming checks catch a backend that claims streaming and buffers (a third-party plugin built from
the public kit), through both of the check's paths (a session to answer in, or one-shot runs only); the same
backend, honest, passes; and the output check holds for a backend that does not stream at all."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from execbox import Runner, Settings
from execbox.testing.checks import CHECKS, Kit
from tests.support.fixtures import FakeDistributions, fake_dists, fresh_registry, only_local_builtin  # noqa: F401

PLUGIN = '''
from execbox import plugin


class Buffered(plugin.HostWorkspaceSession):
    """Streams nothing: the caller sees the output when the run ends (what a plugin written before streaming does)."""

    async def exec(self, request):
        return await super().exec(request.model_copy(update={"on_output": None}))


def backend(name, session_cls, *, streaming, sessions):
    class Backend(plugin.ExecutionBackend):
        capabilities = plugin.Capabilities(sandbox=False, isolation="process", network_modes=frozenset({"host"}),
                                           persistent_sessions=sessions, file_transfer=sessions, streaming=streaming)

        async def open_session(self, spec):
            return session_cls(prefix="execbox-streamkit-")

    Backend.name = name
    return Backend


BACKENDS = [
    backend("liar_buffers", Buffered, streaming=True, sessions=True),
    backend("liar_buffers_oneshot", Buffered, streaming=True, sessions=False),
    backend("honest_streams", plugin.HostWorkspaceSession, streaming=True, sessions=True),
    backend("honest_streams_oneshot", plugin.HostWorkspaceSession, streaming=True, sessions=False),
    backend("never_streams", Buffered, streaming=False, sessions=True),
]


@plugin.hookimpl
def execbox_register_backends(register):
    for cls in BACKENDS:
        register(cls)
'''

DELIVERS = "streaming_delivers_output_while_running"
IS_THE_RESULT = "streamed_output_is_the_result"


@pytest.fixture
def kit_for(only_local_builtin: None, fake_dists: FakeDistributions) -> Callable[[str], Kit]:
    fake_dists.add("execbox-test-streamkit", ep_name="streamkit", source=PLUGIN)

    def open_kit(name: str) -> Kit:
        return Kit.open(Runner(Settings(local=True, network="host")), name)

    return open_kit


@pytest.mark.parametrize("name", ["liar_buffers", "liar_buffers_oneshot"])
def test_a_claimed_stream_that_buffers_fails_naming_the_claim(kit_for: Callable[[str], Kit], name: str) -> None:
    kit = kit_for(name)
    with pytest.raises(AssertionError, match=r"^a claimed stream delivers output while the command runs: expected"):
        CHECKS[DELIVERS].body(kit)


@pytest.mark.parametrize("name", ["honest_streams", "honest_streams_oneshot"])
def test_the_same_backend_streaming_passes(kit_for: Callable[[str], Kit], name: str) -> None:
    kit = kit_for(name)
    assert CHECKS[DELIVERS].body(kit)  # a pass says what it saw
    CHECKS[IS_THE_RESULT].body(kit)


def test_a_backend_that_does_not_stream_still_delivers_its_result(kit_for: Callable[[str], Kit]) -> None:
    kit = kit_for("never_streams")
    CHECKS[IS_THE_RESULT].body(kit)  # its output reaches a streaming caller at the end, exactly the result
