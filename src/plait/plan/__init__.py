"""The planner behind `plait plan`: layouts enumerated, checked against memory (`estimate`)
and ranked by a predicted step time (pure: no process, no tensor). docs/planning.md."""

from plait.plan.enumerate import Candidate, Request
from plait.plan.hardware import Hardware, load_hardware
from plait.plan.search import Plan, plan

__all__ = ["Candidate", "Hardware", "Plan", "Request", "load_hardware", "plan"]
