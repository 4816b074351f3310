"""Pipeline schedules as data: actions, schedule builders, the validator, the simulator, the
stage split, 2BW's update cuts, and charts of planned or measured timelines.

Nothing here starts a process or holds a process group: schedules are data, tested as data
(DeepSpeed's pipeline instructions are the model). `parallel/pipeline/` executes them;
`cli/schedule.py` is `plait schedule`. Start at `actions.py`, then `schedules.py`.
"""
