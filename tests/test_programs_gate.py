"""A thread that compiles ahead lets go of its lock while XLA compiles (elastic_runtime.core.programs.ProgramStore
.compiling_outside): a re-form waits for its trace, never for its compile, and a compile that ends after it was
told to stop is dropped."""

from __future__ import annotations

import threading
from typing import Any

import jax
from jax.sharding import Mesh

from elastic_runtime.core.programs import ProgramStore, Stopped


def test_another_thread_takes_the_lock_during_the_compile_and_the_compile_ends_stopped() -> None:
    mesh = Mesh(jax.devices()[:1], ("x",))
    store = ProgramStore()
    lock, stop = threading.Lock(), threading.Event()
    compiling, finish = threading.Event(), threading.Event()

    class SlowLowered:  # a compile that lasts until the test lets it end
        def compile(self) -> Any:
            compiling.set()
            finish.wait(60)
            return object()

    outcome: list[Any] = []

    def prepare() -> None:
        with lock, store.compiling_outside(lock, stop):
            try:
                outcome.append(store.compiled("slow", mesh, 0, SlowLowered))
            except Stopped:
                outcome.append("stopped")

    thread = threading.Thread(target=prepare)
    thread.start()
    assert compiling.wait(60)
    stop.set()
    assert lock.acquire(timeout=60)  # while the compile runs: it let go of the lock
    assert not finish.is_set() and thread.is_alive()
    lock.release()
    finish.set()
    thread.join(60)
    assert outcome == ["stopped"] and store.traced == []


def test_without_a_stop_the_compile_returns_and_the_lock_is_held_again() -> None:
    mesh = Mesh(jax.devices()[:1], ("x",))
    store = ProgramStore()
    lock, stop = threading.Lock(), threading.Event()
    lowered = jax.jit(lambda x: x * 2).lower(jax.numpy.ones(4))
    with lock, store.compiling_outside(lock, stop):
        program = store.compiled("double", mesh, 0, lambda: lowered)
        assert lock.locked()
    assert float(program(jax.numpy.ones(4)).sum()) == 8.0 and store.traced == ["double"]
    # Outside the block the store compiles as always, with no lock to let go of.
    assert store.compiled("double", mesh, 0, lambda: lowered) is not None and store.loaded == ["double"]
