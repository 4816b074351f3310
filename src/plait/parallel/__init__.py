"""The parallel engines, each a folder or a file with one concern: tensor parallelism (`tp/`),
pipeline parallelism at run time (`pipeline/`), ZeRO (`zero/`), naive data parallelism,
the optimizer-engine surface a step drives, the split-model gradient rules (`grads.py`),
plait's one AdamW, and activation recomputation. They learn about the model only from
its contract (`models/contract.py`); nothing here imports the trainer or the command line."""
