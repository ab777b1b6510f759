"""JAX's persistent compilation cache for the length of a run: a restarted or resumed job loads its compiled
steps instead of compiling them again.

``RuntimeConfig.compile_cache`` chooses the folder: ``"run_dir"`` (the default) is ``<run_dir>/xla-cache``,
unless the program already set ``jax_compilation_cache_dir`` itself (then that one is used, untouched);
``"jax"`` leaves JAX's setting alone; ``"off"`` turns the cache off for the run; anything else is a folder.
The previous setting is put back when the run ends, since JAX's configuration belongs to the whole process.

On GPU, JAX leaves the device assignment out of the cache key, so the step compiled ahead for one degraded
mesh also serves every other mesh of the same shape (another lost slice). On CPU and TPU it does not; on CPU
``elastic_runtime.core.same_shape`` loads one compile onto the other meshes instead.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache

from elastic_runtime.core.folders import COMPILE_CACHE_FOLDER

log = logging.getLogger(__name__)

RUN_DIR, JAX, OFF = "run_dir", "jax", "off"


def cache_dir(setting: str, run_dir: str | None) -> str | None:
    """The folder the run's compiles are cached in (None: no cache), with JAX's current setting as it is."""
    current: str | None = jax.config.values[_DIR] or None
    if setting == OFF:
        return None
    if setting == JAX or (setting == RUN_DIR and (current or run_dir is None)):
        return current
    return str(Path(run_dir or "") / COMPILE_CACHE_FOLDER) if setting == RUN_DIR else setting


@contextlib.contextmanager
def persistent_cache(setting: str, run_dir: str | None) -> Iterator[str | None]:
    """Point JAX's persistent compilation cache at the run's folder while the block runs; yields the folder."""
    saved = {name: jax.config.values[name] for name in _OPTIONS}
    path = cache_dir(setting, run_dir)
    if path == (saved[_DIR] or None):  # nothing to change: JAX's own setting, or none and no cache wanted
        yield path
        return
    # Every compile of the run goes in, however quick: JAX's default skips those under a second, and a
    # recovery that loads ten of those still waits seconds.
    _configure({_DIR: path, _MIN_SECONDS: 0.0})
    log.debug("persistent compilation cache: %s", path or "off")
    try:
        yield path
    finally:
        _configure(saved)


_DIR, _MIN_SECONDS = "jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs"
_OPTIONS = (_DIR, _MIN_SECONDS)


def _configure(values: dict[str, object]) -> None:
    for name, value in values.items():
        jax.config.update(name, value)
    # JAX opens its cache once per process, on the first compile: reset, so that the next compile opens this one.
    compilation_cache.reset_cache()
