"""The memory estimator: what every rank holds, predicted from the config alone (pure).

`estimate(cfg)` returns an `Estimate`; `plait estimate` prints it; docs/memory.md explains
every term and compares it with measurements.
"""

from plait.estimate.core import estimate
from plait.estimate.lines import Estimate, Line, RankEstimate

__all__ = ["Estimate", "Line", "RankEstimate", "estimate"]
