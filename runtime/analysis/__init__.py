"""What a run's event log says: goodput and badput, run summaries."""

from runtime.analysis.goodput import GoodputReport, goodput
from runtime.analysis.summary import summarize

__all__ = ["GoodputReport", "goodput", "summarize"]
