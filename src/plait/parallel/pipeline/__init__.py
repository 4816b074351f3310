"""Pipeline parallelism at run time: the model pruned to this rank's stages (`stage.py`),
point-to-point exchange (`p2p.py`), the one walker of every schedule's actions and the
synchronous runtime (`walker.py`: start there to see how 1F1B runs), the split backward of
zero-bubble schedules (`split_backward.py`), this rank's pipeline inside the trainer
(`driver.py`) and what PipeDream-2BW adds: its stream (`two_bw.py`) and weight versions
(`weight_versions.py`). The schedules themselves are pure data in `plait.schedule`.
"""
