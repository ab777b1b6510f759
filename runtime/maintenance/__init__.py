"""Maintenance and preemption notices from Google Cloud, as events: interchangeable sources, one intake.

Sources: :class:`PubSubListener` (Cloud Logging sink, GKE cluster notifications, our own JSON format) and
:class:`MetadataWatcher` (the metadata server of a GCE or TPU VM). Both parse with :mod:`.formats` and pass
what they parse through one :class:`NoticeIntake` (this job's instances only, each notice once, in order), and
say whether they work (``NoticeSourceReady``, ``NoticeSourceFailed``; :class:`NoticeSourceUnavailable`). The
drain handlers act on each instance's window as :mod:`.reconcile` folds it from the notices.
``PubSubListener`` is imported on first use: the Pub/Sub client takes most of a second to import.
"""

from typing import TYPE_CHECKING, Any

from elastic_runtime.maintenance.formats import CUSTOM_FORMAT, ParsedNotice, parse_message
from elastic_runtime.maintenance.intake import InstanceMatcher, NoticeIntake
from elastic_runtime.maintenance.metadata import MetadataUnavailable, MetadataWatcher
from elastic_runtime.maintenance.source import BusContext, DispatchTracker, NoticeSourceUnavailable, SourceContext

if TYPE_CHECKING:
    from elastic_runtime.maintenance.pubsub import PubSubListener, StreamBroken

__all__ = [
    "CUSTOM_FORMAT",
    "BusContext",
    "DispatchTracker",
    "InstanceMatcher",
    "MetadataUnavailable",
    "MetadataWatcher",
    "NoticeIntake",
    "NoticeSourceUnavailable",
    "ParsedNotice",
    "PubSubListener",
    "SourceContext",
    "StreamBroken",
    "parse_message",
]


def __getattr__(name: str) -> Any:
    if name in ("PubSubListener", "StreamBroken"):
        from elastic_runtime.maintenance import pubsub

        return getattr(pubsub, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
