"""`python -m execbox.cli`: the execbox command line, as the `execbox` program runs it in this process."""

from execbox.cli import main

main()
