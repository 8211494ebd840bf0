from tests.support.fixtures import (  # noqa: F401  (fixtures)
    anyio_backend,
    fake_backends,
    fake_dists,
    fresh_registry,
    home,
    local_mode,
    only_local_builtin,
    workspaces,
)
