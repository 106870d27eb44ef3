"""Memory estimates and automatic plans: what a configuration needs, and which one fits."""
from fz.planning.counts import Counts
from fz.planning.estimator import Estimate, estimate
from fz.planning.ladder import plan
from fz.planning.table import estimate_table

__all__ = ["Counts", "Estimate", "estimate", "estimate_table", "plan"]
