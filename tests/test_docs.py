"""The docs name what the code has: every public event is in the catalogue."""

from __future__ import annotations

from pathlib import Path

import runtime
from runtime.events import Event

ROOT = Path(__file__).resolve().parent.parent


def test_every_public_event_is_in_the_catalogue() -> None:
    catalogue = (ROOT / "docs" / "events.md").read_text()
    public = [
        name
        for name in runtime.__all__
        if isinstance(getattr(runtime, name), type) and issubclass(getattr(runtime, name), Event)
    ]
    assert len(public) > 30
    missing = [name for name in public if name != "Event" and f"| `{name}` |" not in catalogue]
    assert not missing, f"docs/events.md lacks {missing}"
