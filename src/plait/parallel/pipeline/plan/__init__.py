"""The pure plan of a pipeline: actions, schedules, the validator, the simulator, 2BW cuts.

Nothing here starts a process or touches a tensor: schedules are data, tested as data.
"""
