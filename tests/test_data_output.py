"""What `plait tokenizer train` and `plait data prepare` print (cli/data.py), in-process."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

from plait.cli import data as data_cli
from plait.cli import main


def test_tokenizer_train_prints_one_line_with_the_whole_hash(tmp_path: Path, capsys) -> None:
    """No blank lines from HF's bars when stdout is not a terminal; the hash unbroken."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat\n" * 200)
    out = tmp_path / "t.json"
    argv = ["tokenizer", "train", "--data", str(corpus), "--vocab-size", "270", "--out", str(out)]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1, lines
    assert re.fullmatch(
        rf"wrote {re.escape(str(out))}: vocabulary \d+, sha256 [0-9a-f]{{64}}", lines[0]
    )


def test_prepare_speed_is_bytes_over_wall_time_since_start(monkeypatch) -> None:
    """The bar's speed and the last line's are one measure: a burst of progress after a
    long wait reads as the average since the start, not the burst's rate."""
    assert data_cli.mb_per_s(3e6, 2.0) == "1.5 MB/s"
    assert data_cli.mb_per_s(10, 0.0) == "? MB/s"
    monkeypatch.setattr(data_cli.time, "perf_counter", lambda: 100.0)
    column = data_cli._SpeedSinceStart(began=90.0)
    task = SimpleNamespace(completed=9e6)
    assert column.render(task).plain == data_cli.mb_per_s(9e6, 10.0) == "0.9 MB/s"
