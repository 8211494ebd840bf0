from tests.support.fixtures import fake_dists, fresh_registry, only_local_builtin  # noqa: F401  (fixtures)
