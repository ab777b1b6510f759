"""Helpers the maintenance tests share: a topic with its subscription on the emulator.

A module of its own, because ``from conftest import ...`` finds whichever conftest was imported last.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

PROJECT = "elastic-test"


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
