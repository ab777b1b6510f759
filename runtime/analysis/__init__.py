"""What a run's event log says: goodput and badput, run summaries."""

from elastic_runtime.analysis.goodput import GoodputReport, goodput
from elastic_runtime.analysis.summary import summarize

__all__ = ["GoodputReport", "goodput", "summarize"]
