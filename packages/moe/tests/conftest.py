from tessera.comm.testing.fixtures import worker_pools  # noqa: F401
