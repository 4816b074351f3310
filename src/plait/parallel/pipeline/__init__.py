"""Pipeline parallelism at run time: the model pruned to this rank's stages (`stage.py`),
point-to-point exchange (`p2p.py`), the walker of a schedule's actions (`executor.py`), the
split backward of zero-bubble schedules (`split_backward.py`), this rank's pipeline inside
the trainer (`driver.py`) and PipeDream-2BW's stream and weight versions. The schedules
themselves are pure data in `plait.schedule`.
"""
