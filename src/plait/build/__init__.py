"""Building one rank's share of a training run, apart from running it (`plait.train`).

`rank.build_rank(cfg, mesh)` reads as a recipe's setup, one step after the other: the corpus
(`corpus.py`), the first weights' source (`model.first_weights`: the seed, a Hugging Face
folder, a PEFT adapter, NF4), the model built on the meta device and parallelized before any
memory is touched (`model.build_model`), then the optimizer engine and the runner of the
micro-batches that the layout asks for (`rank.engine_and_runner`). It returns the parts
(`rank.RankParts`); the Trainer steps and evaluates them, `checkpoint/run_state.py` saves and loads
them. Import from the modules.
"""
