"""Fixtures for the maintenance tests: the real Pub/Sub emulator (one per session), topics and helpers.

The emulator is Google's (package ``google-cloud-cli-pubsub-emulator``, on this project's machine image). If
it is missing the Pub/Sub tests skip with a reason that says so; set ``ELASTIC_RUNTIME_REQUIRE_EMULATORS=1``
(CI does) to make that a failure instead.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from pubsub_emulator import EmulatorMissing, PubSubEmulator

PROJECT = "elastic-test"


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


@dataclass
class Topic:
    """A topic with one subscription on the emulator, and a publisher for it."""

    project: str
    topic: str
    subscription: str
    publisher: Any

    def publish(self, data: bytes, **attributes: str) -> str:
        message_id: str = self.publisher.publish(self.topic, data, **attributes).result(timeout=30)
        return message_id


def make_topic(publisher: Any, subscriber: Any, name: str | None = None) -> Topic:
    name = name or f"t{uuid.uuid4().hex[:12]}"
    topic = publisher.topic_path(PROJECT, name)
    subscription = subscriber.subscription_path(PROJECT, f"{name}-sub")
    publisher.create_topic(name=topic)
    subscriber.create_subscription(name=subscription, topic=topic, ack_deadline_seconds=10)
    return Topic(PROJECT, topic, subscription, publisher)


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
