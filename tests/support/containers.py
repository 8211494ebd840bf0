"""The containers an execbox process made, by its owner label, for tests that check nothing was left."""

from __future__ import annotations

from typing import Any


def containers_of(engine: Any, pid: int) -> list[str]:
    """Names of the containers (running or not) whose owner label names process ``pid``. One listing call:
    docker-py's containers.list inspects each container after listing it, and one removed in between (as
    these tests expect) made that raise NotFound."""
    listed = engine.api.containers(all=True, filters={"label": "io.execbox.owner"})
    return [c["Names"][0] for c in listed if c["Labels"].get("io.execbox.owner", "").split(":")[1:2] == [str(pid)]]
