"""Observability: Prometheus metrics fed from engine stats (`ServerMetrics`, an AsyncEngine
observer) and the periodic stats log line (`StatsLogger`). No Prometheus import lives in
`engine/`; the engine only keeps counters and per-step stats."""

from nanollmserve.metrics.prometheus import CONTENT_TYPE_LATEST, ServerMetrics
from nanollmserve.metrics.stats_logger import StatsLogger, format_stats_line

__all__ = ["CONTENT_TYPE_LATEST", "ServerMetrics", "StatsLogger", "format_stats_line"]
