"""JAX's persistent compilation cache during a run: in the run folder by default, JAX's own setting kept when
the program made one, and put back when the run ends; a second run with the same cache loads, not compiles."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import pytest

from elastic_runtime import ConfigError, ElasticRuntime, MeshPolicy, RuntimeConfig
from elastic_runtime.core.compile_cache import cache_dir, persistent_cache
from elastic_runtime.testing.demo_model import demo_job

DIR = "jax_compilation_cache_dir"


@pytest.fixture
def users_cache() -> Iterator[None]:
    """The program set JAX's cache folder itself (restored after the test)."""
    jax.config.update(DIR, "/somewhere/of/theirs")
    yield
    jax.config.update(DIR, None)


def test_the_default_is_the_run_folder_and_off_turns_it_off() -> None:
    assert cache_dir("run_dir", "runs/a") == "runs/a/xla-cache"
    assert cache_dir("run_dir", None) is None  # no run folder: nowhere to put it
    assert cache_dir("/elsewhere", "runs/a") == "/elsewhere"
    assert cache_dir("off", "runs/a") is None
    assert cache_dir("jax", "runs/a") is None


def test_the_programs_own_setting_wins_over_the_run_folder(users_cache: None) -> None:
    assert cache_dir("run_dir", "runs/a") == "/somewhere/of/theirs"
    assert cache_dir("jax", "runs/a") == "/somewhere/of/theirs"
    assert cache_dir("off", "runs/a") is None
    with persistent_cache("off", "runs/a") as path:
        assert path is None and jax.config.values[DIR] is None
    assert jax.config.values[DIR] == "/somewhere/of/theirs"  # put back


def test_an_empty_folder_name_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="compile_cache"):
        RuntimeConfig(compile_cache=" ")


def count_cache_hits() -> tuple[list[str], Any]:
    seen: list[str] = []

    def listen(event: str, **kwargs: Any) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            seen.append(event)

    jax.monitoring.register_event_listener(listen)
    return seen, listen


def test_a_run_fills_the_cache_in_its_folder_and_the_next_run_loads_from_it(tmp_path: Path) -> None:
    job = demo_job(global_batch=24, features=16, hidden=64)
    policy = MeshPolicy({"data": 4, "model": 2}, global_batch=24, slice_size=2)

    def run(name: str) -> None:
        config = RuntimeConfig(run_dir=str(tmp_path / name), checkpoint_dir="", compile_cache=str(tmp_path / "cache"))
        ElasticRuntime(job, config=config, mesh_policy=policy).run(steps=3)

    hits, listener = count_cache_hits()
    try:
        run("first")
        assert jax.config.values[DIR] is None  # the process's setting is back
        written = list((tmp_path / "cache").iterdir())
        assert written, "the first run wrote nothing to the cache"
        first_hits = len(hits)
        jax.clear_caches()  # as in a new process: what JAX compiled in this one is not in memory for the next run
        run("second")
    finally:
        jax.monitoring.unregister_event_listener(listener)
    assert len(hits) > first_hits, "the second run compiled what the first one had cached"


def test_the_default_cache_is_under_the_run_folder(tmp_path: Path) -> None:
    jax.clear_caches()  # the step compiled by an earlier test would be served from memory, not written
    job = demo_job(global_batch=24, features=16, hidden=64)
    config = RuntimeConfig(run_dir=str(tmp_path), checkpoint_dir="", precompile=False)
    ElasticRuntime(job, config=config, mesh_policy=MeshPolicy({"data": 4, "model": 2})).run(steps=2)
    assert any((tmp_path / "xla-cache").iterdir())
