"""``ray_cluster.add_node`` (and the head, through the same retry): a node Ray gave up waiting for is started
again, up to three tries; any other error, or the third slow start, is raised as it came. Ray's own slowness
cannot be brought about on purpose, so a cluster object stands in for ``ray.cluster_utils.Cluster``."""

from __future__ import annotations

from typing import Any

import pytest

from elastic_runtime.cluster.controller.ray_cluster import add_node

SLOW = RuntimeError("The current node timed out during startup. This could happen because ...")


class Cluster:
    """Fails its first ``add_node`` calls with the given errors, then returns a node."""

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)
        self.calls = 0

    def add_node(self, **kwargs: Any) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "node"


def test_a_node_slow_to_start_is_started_again() -> None:
    cluster = Cluster(SLOW, SLOW)
    assert add_node(cluster) == "node"
    assert cluster.calls == 3


def test_the_third_slow_start_is_raised() -> None:
    cluster = Cluster(SLOW, SLOW, SLOW)
    with pytest.raises(RuntimeError, match="timed out during startup"):
        add_node(cluster)
    assert cluster.calls == 3


def test_any_other_error_is_raised_at_once() -> None:
    cluster = Cluster(ValueError("bad address"))
    with pytest.raises(ValueError, match="bad address"):
        add_node(cluster)
    assert cluster.calls == 1
