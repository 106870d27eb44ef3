"""Memory estimates and automatic plans: what a configuration needs, and which one fits."""
from fz.planning.counts import Counts
from fz.planning.estimate import Estimate, estimate

__all__ = ["Counts", "Estimate", "estimate"]
