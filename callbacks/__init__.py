"""Lightning callbacks that measure a conversion (importable as ``rfkit.callbacks``)."""

from rfkit.callbacks.cache import CacheMonitor
from rfkit.callbacks.perplexity import PerplexityMonitor
from rfkit.callbacks.state_audit import StateAudit
from rfkit.callbacks.summary import RunSummary

__all__ = ["CacheMonitor", "PerplexityMonitor", "RunSummary", "StateAudit"]
