"""The runner: the one path of a request (``pipeline``: admit -> plan -> exec -> finish) and what callers hold.

``AsyncRunner`` (async_runner) is the core; ``Runner`` is its sync facade (sync; the event loop runs in a helper
thread, loop_thread, so it also works inside programs that already run an event loop). Sessions: ``AsyncSandbox``
(sandbox) / ``Sandbox`` (sync).
"""

from execbox.runner.async_runner import AsyncRunner
from execbox.runner.loop_thread import run_blocking
from execbox.runner.sandbox import AsyncSandbox
from execbox.runner.sync import Runner, Sandbox

__all__ = ["AsyncRunner", "AsyncSandbox", "Runner", "Sandbox", "run_blocking"]
