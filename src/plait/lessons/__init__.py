"""`plait lessons`: the comparisons courses on distributed training draw, run for real.

Each lesson is one module with `cases` (the runs it needs, as configs) and `section` (what
the runs measured next to the published formula, with figures). `runner.py` launches the
cases through plait's own launcher and writes the report (`writeup.py`).
"""
