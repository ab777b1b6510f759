"""The reaper's wake-up (``controller/exits.py``): a watched process's exit, a notice from another thread, and
the end of the watch each wake the waiting thread; nothing wakes it twice for one exit."""

from __future__ import annotations

import signal
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor

from elastic_runtime.cluster.controller.exits import ExitWatch

LONG_S = 120.0  # longer than any test here; a wait that ran it out was not woken


def test_a_killed_child_wakes_the_wait_once() -> None:
    watch = ExitWatch()
    child = subprocess.Popen(["sleep", "600"])
    try:
        watch.watch(child.pid)
        assert watch.wait(0.0)  # watching a new process wakes the waiter to take it into its set
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(watch.wait, LONG_S)
            child.send_signal(signal.SIGKILL)
            assert waiting.result(timeout=LONG_S * 2)
        assert child.wait() == -signal.SIGKILL
        assert not watch.wait(0.05)  # its descriptor is dropped: readable for good, it would wake every wait
    finally:
        child.kill()
        child.wait()
        watch.close()


def test_a_process_reaped_before_it_was_watched_is_news_at_once() -> None:
    watch = ExitWatch()
    child = subprocess.Popen(["true"])
    child.wait()
    watch.watch(child.pid)
    assert watch.wait(LONG_S)
    watch.close()


def test_a_notice_from_another_thread_and_the_close_each_wake_the_waiter() -> None:
    watch = ExitWatch()
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(watch.wait, LONG_S)
        threading.Thread(target=watch.notify).start()  # as the fork server's reader does for its children
        assert waiting.result(timeout=LONG_S * 2)
        waiting = pool.submit(watch.wait, LONG_S)
        watch.close()  # the reaper cancelled: its thread must not sleep on, holding the descriptors
        assert waiting.result(timeout=LONG_S * 2)
    assert watch.wait(LONG_S)  # closed: returns at once
    watch.notify()  # and a late notice (the fork server's end) writes nowhere
