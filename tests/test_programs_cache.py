"""Kept programs (runtime/core/programs.py) beside JAX's persistent compilation cache.

On CPU an executable that the persistent cache gave, serialized again and loaded, fails at its first run (``NOT_FOUND:
Function ... not found``): a group that kept its restore program that way gave up its run after a re-form
(``bench_goodput_multiprocess.py``, its second round, the cache warm from the first). The store keeps only what it
compiled itself. Each case runs in a fresh interpreter, whose cache folder is set before JAX starts.
"""

from __future__ import annotations

from pathlib import Path

from elastic_runtime.testing.fresh_process import run_with_compile_cache

SCRIPT = """
import json, pickle
import jax, jax.numpy as jnp
from jax.experimental import serialize_executable
from elastic_runtime.core.programs import ProgramStore

def f(x, y):
    return (jax.lax.bitcast_convert_type(x, jnp.int32) ^ 7).astype(jnp.float32) * y + jnp.sin(y)

x, y = jnp.ones((256,), jnp.float32), jnp.arange(256, dtype=jnp.float32)
expected = float(f(x, y).sum())
lower = lambda: jax.jit(f).lower(x, y)
mesh = jax.sharding.Mesh(jax.devices()[:1], ("x",))

def reloaded(program):
    try:
        payload = pickle.dumps(serialize_executable.serialize(program))
        again = serialize_executable.deserialize_and_load(*pickle.loads(payload))
        return float(again(x, y).sum()) == expected
    except Exception as exc:
        return type(exc).__name__ + ": " + str(exc)[:200]

out = {}
cold = ProgramStore()
program = cold.compiled("f", mesh, 0, lower)
out["cold_kept"] = len(cold._kept) == 1
out["cold_reloaded"] = reloaded(program)
loaded = ProgramStore()
loaded._kept = dict(cold._kept)
out["kept_runs"] = float(loaded.compiled("f", mesh, 0, lower)(x, y).sum()) == expected and loaded.loaded == ["f"]
jax.clear_caches()  # the next compile is served by the persistent cache
warm = ProgramStore()
program = warm.compiled("f", mesh, 0, lower)
out["warm_runs"] = float(program(x, y).sum()) == expected
out["warm_kept"] = len(warm._kept) == 1
out["warm_reloaded"] = reloaded(program)
print("RESULT " + json.dumps(out))
"""


def test_a_program_from_the_persistent_cache_is_not_kept_because_it_does_not_reload(tmp_path: Path) -> None:
    out = run_with_compile_cache(SCRIPT, tmp_path / "cache")
    # Compiled here: kept, and a kept program loads and runs.
    assert out["cold_kept"] and out["cold_reloaded"] is True and out["kept_runs"], out
    # Served by the cache: it runs, but serialized again it does not (the premise: when a JAX release fixes
    # this, this assertion fails and the store may keep such programs again), so the store did not keep it.
    assert out["warm_runs"], out
    assert out["warm_reloaded"] is not True, out
    assert not out["warm_kept"], out
