"""The ``execbox`` program: hands its command line to a resident server (``execbox serve``) when
``CODE_EXEC_SERVER`` names one, else runs the CLI in this process. Imports nothing heavy before it knows."""

from __future__ import annotations

import gc
import os
import sys


def main() -> None:
    from execbox import resident

    path = os.environ.get(resident.SERVER_VAR)
    if path and not resident.starts_a_server(sys.argv[1:]):
        code = resident.forward(path, sys.argv[1:])
        if code is not None:
            os._exit(code)  # no teardown: this process imported almost nothing and wrote nothing; its child ended
    # No collection while the CLI's modules load (a process that imports ~600 modules ran several full ones, ~25
    # ms); then what they made is frozen out of later collections, which a long-lived command (mcp, serve) runs.
    gc.disable()
    try:
        from execbox.cli import main as cli_main
    finally:
        gc.freeze()
        gc.enable()
    cli_main()
