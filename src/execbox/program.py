"""The ``execbox`` program: hands its command line to a resident server (``execbox serve``) when
``CODE_EXEC_SERVER`` names one, else runs the CLI in this process. Imports nothing heavy before it knows."""

from __future__ import annotations

import os
import sys


def main() -> None:
    from execbox import resident

    path = os.environ.get(resident.SERVER_VAR)
    if path and sys.argv[1:2] != ["serve"]:
        code = resident.forward(path, sys.argv[1:])
        if code is not None:
            sys.stdout.flush()
            os._exit(code)  # no teardown: this process imported almost nothing, and the child has ended
    from execbox.cli import main as cli_main

    cli_main()
