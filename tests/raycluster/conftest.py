"""The module-scoped cluster: two namespaces, toolenv deployed through the CLI, torn down by PID."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from ray_support import BASE_CONFIG, RayEnv

from toolenv.ray.netns import NetnsCluster


@pytest.fixture(scope="module")
def ray_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayEnv]:
    cluster = NetnsCluster(workers=1, num_cpus=2)
    cluster.start()
    env = RayEnv(cluster, tmp_path_factory.mktemp("ray"))
    try:
        env.deploy(BASE_CONFIG, "base")
        yield env
    finally:
        try:
            env.helper("shutdown", cluster.address, timeout=60)
        finally:
            cluster.stop()
