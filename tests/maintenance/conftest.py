"""Fixtures for the maintenance tests: the real Pub/Sub emulator (one per session), topics and helpers.

The emulator is Google's (package ``google-cloud-cli-pubsub-emulator``, on this project's machine image). If
it is missing the Pub/Sub tests skip with a reason that says so; set ``ELASTIC_RUNTIME_REQUIRE_EMULATORS=1``
(CI does) to make that a failure instead.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from pubsub_emulator import EmulatorMissing, PubSubEmulator
from pubsub_support import PROJECT, Topic, make_topic  # noqa: F401 - used by the fixtures


def _missing(reason: str) -> None:
    message = f"Pub/Sub emulator unavailable, Pub/Sub tests NOT run: {reason}"
    if os.environ.get("ELASTIC_RUNTIME_REQUIRE_EMULATORS") == "1":
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="session")
def pubsub_emulator() -> Iterator[PubSubEmulator]:
    """One emulator for the session, with ``PUBSUB_EMULATOR_HOST`` pointing at it."""
    emulator = PubSubEmulator()
    try:
        emulator.start()
    except (EmulatorMissing, RuntimeError) as exc:
        _missing(str(exc))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PUBSUB_EMULATOR_HOST", emulator.host)
        try:
            yield emulator
        finally:
            emulator.stop()


@pytest.fixture(scope="session")
def pubsub_clients(pubsub_emulator: PubSubEmulator) -> Iterator[tuple[Any, Any]]:
    from google.cloud import pubsub_v1

    publisher = pubsub_v1.PublisherClient()
    subscriber = pubsub_v1.SubscriberClient()
    yield publisher, subscriber
    subscriber.close()


@pytest.fixture
def topic(pubsub_clients: tuple[Any, Any]) -> Topic:
    """A fresh topic and subscription for one test."""
    return make_topic(*pubsub_clients)
