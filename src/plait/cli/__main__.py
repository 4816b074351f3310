"""`python -m plait.cli`: what torchrun and Slurm launch on every rank."""

import sys

from plait.cli import main

sys.exit(main())
