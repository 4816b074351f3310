"""`plait presets`: the model presets with their parameter counts."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from plait.models.presets import get_preset, preset_names
from plait.models.transformer import count_parameters


def add_parser(sub: argparse._SubParsersAction) -> None:
    sub.add_parser("presets", help="list model presets with their parameter counts")


def run(args: argparse.Namespace, err: Console) -> int:
    table = Table(title="plait model presets")
    for col in ("name", "parameters", "layers", "hidden", "heads", "kv heads", "vocab"):
        table.add_column(col)
    for name in preset_names():
        m = get_preset(name)
        table.add_row(
            name,
            f"{count_parameters(m):,}",
            str(m.n_layers),
            str(m.d_model),
            str(m.n_heads),
            str(m.kv_heads),
            str(m.vocab_size),
        )
    Console().print(table)
    return 0
